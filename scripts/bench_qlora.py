"""QLoRA and DoRA: mlxlab vs `mlx_lm.lora` on a 4-bit gemma3-270m, and DoRA's cost, one run.

    python scripts/bench_qlora.py [--model gemma3-270m] [--bits 4] [--group-size 64]
                                  [--length 2048] [--iters 3] [--dora-length 1024]
                                  [--modes full checkpoint seg4] [--skip-mlx-lm] [--skip-dora]
                                  [--out bench_qlora.json]

1. QLoRA: the model quantized by mlx-lm's converter (`models quantize`, as `mlx_lm.convert -q`),
   its float arrays (scales, biases, norms) in float32 (what mlxlab computes in on a CPU; the
   same copy is handed to mlx-lm, so only the trainers differ). One training example of
   `--length` tokens of real text, the last quarter the response (masked prompt), LoRA rank 8
   scale 20 on q k v o gate up down of every layer, batch 1, `--iters` steps (the first a
   warm-up). Each run is its own process: `python -m mlxlab train` in each `--modes` entry
   (full, checkpoint, segN) and `mlx_lm.lora` with and without `--grad-checkpoint`. Peak memory
   is each trainer's own report (mx.get_peak_memory: the weights included); s/step is wall time
   over the steps after the first. Target: segmented peak <= 0.5x mlx_lm.lora's.
2. DoRA: `lora.type=dora` vs `lora` in mlxlab on the bf16 model (float32 compute) at
   `--dora-length` tokens, full and segmented backward. Target: DoRA's s/step <= 1.3x LoRA's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

LORA = ["lora.targets=[q,k,v,o,gate,up,down]", "lora.rank=8", "lora.scale=20.0"]


def write_data(model_dir: str, out: Path, length: int) -> Path:
    """train.jsonl / valid.jsonl: one completions example of ~`length` tokens of stdlib
    docstrings (the prompt the first three quarters, the completion the rest)."""
    from mlx_lm.utils import load_tokenizer

    from mlxlab.models.tokenizers import _tiny_corpus

    tok = load_tokenizer(Path(model_dir))
    ids = tok.encode("\n\n".join(_tiny_corpus()))
    while len(ids) < length:
        ids = ids + ids
    ids = ids[1 : length - 8]  # room for BOS and the re-tokenization's drift
    cut = len(ids) * 3 // 4
    record = {"prompt": tok.decode(ids[:cut]), "completion": tok.decode(ids[cut:])}
    out.mkdir(parents=True, exist_ok=True)
    for split in ("train", "valid"):
        (out / f"{split}.jsonl").write_text(json.dumps(record) + "\n")
    return out


def float32_copy(model_dir: str, out: Path) -> Path:
    """The quantized model with its float arrays in float32 (packed weights untouched)."""
    import mlx.core as mx
    from mlx_lm.utils import load, save

    model, tokenizer, config = load(model_dir, return_config=True)
    model.set_dtype(mx.float32)
    save(out, model_dir, model, tokenizer, config)
    return out


def run_mlxlab(model: str, data: Path, length: int, iters: int, out: Path, extra) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "mlxlab",
        "train",
        f"model={model}",
        f"data.train={data}",
        f"out_dir={out}",
        f"iters={iters}",
        "batch_size=1",
        f"data.max_seq_length={length}",
        *LORA,
        "val_every=0",
        "save_every=0",
        "log_every=1",
        "wandb=disabled",
        "optim.lr=2e-4",
        *extra,
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if res.returncode != 0:
        return {"error": res.stderr.strip().splitlines()[-1] if res.stderr.strip() else "failed"}
    steps = [
        json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in x
    ]
    summary = json.loads((out / "summary.json").read_text())
    return {
        "s_per_step": (steps[-1]["elapsed_s"] - steps[0]["elapsed_s"]) / (len(steps) - 1),
        "peak_gb": summary["peak_mem_gb"],
        "tokens": steps[-1]["tokens"],
        "losses": [s["loss"] for s in steps],
    }


def run_mlx_lm(model_dir: str, data: Path, length: int, iters: int, out: Path, gc: bool) -> dict:
    from bench_train import MLX_LM

    cmd = [
        sys.executable,
        "-c",
        MLX_LM,
        "--model",
        model_dir,
        "--train",
        "--data",
        str(data),
        "--iters",
        str(iters),
        "--batch-size",
        "1",
        "--num-layers",
        "-1",
        "--mask-prompt",
        "--max-seq-length",
        str(length),
        "--steps-per-report",
        "1",
        "--steps-per-eval",
        str(10 * iters),
        "--val-batches",
        "1",
        "--learning-rate",
        "2e-4",
        "--adapter-path",
        str(out / "adapter"),
        "--save-every",
        str(10 * iters),
    ] + (["--grad-checkpoint"] if gc else [])
    res = subprocess.run(cmd, capture_output=True, text=True)
    reports = [json.loads(x[7:]) for x in res.stdout.splitlines() if x.startswith("REPORT ")]
    if res.returncode != 0 or len(reports) < 2:
        return {"error": (res.stderr.strip().splitlines() or ["failed"])[-1]}
    return {
        "s_per_step": (reports[-1]["t"] - reports[0]["t"]) / (len(reports) - 1),
        "peak_gb": max(r["peak_memory"] for r in reports),
        "losses": [r["train_loss"] for r in reports],
    }


def mode_args(mode: str) -> list[str]:
    if mode.startswith("seg"):
        return ["backward.mode=segmented", f"backward.segment_size={int(mode[3:])}"]
    return [f"backward.mode={mode}"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--modes", nargs="+", default=["full", "checkpoint", "seg4"])
    ap.add_argument("--dora-length", type=int, default=1024)
    ap.add_argument("--skip-mlx-lm", action="store_true")
    ap.add_argument("--skip-dora", action="store_true")
    ap.add_argument("--skip-qlora", action="store_true")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()

    import mlxlab  # noqa: F401
    from mlxlab.models import zoo

    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        base = str(zoo.resolve(args.model))
        if not args.skip_qlora:
            quant = zoo.quantize(args.model, args.bits, args.group_size)
            q32 = float32_copy(str(quant), tmp / "q32")
            data = write_data(base, tmp / "data", args.length)
            for mode in args.modes:
                name = f"mlxlab {mode}"
                print(f"running {name} ...", flush=True)
                out = tmp / name.replace(" ", "_")
                results[name] = run_mlxlab(
                    str(q32), data, args.length, args.iters, out, mode_args(mode)
                )
                print(f"  {results[name]}", flush=True)
            if not args.skip_mlx_lm:
                for gc in (False, True):
                    name = "mlx_lm.lora" + (" --grad-checkpoint" if gc else "")
                    print(f"running {name} ...", flush=True)
                    out = tmp / name.replace(" ", "_")
                    results[name] = run_mlx_lm(str(q32), data, args.length, args.iters, out, gc)
                    print(f"  {results[name]}", flush=True)
        dora: dict[str, dict] = {}
        if not args.skip_dora:
            data = write_data(base, tmp / "dora_data", args.dora_length)
            for kind in ("lora", "dora"):
                for mode in ("full", "seg4"):
                    name = f"{kind} {mode}"
                    print(f"running {name} ...", flush=True)
                    out = tmp / name.replace(" ", "_")
                    dora[name] = run_mlxlab(
                        base,
                        data,
                        args.dora_length,
                        args.iters,
                        out,
                        [*mode_args(mode), f"lora.type={kind}"],
                    )
                    print(f"  {dora[name]}", flush=True)

    lines = []
    if results:
        lines.append(
            f"QLoRA: {args.model} at {args.bits} bits, groups of {args.group_size} (float32 "
            f"compute), {args.length} tokens, batch 1, {args.iters} steps (first: warm-up)"
        )
        lines.append(f"{'':<30}{'s/step':>9}{'peak GB':>9}")
        for name, r in results.items():
            cell = (
                f"{r['s_per_step']:>9.1f}{r['peak_gb']:>9.2f}" if "error" not in r else r["error"]
            )
            lines.append(f"{name:<30}{cell}")
        for ref in ("mlx_lm.lora", "mlx_lm.lora --grad-checkpoint"):
            theirs = results.get(ref, {})
            if "peak_gb" not in theirs:
                continue
            for mode in args.modes:
                ours = results.get(f"mlxlab {mode}", {})
                if "peak_gb" in ours:
                    lines.append(
                        f"mlxlab {mode} vs {ref}: peak {ours['peak_gb'] / theirs['peak_gb']:.2f}x"
                        f"{' (target <= 0.5)' if mode.startswith('seg') else ''}, "
                        f"s/step {ours['s_per_step'] / theirs['s_per_step']:.2f}x"
                    )
    if dora:
        lines.append(
            f"\nDoRA vs LoRA: {args.model} (float32 compute), {args.dora_length} tokens, batch 1"
        )
        for mode in ("full", "seg4"):
            a, b = dora.get(f"lora {mode}", {}), dora.get(f"dora {mode}", {})
            if "s_per_step" in a and "s_per_step" in b:
                lines.append(
                    f"{mode}: LoRA {a['s_per_step']:.2f} s/step, DoRA {b['s_per_step']:.2f} "
                    f"s/step: {b['s_per_step'] / a['s_per_step']:.2f}x (target <= 1.3); peak "
                    f"{a['peak_gb']:.2f} vs {b['peak_gb']:.2f} GB"
                )
    print("\n" + "\n".join(lines))
    if args.out:
        Path(args.out).write_text(
            json.dumps({"qlora": results, "dora": dora, "args": vars(args)}, indent=2) + "\n"
        )


if __name__ == "__main__":
    main()
