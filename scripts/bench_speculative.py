"""Speculative decoding and the bf16 decode weights, measured: ratios in one run.

    python scripts/bench_speculative.py [--before REV] [--rounds 2] [--max-tokens 128]
                                        [--only serial,concurrent,mlx-lm,chunk] [--json FILE]
                                        [--chunk-run RUN_DIR] [--chunk-cases 6]

Workloads (gemma3-270m, greedy, as a user runs them):

- serial: one stream over HTTP (`/v1/completions`, streamed; decode tok/s = (tokens - 1) /
  (last token time - first token time)), three servers up at once and measured in turn, round
  after round: `before` (mlxlab at REV, default the commit before this work: float32
  projections, no speculation), `off` (this checkout, speculative=off: the bytes alone) and
  `lookup` (speculative=prompt_lookup). Two request sets: free prose (story openings) and
  copy-heavy (an answer that repeats or edits a passage of its prompt: a paragraph copied, a
  paragraph with a word replaced, a JSON list re-keyed, a function renamed).
- concurrent: 4 and 8 clients at once sending copy-heavy requests to batch=8 servers (`before`,
  `off`, `lookup`): aggregate tok/s = completion tokens / wall time.
- mlx-lm: mlx-lm's own speculative decoding (`stream_generate(draft_model=...)`, what
  `mlx_lm.generate --draft-model` runs) against mlx-lm plain, and mlxlab's draft_model mode
  against mlxlab plain, on the same draft: gemma3-270m's first 6 layers and its head written as
  a model directory (`self_draft`); mlx-lm 0.32 has no prompt lookup. In-process, one prompt.
- chunk: the chunk task's evaluation decode (answers that copy message uuids from their
  prompt) with an adapter (`--chunk-run`: a chunk_seg4 run directory: its adapter, else the
  base model, and its test split), `--chunk-cases` cases, at batch sizes 1, 8 and 32, off and
  prompt_lookup, plain and constrained; every decode after a first one reuses the prompts' KV
  (the decode phase alone), and the texts are compared.

The machine is shared: every figure is a median of rounds interleaved across the sides, and the
ratios are what to read.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
from bench_serve import events, free_port, start  # noqa: E402

PASSAGE = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "developed a system of movable metal type in the German city of Mainz. Before his invention, "
    "books were copied by hand, a slow and expensive process that kept them out of reach of most "
    "people. The new machines spread quickly across Europe, and within fifty years millions of "
    "books had been printed. Cheaper books helped more people learn to read, and ideas travelled "
    "faster than ever before."
)
RECORDS = json.dumps(
    [
        {"id": f"c9f1{i:02d}e4-7b2a-4d{i:02d}-9a31-5e8f{i:04d}aa", "city": c, "count": 3 * i + 1}
        for i, c in enumerate(["Lyon", "Porto", "Ghent", "Turku", "Split", "Bergen"])
    ],
    indent=1,
)
CODE = '''def total_price(items, tax_rate):
    """The price of `items` with tax."""
    subtotal = 0.0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    return round(subtotal + tax, 2)
'''
PROSE = [
    "Chapter One\n\nThe lighthouse keeper had not slept for three nights. The storm",
    "The old market town sat where two rivers met, and every spring the merchants",
    "Dear Margaret,\n\nI write to you from the hills above the harbour, where the",
]
COPY = [
    "Original paragraph:\n\n" + PASSAGE + "\n\nThe same paragraph, copied exactly:\n\n",
    "Draft:\n\n"
    + PASSAGE
    + "\n\nThe draft again, with 'books' replaced by 'volumes' everywhere:\n\n",
    "Records:\n" + RECORDS + "\n\nThe same records with the key 'city' renamed to 'town':\n",
    "# before\n" + CODE + "\n# after: the function renamed to price_with_tax\n",
]


def stream(url: str, prompt: str, max_tokens: int) -> dict:
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    first = last = None
    usage, pieces = None, []
    for ev in events(url, "/v1/completions", body, 1200):
        usage = ev.get("usage") or usage
        for ch in ev.get("choices") or []:
            if ch.get("text"):
                last = time.perf_counter()
                first = first or last
                pieces.append(ch["text"])
    end = time.perf_counter()
    tokens = (usage or {}).get("completion_tokens", 0)
    span = (last or end) - (first or t0)
    return {
        "tokens": tokens,
        "decode_tok_s": (tokens - 1) / span if tokens > 1 and span > 0 else float("nan"),
        "wall_s": end - t0,
        "text": "".join(pieces),
    }


def worktree(rev: str) -> Path:
    """The tree of `rev` (`git archive`: no worktree registered) with its CPU kernels built in
    place (reused when there)."""
    sha = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", rev], capture_output=True, text=True
    ).stdout.strip()
    path = Path(tempfile.gettempdir()) / f"mlxlab-bench-{sha}"
    if not path.exists():
        tmp = path.with_name(path.name + ".part")
        tmp.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(
            ["git", "-C", str(REPO), "archive", sha], capture_output=True, check=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive, check=True)
        tmp.rename(path)
    if not list((path / "mlxlab" / "kernels").glob("_kernels*.so")):
        subprocess.run(
            [sys.executable, "setup.py", "build_ext", "--inplace"],
            cwd=path,
            check=True,
            capture_output=True,
        )
    return path


class Server:
    def __init__(self, name: str, cwd: Path, *options: str):
        self.name, self.port = name, free_port()
        cmd = [sys.executable, "-m", "mlxlab", "serve", f"port={self.port}", *options]
        self.proc = start(cmd, self.port, cwd)
        self.url = f"http://127.0.0.1:{self.port}"

    def stats(self) -> dict:
        return httpx.get(f"{self.url}/stats", timeout=30).json().get("speculative") or {}

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


def servers(args, batch: int) -> list[Server]:
    common = ["model=gemma3-270m", f"batch={batch}", "memory_budget_gb=4", "prompt_cache_gb=0.5"]
    made = []
    try:
        made.append(Server("before", worktree(args.before), *common))
        made.append(Server("off", REPO, *common))
        made.append(Server("lookup", REPO, *common, "speculative=prompt_lookup"))
    except BaseException:
        for s in made:
            s.stop()
        raise
    return made


def serial(args) -> dict:
    sides = servers(args, 1)
    out: dict = {}
    try:
        for s in sides:  # warm-up, and the answers to compare
            stream(s.url, "Hello", 4)
        texts: dict = {}
        runs = {w: {s.name: [] for s in sides} for w in ("prose", "copy")}
        for r in range(args.rounds):
            for work, prompts in (("prose", PROSE), ("copy", COPY)):
                for p in prompts:
                    for s in sides:
                        got = stream(s.url, p, args.max_tokens)
                        runs[work][s.name].append(got["decode_tok_s"])
                        texts.setdefault((work, p), {})[s.name] = got["text"]
                        print(
                            f"round {r + 1} {work:<5} {s.name:<7} {got['decode_tok_s']:6.2f} tok/s",
                            flush=True,
                        )
        for work, by in runs.items():
            out[work] = {name: statistics.median(v) for name, v in by.items()}
        out["same_text"] = {
            name: all(t[name] == t["off"] for t in texts.values()) for name in ("before", "lookup")
        }
        out["lookup_counts"] = sides[2].stats()
    finally:
        for s in sides:
            s.stop()
    return out


def concurrent(args) -> dict:
    sides = servers(args, 8)
    out: dict = {}
    try:
        for s in sides:
            stream(s.url, "Hello", 4)
        for clients in (4, 8):
            walls = {s.name: [] for s in sides}
            for r in range(args.rounds):
                for s in sides:
                    done = []

                    def client(i, url=s.url, done=done):
                        done.append(stream(url, COPY[i % len(COPY)], args.max_tokens)["tokens"])

                    t = time.perf_counter()
                    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
                    for th in threads:
                        th.start()
                    for th in threads:
                        th.join()
                    rate = sum(done) / (time.perf_counter() - t)
                    walls[s.name].append(rate)
                    print(
                        f"round {r + 1} {clients} clients {s.name:<7} {rate:6.2f} tok/s", flush=True
                    )
            out[f"{clients}_clients"] = {n: statistics.median(v) for n, v in walls.items()}
        out["lookup_counts"] = sides[2].stats()
    finally:
        for s in sides:
            s.stop()
    return out


MLX_LM = r"""
import json, sys, time
side, model_dir, draft_dir, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
prompt = sys.argv[5]
if side.startswith("mlx-lm"):
    if "f32" in side:  # matched: float32 weights and the BLAS mlxlab loads
        import mlxlab
    import mlx.core as mx
    from mlx_lm import load
    model, tok = load(model_dir)
    draft = load(draft_dir)[0] if side.endswith("draft") else None
    if "f32" in side:
        model.set_dtype(mx.float32)
        if draft is not None:
            draft.set_dtype(mx.float32)
    from mlx_lm.generate import stream_generate
    ids = tok.encode(prompt)
    t, first, count = time.perf_counter(), None, 0
    for r in stream_generate(model, tok, mx.array(ids), max_tokens=n, draft_model=draft):
        first = first or time.perf_counter()
        count += 1
        last = r
    print(json.dumps({"decode_tok_s": last.generation_tps, "tokens": count}))
