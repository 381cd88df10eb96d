"""LoRA training speed and memory: mlxlab vs `mlx_lm.lora`, same model and data, one run.

    python scripts/bench_train.py [--model gemma3-270m] [--iters 10] [--batch-size 4] [--max-seq-length 256]

Three runs, each in its own process, on the bundled quickstart data (LoRA rank 8 on q k v o
gate up down of every layer, batch 4, prompt masked, no validation):
  mlx_lm.lora as a user runs it    its defaults: the model's stored bf16 weights, MLX's BLAS
  mlx_lm.lora matched              float32 weights and mlxlab's BLAS, so only the trainer differs
  mlxlab                           `python -m mlxlab train` (float32 on a CPU)
Seconds/step come from wall time over the steps after the first (compile/warm-up) one;
peak memory is each trainer's own report (mx.get_peak_memory). Prints the ratios.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "mlxlab" / "data" / "quickstart"

MLX_LM = r"""
import json, sys, time, types
if sys.argv[1] == "matched":
    import mlxlab  # the optimized BLAS, loaded before MLX
import numpy as np
from mlx_lm import lora
from mlx_lm.tuner.callbacks import TrainingCallback
from mlx_lm.tuner.datasets import load_dataset
from mlx_lm.utils import load

# mlx_lm.lora.main(), but with a callback that timestamps each report (run() installs its own).
args = vars(lora.build_parser().parse_args(sys.argv[2:]))
for k, v in lora.CONFIG_DEFAULTS.items():
    if args.get(k) is None:
        args[k] = v
args = types.SimpleNamespace(**args)

class Stamp(TrainingCallback):
    def on_train_loss_report(self, info):
        print("REPORT " + json.dumps({"t": time.perf_counter(), **info}), flush=True)

np.random.seed(args.seed)
model, tokenizer = load(args.model)
train_set, valid_set, _ = load_dataset(args, tokenizer)
lora.train_model(args, model, train_set, valid_set, Stamp())
"""


def run_mlx_lm(mode: str, model_dir: str, args, adapter_dir: Path) -> dict:
    cmd = [
        sys.executable,
        "-c",
        MLX_LM,
        mode,
        "--model",
        model_dir,
        "--train",
        "--data",
        str(DATA),
        "--iters",
        str(args.iters),
        "--batch-size",
        str(args.batch_size),
        "--num-layers",
        "-1",
        "--mask-prompt",
        "--max-seq-length",
        str(args.max_seq_length),
        "--steps-per-report",
        "1",
        "--steps-per-eval",
        str(10 * args.iters),
        "--val-batches",
        "1",
        "--learning-rate",
        "2e-4",
        "--optimizer",
        "adamw",
        "--adapter-path",
        str(adapter_dir),
        "--save-every",
        str(10 * args.iters),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True)
    reports = [json.loads(x[7:]) for x in out.stdout.splitlines() if x.startswith("REPORT ")]
    if out.returncode != 0 or len(reports) < 2:
        raise RuntimeError(
            f"mlx_lm.lora ({mode}) failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}"
        )
    return {
        "s_per_step": (reports[-1]["t"] - reports[0]["t"]) / (len(reports) - 1),
        "peak_gb": max(r["peak_memory"] for r in reports),
    }


def run_mlxlab(model: str, args, out: Path) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "mlxlab",
        "train",
        "+exp=quickstart",
        f"model={model}",
        f"out_dir={out}",
        f"iters={args.iters}",
        f"batch_size={args.batch_size}",
        f"data.max_seq_length={args.max_seq_length}",
        "val_every=0",
        "save_every=0",
        "log_every=1",
        "wandb=disabled",
        "optim.warmup=0",
    ]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    stamps = [r["elapsed_s"] for r in recs if "loss" in r]
    summary = json.loads((out / "summary.json").read_text())
    return {
        "s_per_step": (stamps[-1] - stamps[0]) / (len(stamps) - 1),
        "peak_gb": summary["peak_mem_gb"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--max-seq-length", type=int, default=256)
    args = ap.parse_args()

    import mlxlab  # noqa: F401
    from mlxlab.models import zoo

    model_dir = str(zoo.resolve(args.model))
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        import mlx.core as mx
        from mlx_lm.utils import load, save

        model, tokenizer, config = load(model_dir, return_config=True)
        model.set_dtype(mx.float32)
        save(tmp / "f32", model_dir, model, tokenizer, config)
        del model
        results = {
            "mlx_lm.lora (defaults)": run_mlx_lm("defaults", model_dir, args, tmp / "a1"),
            "mlx_lm.lora (matched)": run_mlx_lm("matched", str(tmp / "f32"), args, tmp / "a2"),
            "mlxlab": run_mlxlab(args.model, args, tmp / "run"),
        }
    print(f"\n{args.model}, quickstart data, batch {args.batch_size}, {args.iters} steps")
    print(f"{'':<26}{'s/step':>9}{'peak GB':>10}")
    for name, r in results.items():
        print(f"{name:<26}{r['s_per_step']:>9.2f}{r['peak_gb']:>10.2f}")
    ours = results["mlxlab"]
    for ref in ("mlx_lm.lora (defaults)", "mlx_lm.lora (matched)"):
        r = results[ref]
        print(
            f"mlxlab / {ref}: time {ours['s_per_step'] / r['s_per_step']:.2f}x, "
            f"peak memory {ours['peak_gb'] / r['peak_gb']:.2f}x"
        )


if __name__ == "__main__":
    main()
