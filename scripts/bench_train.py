"""LoRA training throughput: mlxlab vs `mlx_lm.lora` (and an earlier mlxlab), same model and data, one run.

    python scripts/bench_train.py [--config chunk|quickstart] [--iters 6] [--before REV]
                                  [--pack] [--skip-mlx-lm] [--skip-no-checkpoint]

--config chunk (default) is the flagship `+exp=chunk_seg4` setting: gemma3-270m, LoRA rank 8
(scale 20) on q k v o gate up down of every layer, the segmented backward in segments of 4,
batch 2, max_seq_length 2048, on the chunk task's own training examples (built here with
`python -m mlxlab data chunk`, so the real length distribution; the figures in
experiments/training_throughput were measured on the earlier dataset at max_seq_length 1152); --config quickstart is the
bundled quickstart data at batch 4, max_seq_length 256. Every run is its own process:

  mlxlab                         `python -m mlxlab train` with those settings (float32 on a CPU)
  mlxlab packed                  the same with data.pack=true (--pack)
  mlxlab <REV>                   the same at git revision REV, from a worktree (--before)
  mlx_lm.lora                    float32 weights and mlxlab's BLAS (matched: only the trainer
                                 differs), without and with --grad-checkpoint

Seconds/step come from wall time over the steps after the first (warm-up) one. Trained tok/s
counts the response tokens each step trains on (what mlx_lm.lora reports as trained tokens;
mlxlab's steps record them); MFU is the model FLOPs of those steps (mlxlab/train/flops.py, for
each trainer's backward) over the float32 matmul rate measured at the start; peak memory is each
trainer's own report (mx.get_peak_memory). Prints the table and the ratios.
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

CONFIGS = {
    "chunk": {
        "batch_size": 2,
        "max_seq_length": 2048,
        "backward": ["backward.mode=segmented", "backward.segment_size=4"],
        "lora": ["lora.targets=[q,k,v,o,gate,up,down]", "lora.rank=8", "lora.scale=20.0"],
    },
    "quickstart": {
        "batch_size": 4,
        "max_seq_length": 256,
        "backward": ["backward.mode=full"],
        "lora": ["lora.targets=[q,k,v,o,gate,up,down]", "lora.rank=8", "lora.scale=20.0"],
    },
}

MLX_LM = r"""
import json, sys, time, types
import mlxlab  # the optimized BLAS, loaded before MLX
import numpy as np
from mlx_lm import lora
from mlx_lm.tuner.callbacks import TrainingCallback
from mlx_lm.tuner.datasets import load_dataset
from mlx_lm.utils import load

# mlx_lm.lora.main(), but with a callback that timestamps each report (run() installs its own).
args = vars(lora.build_parser().parse_args(sys.argv[1:]))
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


def run_mlx_lm(model_dir: str, data: Path, cfg: dict, args, out: Path, checkpoint: bool) -> dict:
    # LoRA rank 8, scale 20, on every linear layer of every block: mlx_lm.lora's defaults
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
        str(args.iters),
        "--batch-size",
        str(cfg["batch_size"]),
        "--num-layers",
        "-1",
        "--mask-prompt",
        "--max-seq-length",
        str(cfg["max_seq_length"]),
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
        str(out / "adapter"),
        "--save-every",
        str(10 * args.iters),
    ] + (["--grad-checkpoint"] if checkpoint else [])
    res = subprocess.run(cmd, capture_output=True, text=True)
    reports = [json.loads(x[7:]) for x in res.stdout.splitlines() if x.startswith("REPORT ")]
    if res.returncode != 0 or len(reports) < 2:
        raise RuntimeError(f"mlx_lm.lora failed:\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}")
    secs = reports[-1]["t"] - reports[0]["t"]
    trained = reports[-1]["trained_tokens"] - reports[0]["trained_tokens"]
    return {
        "s_per_step": secs / (len(reports) - 1),
        "trained_tok_per_s": trained / secs,
        "peak_gb": max(r["peak_memory"] for r in reports),
        "mode": "checkpoint" if checkpoint else "full",
        "trained_per_step": trained / (len(reports) - 1),
    }


def run_mlxlab(model: str, data: Path, cfg: dict, args, out: Path, cwd: Path, extra=()) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "mlxlab",
        "train",
        f"model={model}",
        f"data.train={data}",
        f"out_dir={out}",
        f"iters={args.iters}",
        f"batch_size={cfg['batch_size']}",
        f"data.max_seq_length={cfg['max_seq_length']}",
        *cfg["backward"],
        *cfg["lora"],
        "val_every=0",
        "save_every=0",
        "log_every=1",
        "wandb=disabled",
        "optim.lr=2e-4",
        "optim.warmup=0",
        *extra,
    ]
    # `python -m` puts the working directory first on sys.path: a worktree's mlxlab is imported
    # when run from there (the editable install's finder comes after it).
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd)
    if res.returncode != 0:
        raise RuntimeError(f"mlxlab train failed:\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}")
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "loss" in r]
    secs = steps[-1]["elapsed_s"] - steps[0]["elapsed_s"]
    summary = json.loads((out / "summary.json").read_text())
    return {
        "s_per_step": secs / (len(steps) - 1),
        "peak_gb": summary["peak_mem_gb"],
        "steps": steps,
        "mode": "segmented" if "segmented" in " ".join(cfg["backward"]) else "full",
    }


