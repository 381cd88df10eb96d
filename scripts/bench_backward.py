"""Peak memory and seconds/step of each backward mode vs mlx-lm's grad checkpointing, one run.

    python scripts/bench_backward.py [--model gemma3-270m] [--lengths 512 1024 2048 4096]
                                     [--modes full checkpoint seg1 seg2 seg4 auto mlx_lm_gc]
                                     [--steps 1] [--out bench_backward]

One LoRA step (rank 8 on q k v o gate up down, all layers, AdamW) on one sequence of L tokens
of real text whose last quarter is the response. Each (mode, L) runs in its own process after
one warm-up step, so peaks do not mix. Modes:
  full, checkpoint           mlxlab's full backward / per-layer mx.checkpoint
  seg1 seg2 seg4             segmented backward, segments of 1, 2, 4 layers
  auto                       segmented, plan=auto with --target-gb (default 1.6)
  mlx_lm_gc                  mlx-lm's own step: nn.value_and_grad(model, default_loss) with
                             mlx_lm.tuner.trainer.grad_checkpoint on the layers (what
                             `mlx_lm.lora --grad-checkpoint` runs), same dtype and BLAS as ours
Writes <out>.json and <out>.png; prints the table and the ratios the issue asks for.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

MEASURE = r"""
import json, sys, time
import mlxlab
import mlx.core as mx, mlx.nn as nn
from mlxlab.config import BackwardConfig, LoraConfig, OptimConfig
from mlxlab.data.batches import collate
from mlxlab.data.datasets import Example
from mlxlab.lora import apply as lora
from mlxlab.models.tokenizers import _tiny_corpus  # real stdlib text
from mlxlab.models.zoo import load
from mlxlab.train import backward as bw, trainer

model_name, mode, length, steps, target = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
model, tok = load(model_name)
plan = lora.plan(model, LoraConfig(targets=["q", "k", "v", "o", "gate", "up", "down"], rank=8))
lora.apply(model, plan, seed=0)
model.train()
text = "\n\n".join(_tiny_corpus()) * 20
ids = tok.encode(text)[:length]
ex = Example(ids=ids, offset=length - length // 4)
batch = collate([ex])
optimizer = trainer.make_optimizer(OptimConfig(lr=1e-5), 100)
if mode == "mlx_lm_gc":
    from mlx_lm.tuner.trainer import default_loss, grad_checkpoint
    grad_checkpoint(model.layers[0])  # mlx-lm patches the layer class, as its CLI does
    tokens = mx.array([ids])
    lengths = mx.array([[ex.offset, length]])
    vg = nn.value_and_grad(model, default_loss)
    def grad_fn(model_, b):
        (loss, ntoks), g = vg(model, tokens, lengths)
        return loss, ntoks, g
else:
    cfg = {"full": BackwardConfig(), "checkpoint": BackwardConfig(mode="checkpoint"),
           "seg1": BackwardConfig(mode="segmented", segment_size=1),
           "seg2": BackwardConfig(mode="segmented", segment_size=2),
           "seg4": BackwardConfig(mode="segmented", segment_size=4),
           "auto": BackwardConfig(mode="segmented", plan="auto", memory_target_gb=target)}[mode]
    grad_fn, how = bw.make_grad_fn(model, cfg, (1, length), compile=False)
    print(how, file=sys.stderr)
trainer.train_step(model, optimizer, grad_fn, [batch], 1.0, 1)  # warm-up
mx.synchronize(); mx.clear_cache(); mx.reset_peak_memory()
t = time.perf_counter()
for s in range(steps):
    trainer.train_step(model, optimizer, grad_fn, [batch], 1.0, s + 2)
mx.synchronize()
print(json.dumps({"s_per_step": (time.perf_counter() - t) / steps, "peak_gb": mx.get_peak_memory() / 1e9,
                  "active_gb": mx.get_active_memory() / 1e9}))
"""

ALL_MODES = ["full", "checkpoint", "mlx_lm_gc", "seg1", "seg2", "seg4", "auto"]


def measure(model: str, mode: str, length: int, steps: int, target: float) -> dict | None:
    r = subprocess.run([sys.executable, "-c", MEASURE, model, mode, str(length), str(steps), str(target)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        tail = r.stderr.strip().splitlines()[-1:] or ["?"]
        print(f"  {mode} @ {length}: failed ({tail[0]})", flush=True)
        return None
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    ap.add_argument("--modes", nargs="+", default=ALL_MODES, choices=ALL_MODES)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--target-gb", type=float, default=1.6)
    ap.add_argument("--out", default="bench_backward")
    args = ap.parse_args()

    results: dict[str, dict[int, dict]] = {m: {} for m in args.modes}
    for length in args.lengths:
        for mode in args.modes:
            r = measure(args.model, mode, length, args.steps, args.target_gb)
            if r:
                results[mode][length] = r
                print(f"L={length:<5} {mode:<11} {r['s_per_step']:8.1f} s/step  peak {r['peak_gb']:6.2f} GB",
                      flush=True)
            Path(f"{args.out}.json").write_text(json.dumps(results, indent=2))

    print(f"\n{args.model}: peak GB / s per step")
    print(f"{'mode':<12}" + "".join(f"{L:>16}" for L in args.lengths))
    for mode in args.modes:
        cells = [f"{results[mode][L]['peak_gb']:6.2f} / {results[mode][L]['s_per_step']:6.1f}"
                 if L in results[mode] else "failed" for L in args.lengths]
        print(f"{mode:<12}" + "".join(f"{c:>16}" for c in cells))
    longest = max((L for L in args.lengths if all(L in results[m] for m in ("mlx_lm_gc", "full"))), default=None)
    if longest:
        for mode in ("seg1", "seg2", "seg4", "auto"):
            if longest in results.get(mode, {}):
                r = results[mode][longest]
                print(f"{mode} @ {longest}: peak {r['peak_gb'] / results['mlx_lm_gc'][longest]['peak_gb']:.2f}x "
                      f"mlx-lm grad-checkpoint (target <= 0.5), time "
                      f"{r['s_per_step'] / results['full'][longest]['s_per_step']:.2f}x full (target <= 1.3)")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
        for mode, rows in results.items():
            Ls = sorted(rows)
            a.plot(Ls, [rows[L]["peak_gb"] for L in Ls], marker="o", label=mode)
            b.plot(Ls, [rows[L]["s_per_step"] for L in Ls], marker="o", label=mode)
        a.set(xlabel="sequence length", ylabel="peak memory (GB)", title=f"{args.model}: peak memory")
        b.set(xlabel="sequence length", ylabel="seconds / step", title="time per step")
        for ax in (a, b):
            ax.set_xscale("log", base=2)
            ax.grid(alpha=0.3)
        a.legend()
        fig.tight_layout()
        fig.savefig(f"{args.out}.png", dpi=100)
        print(f"wrote {args.out}.json and {args.out}.png")
    except ImportError:
        print(f"wrote {args.out}.json (pip install matplotlib for the plot)")


if __name__ == "__main__":
    main()
