"""Peak memory and seconds/step per backward mode and sequence length, mlx-lm alongside.

    python -m mlxlab diag memory model=gemma3-270m lengths=[512,1024] modes=[full,seg4,mlx_lm_gc]

One LoRA step (rank 8 on q k v o gate up down of every layer, AdamW) on one sequence of real
text whose last quarter is the response. Each (mode, length) runs in its own process after a
warm-up step, so peaks never mix. Modes:
  full, checkpoint, segN, auto   mlxlab's backward modes (auto: plan=auto at `target_gb`)
  dpo-MODE, orpo-MODE            a DPO / ORPO step in MODE on one pair, each side `length` tokens
                                 (the rejected side: the same prompt, its response reversed); the
                                 DPO reference log-probs are precomputed, as dpo.precompute_ref
  segNhC                         segments of N with the loss head in chunks of C positions
  mlx_lm, mlx_lm_gc              mlx-lm's own step: nn.value_and_grad(model, default_loss),
                                 plain or with mlx_lm.tuner.trainer.grad_checkpoint on the layers
                                 (what `mlx_lm.lora [--grad-checkpoint]` runs), same dtype and BLAS
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from pathlib import Path

log = logging.getLogger(__name__)


def _check_mode(mode: str) -> None:
    from mlxlab.diag.config import MEMORY_MODES, is_memory_mode
    from mlxlab.schema import check_choice

    if not is_memory_mode(mode):
        check_choice("modes", mode, MEMORY_MODES, "memory mode")


def worker(
    model_name: str,
    mode: str,
    length: int,
    steps: int,
    dtype: str,
    target_gb: float,
    lora_type: str = "lora",
) -> dict:
    """Run in a fresh process: warm-up step, then `steps` timed steps; peak after warm-up.
    `lora_type`: LoRA, DoRA or full fine-tuning of the same projections (mlx_lm modes too)."""
    import mlx.core as mx
    import mlx.nn as nn

    from mlxlab.config import BackwardConfig, OptimConfig
    from mlxlab.diag.workload import training_setup
    from mlxlab.train import backward as bw
    from mlxlab.train import trainer

    offset = length - length // 4
    model, ids, batch = training_setup(model_name, dtype, length, offset, lora_type)
    optimizer = trainer.make_optimizer(OptimConfig(lr=1e-5), 100)
    objective = None
    if mode.startswith(("dpo-", "orpo-")):
        import dataclasses

        from mlxlab.data.batches import BatchSampler
        from mlxlab.data.datasets import Example
        from mlxlab.train.objectives import PairObjective, reference_logps

        kind, mode = mode.split("-", 1)
        objective = PairObjective(kind)
        rejected = ids[:offset] + ids[offset:][::-1]  # the same prompt, a scrambled response
        sampler = BatchSampler(
            [Example(ids, offset), Example(rejected, offset)], 1, 0, shuffle=False, pairs=True
        )
        batch = next(sampler.one_pass())
        if objective.needs_reference:
            batch = dataclasses.replace(batch, ref=reference_logps(model, batch))
    if mode.startswith("mlx_lm"):
        from mlx_lm.tuner.trainer import default_loss, grad_checkpoint

        if mode == "mlx_lm_gc":
            grad_checkpoint(model.layers[0])  # mlx-lm patches the layer class, as its CLI does
        tokens, lengths = mx.array([ids]), mx.array([[offset, length]])
        vg = nn.value_and_grad(model, default_loss)

        def grad_fn(model_, b):
            (loss, ntoks), g = vg(model, tokens, lengths)
            return loss, ntoks, g
    else:
        if mode == "auto":
            cfg = BackwardConfig(mode="segmented", plan="auto", memory_target_gb=target_gb)
        elif mode.startswith("seg"):
            size, _, chunk = mode[3:].partition("h")
            cfg = BackwardConfig(
                mode="segmented", segment_size=int(size), head_chunk=int(chunk or 0)
            )
        else:
            cfg = BackwardConfig(mode=mode)
        rows = 2 if objective is not None else 1
        grad_fn, _ = bw.make_grad_fn(model, cfg, (rows, length), compile=False, objective=objective)
    trainer.train_step(model, optimizer, grad_fn, [batch], 1.0, 1)
    mx.synchronize()
    mx.clear_cache()
    mx.reset_peak_memory()
    t = time.perf_counter()
    for s in range(steps):
        trainer.train_step(model, optimizer, grad_fn, [batch], 1.0, s + 2)
    mx.synchronize()
    return {
        "s_per_step": (time.perf_counter() - t) / steps,
        "peak_gb": mx.get_peak_memory() / 1e9,
        "active_gb": mx.get_active_memory() / 1e9,
    }


def measure(
    model: str,
    mode: str,
    length: int,
    steps: int = 1,
    dtype: str = "auto",
    target_gb: float = 1.6,
    lora_type: str = "lora",
) -> dict:
    """`worker` in a subprocess; {"error": ...} when it fails (e.g. out of memory)."""
    _check_mode(mode)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlxlab.diag.memory",
            model,
            mode,
            str(length),
            str(steps),
            dtype,
            str(target_gb),
            lora_type,
        ],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        lines = r.stderr.strip().splitlines()
        return {"error": lines[-1] if lines else f"exit code {r.returncode}"}
    return json.loads(r.stdout.strip().splitlines()[-1])


def sweep(
    model: str,
    lengths: list[int],
    modes: list[str],
    steps: int = 1,
    dtype: str = "auto",
    target_gb: float = 1.6,
    progress=log.info,
    lora_type: str = "lora",
) -> dict:
    for mode in modes:
        _check_mode(mode)
    results: dict[str, dict] = {m: {} for m in modes}
    for length in lengths:
        for mode in modes:
            r = measure(model, mode, length, steps, dtype, target_gb, lora_type)
            results[mode][str(length)] = r
            if "error" in r:
                progress(f"L={length:<5} {mode:<11} failed: {r['error']}")
            else:
                progress(
                    f"L={length:<5} {mode:<11} {r['s_per_step']:8.1f} s/step  peak {r['peak_gb']:6.2f} GB"
                )
    return {
        "model": model,
        "dtype": dtype,
        "lora_type": lora_type,
        "lengths": lengths,
        "results": results,
    }


def table(report: dict) -> str:
    lengths = report["lengths"]
    rows = [
        f"{report['model']}: peak GB / s per step",
        f"{'mode':<12}" + "".join(f"{L:>18}" for L in lengths),
    ]
    for mode, by_len in report["results"].items():
        cells = []
        for L in lengths:
            r = by_len.get(str(L), {"error": "-"})
            cells.append(
                "failed" if "error" in r else f"{r['peak_gb']:6.2f} / {r['s_per_step']:7.1f}"
            )
        rows.append(f"{mode:<12}" + "".join(f"{c:>18}" for c in cells))
    return "\n".join(rows)


def plot(report: dict, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for mode, by_len in report["results"].items():
        pts = sorted((int(L), r) for L, r in by_len.items() if "error" not in r)
        if pts:
            a.plot([p[0] for p in pts], [p[1]["peak_gb"] for p in pts], marker="o", label=mode)
            b.plot([p[0] for p in pts], [p[1]["s_per_step"] for p in pts], marker="o", label=mode)
    a.set(
        xlabel="sequence length", ylabel="peak memory (GB)", title=f"{report['model']}: peak memory"
    )
    b.set(xlabel="sequence length", ylabel="seconds / step", title="time per step")
    for ax in (a, b):
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    a.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


if __name__ == "__main__":
    import mlxlab  # noqa: F401  (BLAS first)

    name, mode, length, steps, dtype, target, kind = sys.argv[1:8]
    print(json.dumps(worker(name, mode, int(length), int(steps), dtype, float(target), kind)))
