"""Active-memory leak check: train N steps, fit the growth of active memory after warm-up.

    python -m mlxlab diag leak model=tiny-gemma3 mode=segmented segment_size=2 steps=120

Records active and peak memory after every optimizer step (after `mx.synchronize`), fits a
line to active memory past `warmup`, and fails when it grows faster than `threshold_mb` per
step. The predecessor's first segmented backward leaked ~32 MB per segment per step; a real
leak of even one small tensor per step shows here.
"""

from __future__ import annotations

import numpy as np

from mlxlab.config import BackwardConfig, OptimConfig
from mlxlab.diag.config import DiagConfig


def run(cfg: DiagConfig, verbose: bool = True) -> dict:
    from mlxlab.diag.workload import training_setup
    from mlxlab.train import backward as bw

    model, _, batch = training_setup(cfg.model, cfg.dtype, cfg.length, cfg.length // 2)
    bcfg = BackwardConfig(mode=cfg.mode, segment_size=cfg.segment_size)
    grad_fn, how = bw.make_grad_fn(model, bcfg, (1, cfg.length), compile=False)
    active, peak = record_memory(model, grad_fn, batch, cfg.steps)
    slope_mb = growth_mb_per_step(active, cfg.warmup)
    report = {
        "model": cfg.model,
        "mode": how,
        "steps": cfg.steps,
        "warmup": cfg.warmup,
        "slope_mb_per_step": slope_mb,
        "threshold_mb": cfg.threshold_mb,
        "passed": slope_mb <= cfg.threshold_mb,
        "active_bytes": active,
        "peak_bytes": peak,
    }
    if verbose:
        print(
            f"leak: {cfg.model}, {how}, {cfg.steps} steps: active memory "
            f"{active[cfg.warmup] / 1e6:.1f} -> {active[-1] / 1e6:.1f} MB, slope {slope_mb:+.4f} MB/step "
            f"(threshold {cfg.threshold_mb} MB/step): {'PASS' if report['passed'] else 'FAIL'}"
        )
    return report


def record_memory(model, grad_fn, batch, steps: int) -> tuple[list[int], list[int]]:
    """Active and peak bytes after each of `steps` optimizer steps with `grad_fn`."""
    import mlx.core as mx

    from mlxlab.train import trainer

    optimizer = trainer.make_optimizer(OptimConfig(lr=1e-5), steps)
    active, peak = [], []
    for step in range(1, steps + 1):
        trainer.train_step(model, optimizer, grad_fn, [batch], 1.0, step)
        mx.synchronize()
        active.append(mx.get_active_memory())
        peak.append(mx.get_peak_memory())
    return active, peak


def growth_mb_per_step(active: list[int], warmup: int) -> float:
    tail = np.array(active[warmup:], dtype=np.float64)
    return float(np.polyfit(np.arange(len(tail)), tail, 1)[0] / 1e6)


def plot(report: dict, path) -> object:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = np.arange(1, len(report["active_bytes"]) + 1)
    ax.plot(steps, np.array(report["active_bytes"]) / 1e6, label="active")
    ax.plot(steps, np.array(report["peak_bytes"]) / 1e6, label="peak")
    ax.axvline(report["warmup"], color="grey", ls=":", label="warm-up end")
    ax.set(
        xlabel="step",
        ylabel="MB",
        title=f"{report['model']}: {report['mode'].split(':')[0]} "
        f"({report['slope_mb_per_step']:+.4f} MB/step)",
    )
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