else:
    import mlxlab
    from mlxlab.models.zoo import load
    from mlxlab.decode.batch import Row
    from mlxlab.decode.serial import run_serial
    from mlxlab.decode.settings import DecodeSettings
    from mlxlab.decode.speculative import load_draft
    model, tok = load(model_dir)
    mode = {"mlxlab": "off", "mlxlab-draft": "draft_model", "mlxlab-lookup": "prompt_lookup"}[side]
    draft = load_draft(draft_dir, model, tok) if mode == "draft_model" else None
    ids = tok.encode(prompt)
    times = []
    row = Row(ids, n, lambda t, lp: times.append(time.perf_counter()), lambda f, t: None)
    run_serial(model, row, DecodeSettings(speculative=mode), draft_model=draft)
    rate = (len(times) - 1) / (times[-1] - times[0])
    print(json.dumps({"decode_tok_s": rate, "tokens": len(row.tokens),
                      "counts": row.speculation.as_dict() if row.speculation else None}))
"""


def draft_dir(layers: int = 6) -> Path:
    """gemma3-270m's first `layers` layers, its embedding (the tied head) and norms, as a model
    directory both mlx-lm and mlxlab load."""
    import mlxlab  # noqa: F401
    from mlxlab.models.zoo import resolve
    from mlxlab.runtime import home

    out = home() / "bench" / f"gemma3-270m-draft{layers}"
    if (out / "config.json").is_file():
        return out
    import shutil

    import mlx.core as mx

    src = resolve("gemma3-270m")
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json" and f.is_file():
            shutil.copy(f, out / f.name)
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_hidden_layers"] = layers
    cfg.pop("layer_types", None)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    weights = {}
    for f in src.glob("*.safetensors"):
        for k, v in mx.load(str(f)).items():
            parts = k.split(".")
            if "layers" in parts and int(parts[parts.index("layers") + 1]) >= layers:
                continue
            weights[k] = v
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    return out


def mlx_lm_side(args) -> dict:
    import mlxlab  # noqa: F401
    from mlxlab.models.zoo import resolve

    model = str(resolve("gemma3-270m"))
    draft = str(draft_dir())
    sides = [
        "mlx-lm",
        "mlx-lm-draft",
        "mlx-lm-f32",
        "mlx-lm-f32-draft",
        "mlxlab",
        "mlxlab-draft",
        "mlxlab-lookup",
    ]
    runs: dict = {s: [] for s in sides}
    counts = {}
    for r in range(args.rounds):
        for s in sides:
            got = subprocess.run(
                [sys.executable, "-c", MLX_LM, s, model, draft, str(args.max_tokens), COPY[0]],
                capture_output=True,
                text=True,
                check=True,
                cwd=REPO,
            )
            res = json.loads(got.stdout.strip().splitlines()[-1])
            runs[s].append(res["decode_tok_s"])
            counts[s] = res.get("counts")
            print(f"round {r + 1} {s:<14} {res['decode_tok_s']:6.2f} tok/s", flush=True)
    return {
        "decode_tok_s": {s: statistics.median(v) for s, v in runs.items()},
        "counts": counts,
    }


CHUNK = r"""
import json, sys, time
import mlxlab
run_dir, cases, batch, modes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split(",")
from pathlib import Path
from mlxlab.models.zoo import load
from mlxlab.lora import io as lora_io
from mlxlab.decode.offline import complete
from mlxlab.decode.prompt_cache import PromptCache
from mlxlab import grammar
from mlxlab.tasks.chunk import evaluate as ev
from mlxlab.tasks.chunk.prompt import read_cases
from mlxlab.tasks.chunk.windows import plan_windows
from mlxlab.tasks.chunk.grammar import answer_grammar
model, tok = load("gemma3-270m")
adapter = Path(run_dir) / "adapter"
if adapter.is_dir() or (Path(run_dir) / "adapters.safetensors").is_file():
    lora_io.load(model, str(adapter if adapter.is_dir() else run_dir))  # else the base model
