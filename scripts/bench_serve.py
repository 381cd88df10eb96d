"""Serving speed through HTTP: mlxlab serve vs mlx_lm.server on the same model, in one run.

    python scripts/bench_serve.py [--model gemma3-270m] [--rounds 3] [--decode-tokens 128]
                                  [--before REV]

Each server runs alone (started, measured, stopped), driven by the same streaming OpenAI-style
requests at temperature 0:

- decode tok/s: (completion tokens - 1) / (last token time - first token time);
- TTFT: time to the first content of a cold ~1,000-token prompt (unique per round);
- second-turn TTFT: a chat whose first turn carried a ~1,000-token document; the second turn
  resends it plus the answer and a new question (prompt-cache reuse), as a ratio to the cold TTFT.

mlx-lm is measured twice: as users run it (`mlx_lm.server` with its defaults: the stored bf16
weights, the BLAS mlx[cpu] ships), and matched (float32 weights and the same OpenBLAS mlxlab
loads), so the ratios separate mlxlab's defaults from the server itself. `--before REV` also
serves mlxlab at an earlier commit. Prints a table and the ratios; `--json` writes them.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


def document(records: int) -> str:
    return " ".join(
        f"Record {i}: the parcel with id P-{i:04d} left depot {i % 7} on day {i % 30 + 1}."
        for i in range(records)
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], port: int, cwd: Path = REPO) -> subprocess.Popen:
    proc = subprocess.Popen(
        cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server failed: {' '.join(cmd)}\n{proc.stderr.read()[-2000:]}")
        try:
            r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
            if r.status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("server did not become ready")


def events(url: str, path: str, body: dict, timeout: float, retries: int = 10):
    """The JSON events of one streamed POST (`data: ...` lines, `[DONE]` left out). A 503 with
    Retry-After (a model's load waiting for another's lease to end) is retried after it, as a
    client does, up to `retries` times, said on stderr; any other status than 200 ends the
    benchmark with the server's answer."""
    for attempt in range(retries + 1):
        with httpx.stream("POST", f"{url}{path}", json=body, timeout=timeout) as r:
            wait = r.headers.get("retry-after")
            if r.status_code == 503 and wait is not None and attempt < retries:
                r.read()
                print(f"{url}: 503, retrying after {wait} s: {r.text[:200]}", file=sys.stderr)
                time.sleep(min(float(wait), 5.0))
                continue
            if r.status_code != 200:
                r.read()
                raise SystemExit(f"{url}: HTTP {r.status_code}: {r.text[:500]}")
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    yield json.loads(line[6:])
            return


def stream_chat(url: str, messages: list[dict], max_tokens: int) -> dict:
    """First-content time, last-content time, completion tokens and text of one streamed chat."""
    body = {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    first = last = None
    pieces, usage, chunks = [], None, 0
    for ev in events(url, "/v1/chat/completions", body, 600):
        usage = ev.get("usage") or usage
        for ch in ev.get("choices") or []:
            text = (ch.get("delta") or {}).get("content")
            if text:
                now = time.perf_counter()
                first = first or now
                last = now
                chunks += 1
                pieces.append(text)
    tokens = (usage or {}).get("completion_tokens") or chunks
    return {
        "ttft": (first or time.perf_counter()) - t0,
        "decode_s": (last or 0) - (first or 0),
        "tokens": tokens,
        "text": "".join(pieces),
        "usage": usage,
    }


def measure(url: str, rounds: int, decode_tokens: int, doc: str) -> dict:
    stream_chat(url, [{"role": "user", "content": "Say hello."}], 8)  # warm-up
    decode, cold, warm = [], [], []
    for i in range(rounds):
        story = stream_chat(
            url,
            [{"role": "user", "content": f"Tell a long story about robot number {i}."}],
            decode_tokens,
        )
        if story["tokens"] > 8 and story["decode_s"] > 0:
            decode.append((story["tokens"] - 1) / story["decode_s"])
        system = {
            "role": "system",
            "content": f"Session {i}-{time.time()}. Answer from these records.\n{doc}",
        }
        turn1 = [system, {"role": "user", "content": "Which depot did parcel P-0003 leave?"}]
        first = stream_chat(url, turn1, 16)
        cold.append(first["ttft"])
        turn2 = turn1 + [
            {"role": "assistant", "content": first["text"]},
            {"role": "user", "content": "And on which day?"},
        ]
        warm.append(stream_chat(url, turn2, 16)["ttft"])
    return {
        "decode_tok_s": statistics.median(decode) if decode else float("nan"),
        "ttft_cold_s": statistics.median(cold),
        "ttft_second_turn_s": statistics.median(warm),
        "rounds": rounds,
    }


def f32_copy(model_dir: Path, out: Path) -> Path:
    if not (out / "config.json").is_file():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "mlx_lm",
                "convert",
                "--hf-path",
                str(model_dir),
                "--mlx-path",
                str(out),
                "--dtype",
                "float32",
            ],
            check=True,
            capture_output=True,
        )
    return out