def trained_tokens_by_step(model: str, data: Path, cfg: dict, iters: int, seed: int = 0) -> list:
    """Response tokens of each step as mlxlab's (unpacked) sampler draws them (for a revision
    whose step records do not carry them; the sampler's order is the same)."""
    from mlxlab.config import DataConfig
    from mlxlab.data.batches import BatchSampler
    from mlxlab.data.datasets import load_split
    from mlxlab.models.zoo import load

    _, tokenizer = load(model, "auto", decode_kernel=False)
    dcfg = DataConfig(train=str(data), max_seq_length=cfg["max_seq_length"])
    examples = load_split(data / "train.jsonl", tokenizer, dcfg).examples
    sampler = BatchSampler(examples, cfg["batch_size"], seed)
    return [sampler.next() for _ in range(iters)]


def flops_of(model: str, batches: list, mode: str) -> list[float]:
    import mlx.core as mx

    from mlxlab.diag.workload import attach_lora
    from mlxlab.models.zoo import load
    from mlxlab.train.flops import model_shapes, step_flops

    m, _ = load(model, "auto", decode_kernel=False)
    attach_lora(m)
    shapes = model_shapes(m)
    del m
    mx.clear_cache()
    return [step_flops(shapes, list(b.lengths), b.ntoks, mode)["total"] for b in batches]


def worktree(rev: str) -> Path:
    from bench_generate import worktree as make

    return make(rev)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", choices=sorted(CONFIGS), default="chunk")
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--before", help="also measure mlxlab at this git revision")
    ap.add_argument("--pack", action="store_true", help="also measure mlxlab with data.pack=true")
    ap.add_argument("--skip-mlx-lm", action="store_true")
    ap.add_argument(
        "--skip-no-checkpoint", action="store_true", help="mlx_lm.lora: only with --grad-checkpoint"
    )
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    cfg = CONFIGS[args.config]

    import mlxlab  # noqa: F401
    from mlxlab.models import zoo
    from mlxlab.runtime import measure_matmul_gflops

    model_dir = str(zoo.resolve(args.model))
    rate = measure_matmul_gflops()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.config == "chunk":
            data = tmp / "chunk"
            subprocess.run(
                [sys.executable, "-m", "mlxlab", "data", "chunk", f"out={data}"],
                check=True,
                capture_output=True,
            )
        else:
            data = ROOT / "mlxlab" / "data" / "quickstart"
        batches = trained_tokens_by_step(args.model, data, cfg, args.iters)
        results: dict[str, dict] = {}
        runs = [("mlxlab", ROOT, ())]
        if args.pack:
            runs.append(("mlxlab packed", ROOT, ("data.pack=true",)))
        if args.before:
            runs.append((f"mlxlab {args.before}", worktree(args.before), ()))
        for name, cwd, extra in runs:
            print(f"running {name} ...", flush=True)
            r = run_mlxlab(args.model, data, cfg, args, tmp / name.replace(" ", "_"), cwd, extra)
            steps = r.pop("steps")
            if all("trained_tokens" in s for s in steps):
                trained = [s["trained_tokens"] for s in steps]
                lengths = None
            else:  # an earlier revision: the same sampler's batches
                trained = [b.ntoks for b in batches]
                lengths = batches
            r["trained_tok_per_s"] = sum(trained[1:]) / (r["s_per_step"] * (len(trained) - 1))
            if lengths is not None:
                f = flops_of(args.model, lengths, r["mode"])
                r["mfu"] = sum(f[1:]) / (r["s_per_step"] * (len(f) - 1)) / 1e9 / rate
            else:
                f = [s.get("tflop", 0) * 1e12 for s in steps]
                r["mfu"] = sum(f[1:]) / (r["s_per_step"] * (len(f) - 1)) / 1e9 / rate
            results[name] = r
        if not args.skip_mlx_lm:
            import mlx.core as mx
            from mlx_lm.utils import load, save

            model, tokenizer, config = load(model_dir, return_config=True)
            model.set_dtype(mx.float32)
            save(tmp / "f32", model_dir, model, tokenizer, config)
            del model
            mx.clear_cache()
            for checkpoint in [True] if args.skip_no_checkpoint else [False, True]:
                name = "mlx_lm.lora" + (" --grad-checkpoint" if checkpoint else "")
                print(f"running {name} ...", flush=True)
                r = run_mlx_lm(
                    str(tmp / "f32"), data, cfg, args, tmp / name.replace(" ", "_"), checkpoint
                )
                # its batches are its own; their model FLOPs per trained token taken as ours
                per_tok = sum(flops_of(args.model, batches[1:], r["mode"])) / sum(
                    b.ntoks for b in batches[1:]
                )
                r["mfu"] = r["trained_tok_per_s"] * per_tok / 1e9 / rate
                results[name] = r

    print(
        f"\n{args.model}, {args.config} config (batch {cfg['batch_size']}, max_seq_length "
        f"{cfg['max_seq_length']}), {args.iters} steps, matmul {rate:.0f} GFLOPS"
    )
    print(f"{'':<34}{'s/step':>8}{'trained tok/s':>15}{'MFU':>7}{'peak GB':>9}")
    for name, r in results.items():
        print(
            f"{name:<34}{r['s_per_step']:>8.2f}{r['trained_tok_per_s']:>15.1f}"
            f"{r['mfu']:>7.1%}{r['peak_gb']:>9.2f}"
        )
    ours = results["mlxlab"]
    for ref, r in results.items():
        if ref != "mlxlab":
            print(
                f"mlxlab vs {ref}: trained tok/s {ours['trained_tok_per_s'] / r['trained_tok_per_s']:.2f}x, "
                f"peak memory {ours['peak_gb'] / r['peak_gb']:.2f}x"
            )
    if args.out:
        Path(args.out).write_text(
            json.dumps({"rate_gflops": rate, "results": results}, indent=2) + "\n"
        )


if __name__ == "__main__":
    main()