records = read_cases(Path(run_dir) / "data" / "test.cases.json")[:cases]
windows = plan_windows(records, tok, 1800, 2, 4)
prompts = [w.prompt for w in windows]
width = ev.n_vocab(model, tok)
grammars = [grammar.lark(answer_grammar(w.uuids), "answer") for w in windows]
kv = PromptCache(4 << 30)
t = time.perf_counter()
complete(model, tok, prompts, 1, batch, cache=kv)  # the prompts' KV, stored once
prefill = time.perf_counter() - t
out = {"windows": len(prompts), "prefill_s": prefill}
for constrained in (False, True):
    procs = (lambda i: [grammar.constrain(grammars[i], tok, width)]) if constrained else None
    for mode in modes:
        counts = None
        if mode != "before":  # the tree before speculation has no counts
            from mlxlab.decode.speculative import Counts
            counts = Counts()
        if mode == "uncapped":  # every row drafts its full length, whatever the batch
            from mlxlab.decode import speculative_batch
            capped = speculative_batch.step_cost
            speculative_batch.step_cost = lambda rows, positions: 1.0
        kw = {} if mode == "before" else {
            "speculative": "off" if mode == "off" else "prompt_lookup", "counts": counts}
        t = time.perf_counter()
        try:
            texts = complete(model, tok, prompts, 256, batch, None, procs, cache=kv, **kw)
        finally:  # the modes after it are measured with the step cost again
            if mode == "uncapped":
                speculative_batch.step_cost = capped
        s = time.perf_counter() - t
        key = ("constrained " if constrained else "plain ") + mode
        out[key] = {"seconds": s, "texts": texts, "counts": counts and counts.as_dict()}