def serve_and_measure(command, args, cwd: Path = REPO) -> dict:
    """Start the server `command(port)` on a free port, measure it, stop it."""
    port = free_port()
    proc = start(command(port), port, cwd)
    try:
        return measure(
            f"http://127.0.0.1:{port}", args.rounds, args.decode_tokens, document(args.doc_records)
        )
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument(
        "--doc-records", type=int, default=60, help="records in the shared document (~1,000 tokens)"
    )
    ap.add_argument("--skip-matched", action="store_true", help="only mlx-lm with its defaults")
    ap.add_argument(
        "--skip-defaults", action="store_true", help="only mlx-lm at matched dtype and BLAS"
    )
    ap.add_argument(
        "--before", help="also serve mlxlab at this git revision (a worktree, as bench_generate.py)"
    )
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()

    import mlxlab  # noqa: F401
    from mlxlab.models.zoo import resolve
    from mlxlab.runtime import home

    model_dir = resolve(args.model)
    runs = {}
    ours = {"mlxlab": REPO}
    if args.before:
        sys.path.insert(0, str(Path(__file__).parent))
        from bench_generate import worktree

        ours[f"mlxlab {args.before}"] = worktree(args.before)  # `-m` imports from the cwd
    for name, cwd in ours.items():
        print(f"{name} serve ({args.model}) ...", file=sys.stderr)
        runs[name] = serve_and_measure(
            lambda port: [
                sys.executable,
                "-m",
                "mlxlab",
                "serve",
                f"model={args.model}",
                f"port={port}",
            ],
            args,
            cwd,
        )

    variants = (
        {}
        if args.skip_defaults
        else {"mlx_lm (defaults)": ([sys.executable, "-m", "mlx_lm", "server"], model_dir)}
    )
    if not args.skip_matched:
        f32 = f32_copy(model_dir, home() / "bench" / f"{args.model}-f32")
        # Same BLAS as mlxlab: import mlxlab (which loads it) before mlx_lm's server starts.
        shim = "import sys, mlxlab; from mlx_lm.server import main; sys.argv[0] = 'mlx_lm.server'; main()"
        variants["mlx_lm (matched)"] = ([sys.executable, "-c", shim], f32)
    for name, (cmd, path) in variants.items():
        print(f"{name} ...", file=sys.stderr)
        runs[name] = serve_and_measure(
            lambda port, cmd=cmd, path=path: [*cmd, "--model", str(path), "--port", str(port)],
            args,
        )

    ours = runs["mlxlab"]
    print(
        f"\n{'server':<20} {'decode tok/s':>12} {'TTFT cold s':>12} {'TTFT 2nd turn s':>16} {'2nd/cold':>9}"
    )
    for name, r in runs.items():
        print(
            f"{name:<20} {r['decode_tok_s']:>12.2f} {r['ttft_cold_s']:>12.3f} {r['ttft_second_turn_s']:>16.3f} "
            f"{r['ttft_second_turn_s'] / r['ttft_cold_s']:>9.3f}"
        )
    ratios = {}
    for name, r in runs.items():
        if name == "mlxlab":
            continue
        ratios[name] = {
            "decode (target >= 2.0x matched)": ours["decode_tok_s"] / r["decode_tok_s"],
            "TTFT (target <= 1.0x)": ours["ttft_cold_s"] / r["ttft_cold_s"],
        }
        print(f"\nmlxlab vs {name}: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios[name].items()))
    print(
        f"mlxlab second-turn TTFT vs cold (target <= 0.2x): {ours['ttft_second_turn_s'] / ours['ttft_cold_s']:.3f}x"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"runs": runs, "ratios": ratios, "model": args.model, "pid": os.getpid()}, indent=2
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