print(json.dumps(out))
"""


def chunk(args) -> dict:
    if not args.chunk_run:
        raise SystemExit("--only chunk needs --chunk-run (a chunk_seg4 run directory)")
    out: dict = {}
    for batch in (int(b) for b in args.chunk_batches.split(",")):
        rows = {}
        for side, cwd, modes in (
            ("before", worktree(args.before), "before"),
            ("now", REPO, "off,prompt_lookup" + (",uncapped" if batch > 8 else "")),
        ):
            got = subprocess.run(
                [
                    sys.executable,
                    "-c",
                    CHUNK,
                    args.chunk_run,
                    str(args.chunk_cases),
                    str(batch),
                    modes,
                ],
                capture_output=True,
                text=True,
                cwd=cwd,
            )
            if got.returncode:
                raise SystemExit(got.stderr[-3000:])
            rows[side] = json.loads(got.stdout.strip().splitlines()[-1])
        res = {"windows": rows["now"]["windows"], "prefill_s": rows["now"]["prefill_s"]}
        for kind in ("plain", "constrained"):
            before = rows["before"][f"{kind} before"]
            off = rows["now"][f"{kind} off"]
            look = rows["now"][f"{kind} prompt_lookup"]
            res[kind] = {
                "before_s": before["seconds"],
                "off_s": off["seconds"],
                "lookup_s": look["seconds"],
                "same_texts": before["texts"] == off["texts"] == look["texts"],
                "lookup_counts": look["counts"],
            }
            wide = rows["now"].get(f"{kind} uncapped")
            if wide is not None:
                res[kind]["uncapped_s"] = wide["seconds"]
                res[kind]["uncapped_counts"] = wide["counts"]
                res[kind]["uncapped_same_texts"] = wide["texts"] == off["texts"]
            print(
                f"batch {batch} {kind}: before {before['seconds']:.1f} s, off {off['seconds']:.1f}"
                f" s, lookup {look['seconds']:.1f} s ({look['counts']['acceptance_rate']})",
                flush=True,
            )
        out[f"batch_{batch}"] = res
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", default="0a1c514")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--only", default="serial,concurrent,mlx-lm")
    ap.add_argument("--chunk-run", help="a chunk_seg4 run directory (adapter + data)")
    ap.add_argument("--chunk-cases", type=int, default=6)
    ap.add_argument("--chunk-batches", default="1,8,32", help="batch sizes of the chunk part")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    results = {}
    parts = {"serial": serial, "concurrent": concurrent, "mlx-lm": mlx_lm_side, "chunk": chunk}
    for name in args.only.split(","):
        results[name] = parts[name](args)
        print(json.dumps({name: results[name]}, indent=1, default=str), flush=True)
    if "serial" in results:
        s = results["serial"]
        print("\none stream over HTTP, decode tok/s (median)")
        for work in ("prose", "copy"):
            b, o, lk = s[work]["before"], s[work]["off"], s[work]["lookup"]
            print(
                f"  {work:<6} before {b:6.2f}  off {o:6.2f} ({o / b:.2f}x)  lookup {lk:6.2f} "
                f"({lk / b:.2f}x before, {lk / o:.2f}x off)"
            )
        print(f"  same text as off: {s['same_text']}")
    if "concurrent" in results:
        c = results["concurrent"]
        for k in ("4_clients", "8_clients"):
            b, o, lk = c[k]["before"], c[k]["off"], c[k]["lookup"]
            print(f"  {k}: before {b:.2f}, off {o:.2f}, lookup {lk:.2f} tok/s ({lk / b:.2f}x)")
    if "mlx-lm" in results:
        m = results["mlx-lm"]["decode_tok_s"]
        print("copy prompt, decode tok/s: " + ", ".join(f"{k} {v:.2f}" for k, v in m.items()))
        print(
            f"  mlx-lm draft/plain {m['mlx-lm-draft'] / m['mlx-lm']:.2f}x (float32 "
            f"{m['mlx-lm-f32-draft'] / m['mlx-lm-f32']:.2f}x); mlxlab draft/plain "
            f"{m['mlxlab-draft'] / m['mlxlab']:.2f}x, lookup/plain "
            f"{m['mlxlab-lookup'] / m['mlxlab']:.2f}x; mlxlab lookup / mlx-lm float32 draft "
            f"{m['mlxlab-lookup'] / m['mlx-lm-f32-draft']:.2f}x"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
