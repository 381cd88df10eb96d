"""The LoRA training loop: optimizer, schedule, accumulation, clipping, validation, checkpoints.

The gradient computation is injected (`grad_fn(model, batch) -> (loss, ntoks, grads)`, plus the
objective's metrics as a fourth value for a preference objective), so the
full backward, per-layer checkpointing or a segmented backward plug in without touching the
loop. Checkpoints (train/checkpoint.py) hold everything a resumed run needs to continue exactly
where a killed one stopped: LoRA weights, optimizer state (with its step, hence the LR position)
and the sampler's position. The RNG (dropout) is re-seeded from (seed, step) before every step, so it needs no
saving: a resumed step draws the same numbers as the uninterrupted one.

A run on several processes injects `dist` (train/parallel.py: data parallel; train/pipeline.py:
the segment pipeline): it sums sizes, gradients and counts across the ranks, says who writes
(rank 0 alone), brings rank 0's resumed state to the others and, in the pipeline, runs a step's
micro-batches through the ranks. Without it (one process) every line below runs as it always did.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_map

from mlxlab.config import OptimConfig
from mlxlab.data.batches import Batch, BatchSampler
from mlxlab.errors import UserError
from mlxlab.fsutil import atomic_write_text
from mlxlab.lora.apply import LoraPlan
from mlxlab.train import checkpoint
from mlxlab.train.config import TrainConfig
from mlxlab.train.flops import model_shapes, step_flops
from mlxlab.train.losses import response_ce
from mlxlab.train.objectives import METRICS

log = logging.getLogger(__name__)

GradFn = Callable[[nn.Module, Batch], tuple]  # (loss, ntoks, grads[, metrics])


class TrainingDiverged(UserError):
    """The loss became NaN/Inf; the last good adapter is left as it was."""


def full_backward(model, loss_fn=response_ce, compile: bool = True) -> GradFn:
    """The plain backward: one `value_and_grad` over the whole model, compiled by default.

    The compiled graph takes the model's state and the RNG state as implicit inputs (as
    mlx-lm's trainer does); batches come in a handful of padded shapes, each traced once.
    Measured on a 2-core CPU (gemma3-270m, batch 4): no gain over eager; on a GPU
    compilation fuses the elementwise kernels.
    """
    loss_and_grad = nn.value_and_grad(model, loss_fn)

    def step(*arrays):
        (loss, ntoks, *aux), grads = loss_and_grad(model, *arrays)
        return (loss, ntoks, grads, *aux)

    if compile:
        state = [model.state, mx.random.state]
        step = mx.compile(step, inputs=state, outputs=state)

    def grad_fn(model_, batch: Batch):
        assert model_ is model, "full_backward was built for another model"
        return step(*batch.arrays())

    return grad_fn


def make_optimizer(cfg: OptimConfig, iters: int) -> optim.Optimizer:
    classes = {
        name.lower(): cls
        for name, cls in vars(optim).items()
        if isinstance(cls, type)
        and issubclass(cls, optim.Optimizer)
        and cls not in (optim.Optimizer, optim.MultiOptimizer)
    }
    if cfg.name.lower() not in classes:
        raise UserError(
            f"unknown optimizer {cfg.name!r}; choose one of {', '.join(sorted(classes))}"
        )
    cls = classes[cfg.name.lower()]
    lr: Callable | float = cfg.lr
    if cfg.schedule == "cosine":
        decay = optim.cosine_decay(cfg.lr, max(iters - cfg.warmup, 1), cfg.min_lr)
        lr = (
            decay
            if not cfg.warmup
            else optim.join_schedules(
                [optim.linear_schedule(0.0, cfg.lr, cfg.warmup), decay], [cfg.warmup]
            )
        )
    elif cfg.warmup:
        lr = optim.join_schedules(
            [optim.linear_schedule(0.0, cfg.lr, cfg.warmup), lambda _: cfg.lr], [cfg.warmup]
        )
    import inspect

    kwargs = {"learning_rate": lr}
    if "weight_decay" in inspect.signature(cls.__init__).parameters:
        kwargs["weight_decay"] = cfg.weight_decay
    elif cfg.weight_decay:
        raise UserError(f"optimizer {cfg.name} takes no weight_decay")
    return cls(**kwargs)


def train_step(
    model,
    optimizer,
    grad_fn: GradFn,
    batches: list[Batch],
    grad_clip: float | None,
    step: int,
    dist=None,
) -> tuple[float, float, list[float] | None]:
    """One optimizer step over `batches` (gradient accumulation); returns (loss, grad norm,
    the objective's metrics or None).

    Micro-batch gradients are weighted by their token counts (their examples' loss weights
    summed, where they carry some), so an SFT step equals one over
    the concatenated batch; a preference objective's by their pairs, exact for DPO and IPO (means
    over pairs), while ORPO's NLL term is each micro-batch's own token mean. A non-finite loss or
    gradient raises before any update. With `dist`, `batches` are this rank's shares and sizes,
    weighted sums and the norm are the world's.
    """
    sizes = [b.units for b in batches]
    total = sum(sizes) if dist is None else dist.total_units(sum(sizes))
    loss_sum, acc, metrics = mx.array(0.0), None, None
    results = (
        (grad_fn(model, b) for b in batches)
        if dist is None
        else dist.grads(model, grad_fn, batches)
    )
    for size, (loss, _, grads, *aux) in zip(sizes, results, strict=True):
        w = size / total
        grads = tree_map(lambda g, w=w: g * w, grads)
        acc = grads if acc is None else tree_map(mx.add, acc, grads)
        loss_sum = loss_sum + loss * w
        if aux:
            metrics = aux[0] * w if metrics is None else metrics + aux[0] * w
        mx.eval(loss_sum, acc, metrics)
    if dist is not None:
        loss_sum, acc, metrics = dist.reduce(loss_sum, acc, metrics)
    acc, norm = clip_or_norm(acc, grad_clip) if dist is None else dist.clip(acc, grad_clip)
    loss_value, norm_value = loss_sum.item(), norm.item()
    if not (math.isfinite(loss_value) and math.isfinite(norm_value)):
        raise TrainingDiverged(
            f"loss became {loss_value} (grad norm {norm_value}) at step {step}; "
            "stopped before updating; the last saved adapter is unchanged"
        )
    optimizer.update(model, acc)
    mx.eval(model.parameters(), optimizer.state)
    return loss_value, norm_value, None if metrics is None else metrics.tolist()


def clip_or_norm(acc, grad_clip: float | None):
    """(gradients clipped to `grad_clip`'s global norm, or as they are; the norm)."""
    if grad_clip:
        return optim.clip_grad_norm(acc, grad_clip)
    return acc, mx.sqrt(sum(mx.sum(g.astype(mx.float32) ** 2) for _, g in tree_flatten(acc)))


VALIDATION_HEARTBEAT_S = 60.0


def evaluate(model, sampler: BatchSampler, limit: int = 0, loss_fn=response_ce, dist=None) -> float:
    """Mean loss over the validation batches (dropout off), weighted by trained tokens (their
    loss weights summed, where examples carry some; by pairs
    for a preference objective's `loss_fn`, which then takes the batch's reference log-probs).
    With `dist`, over the world (a data-parallel rank sees its shares, some possibly empty)."""
    model.eval()
    total, weighted = 0, 0.0
    beat = time.monotonic()
    for k, b in enumerate(sampler.one_pass(limit), 1):
        if b is None:  # a data-parallel rank's empty share of a small batch
            continue
        loss = loss_fn(model, *b.arrays())[0]
        size = b.units
        weighted += loss.item() * size
        total += size
        if time.monotonic() - beat >= VALIDATION_HEARTBEAT_S:  # a long pass says it is alive
            beat = time.monotonic()
            log.info(f"validation: {k} batches")
    model.train()
    if dist is not None:
        weighted, total = dist.sum_values([weighted, total])
    return weighted / total if total > 0 else 0.0


# --- logging ----------------------------------------------------------------------------------


@dataclass
class RunLog:
    """Console progress, metrics.jsonl in the run dir, and wandb (offline by default)."""

    run_dir: Path
    iters: int
    wandb_mode: str = "disabled"
    wandb_project: str = "mlxlab"
    config: dict = field(default_factory=dict)
    _wandb: object = None
    _bar: object = None

    def __post_init__(self):
        if self.wandb_mode != "disabled":
            import os

            import wandb

            os.environ.setdefault("WANDB_SILENT", "true")
            self._wandb = wandb.init(
                mode=self.wandb_mode,
                project=self.wandb_project,
                dir=str(self.run_dir),
                config=self.config,
                name=self.run_dir.name,
                reinit="finish_previous",
            )
        if sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=self.iters, unit="step", dynamic_ncols=True)

    def metrics(self, record: dict, show: bool) -> None:
        with (self.run_dir / "metrics.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])
        hidden = ("step", "elapsed_s", "tokens", "trained_tokens", "tflop")  # in the file only
        text = " | ".join(_fmt(k, v) for k, v in record.items() if k not in hidden)
        if self._bar is not None:
            self._bar.n = record["step"]
            self._bar.set_postfix_str(text, refresh=True)
            if "val_loss" in record:
                self._bar.write(f"step {record['step']}: {text}")
        elif show:
            log.info(f"step {record['step']:>5}/{self.iters} | {text}")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._wandb is not None:
            self._wandb.finish()


class QuietLog:
    """The log of a rank other than 0: it writes nothing and prints nothing."""

    def metrics(self, record: dict, show: bool) -> None:
        pass

    def close(self) -> None:
        pass


PAIR_METRICS = {k for keys in METRICS.values() for k in keys}  # printed with 4 digits
# GRPO's (train/grpo/loop.py): the head's metrics, shares, and rewards (reward_<name>...)
GRPO_FIELDS = {
    "kl",
    "clip_frac",
    "clip_low",
    "clip_high",
    "ratio",
    "logp",
    "truncated",
    "groups_kept",
}


def _fmt(key: str, value) -> str:
    if isinstance(value, list):  # per rank (train/parallel.py, pipeline.py)
        return f"{key} [" + " ".join(f"{v:.4g}" for v in value) + "]"
    if isinstance(value, float):
        if key == "lr":
            return f"lr {value:.2e}"
        if key == "mfu":  # model FLOPs / the measured matmul rate (train/flops.py)
            return f"mfu {value:.1%}"
        if "loss" in key:
            return f"{key} {value:.4f}"
        if (
            key in PAIR_METRICS
            or key in GRPO_FIELDS
            or key.startswith(("reward", "val_reward"))
            or key == "bubble"
        ):
            return f"{key} {value:.4g}"
        return f"{key} {value:.1f}"
    return f"{key} {value}"


# --- the loop ---------------------------------------------------------------------------------


def _logged_initial_val_loss(run_dir: Path) -> float | None:
    """The step-0 validation loss a resumed run's first attempt wrote to metrics.jsonl."""
    try:
        for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
            rec = json.loads(line)
            if rec.get("step") == 0 and "val_loss" in rec:
                return rec["val_loss"]
    except (OSError, ValueError):
        return None
    return None


def train(
    model,
    plan: LoraPlan,
    train_sampler: BatchSampler,
    valid_sampler: BatchSampler | None,
    cfg: TrainConfig,
    run_dir: Path,
    grad_fn: GradFn | None = None,
    run_log: RunLog | None = None,
    meta: dict | None = None,
    dist=None,
) -> dict:
    """Train `model`'s LoRA parameters for cfg.iters steps; return a summary.

    Resumes from the newest checkpoint in `run_dir` when cfg.resume is set. `dist` (several
    processes): rank 0 restores and writes, every rank trains (see the module doc).
    """
    from mlxlab.train.objectives import PairObjective

    objective = PairObjective.from_config(cfg)
    val_loss = response_ce if objective is None else objective.loss
    if dist is not None:
        val_loss = dist.val_loss(val_loss)
    if grad_fn is None:
        if objective is not None:
            raise ValueError("a preference objective needs its grad_fn (backward.make_grad_fn)")
        grad_fn = full_backward(model, compile=cfg.compile)
    optimizer = make_optimizer(cfg.optim, cfg.iters)
    optimizer.init(model.trainable_parameters())
    start = 0
    if cfg.resume and dist is None:
        start = checkpoint.resume(run_dir, model, optimizer, train_sampler)
    elif dist is not None:  # rank 0 restores; every rank gets its state (and its refusal)
        if cfg.resume:
            start = dist.on_writer(
                lambda: checkpoint.resume(
                    run_dir, model, optimizer, train_sampler, dist.world_info()
                ),
                "restoring the checkpoint",
            )
        start = dist.sync(model, optimizer, train_sampler, start or 0)
    # the writer's checkpoints and summary carry them (another rank's summary is not written)
    totals = (
        checkpoint.RunTotals.load(run_dir, start)
        if dist is None or dist.writer
        else checkpoint.RunTotals()
    )
    run_log = run_log or RunLog(run_dir, cfg.iters)
    shapes, rate = _flop_counting(model, dist)
    model.train()
    mx.reset_peak_memory()
    summary = {"start_step": start, "val_loss": None}
    t0, tokens, since = time.perf_counter(), 0, time.perf_counter()
    totals.t0 = t0
    window_flops = run_flops = 0.0
    try:
        if valid_sampler is not None and start == 0 and cfg.val_every:
            val = evaluate(model, valid_sampler, cfg.val_batches, val_loss, dist)
            run_log.metrics({"step": 0, "val_loss": val}, show=True)
            summary["initial_val_loss"] = val
        elif start:  # resumed: the first attempt logged it
            first = _logged_initial_val_loss(run_dir)
            if first is not None:
                summary["initial_val_loss"] = first
        for step in range(start + 1, cfg.iters + 1):
            batches = [train_sampler.next() for _ in range(cfg.grad_accum)]
            mx.random.seed(cfg.seed * 1_000_003 + step)  # dropout stream of this step
            loss, norm, aux = train_step(
                model, optimizer, grad_fn, batches, cfg.optim.grad_clip, step, dist
            )
            lr = optimizer.learning_rate.item()  # the rate this step used
            step_tokens = sum(sum(b.lengths) for b in batches)  # real tokens, no padding
            trained = sum(b.ntoks for b in batches)
            f = 0.0
            if shapes is not None:
                f = sum(
                    step_flops(
                        shapes, list(b.lengths), b.ntoks, cfg.backward.mode, cfg.backward.head_chunk
                    )["total"]
                    for b in batches
                )
            if dist is not None:  # the world's counts
                step_tokens, trained, f = dist.counts(step_tokens, trained, f)
            tokens += step_tokens
            record = {
                "step": step,
                "loss": loss,
                "lr": lr,
                "grad_norm": norm,
                "elapsed_s": round(time.perf_counter() - t0, 3),
                "tokens": step_tokens,
                "trained_tokens": trained,
            }
            if aux is not None and objective is not None:
                record.update(zip(objective.metrics, aux, strict=True))
            if shapes is not None:
                window_flops += f
                run_flops += f
                record["tflop"] = f / 1e12
            if step % cfg.log_every == 0 or step == cfg.iters:
                now = time.perf_counter()
                record["tok_per_s"] = tokens / (now - since)
                record["peak_mem_gb"] = mx.get_peak_memory() / 1e9
                if shapes is not None:
                    record["gflops"] = window_flops / (now - since) / 1e9
                    record["mfu"] = record["gflops"] / rate
                if dist is not None:  # every rank's peak memory (pipeline: bubble share)
                    record.update(dist.log_fields())
                totals.saw(record["peak_mem_gb"])
                tokens, since, window_flops = 0, now, 0.0
            if (
                valid_sampler is not None
                and cfg.val_every
                and (step % cfg.val_every == 0 or step == cfg.iters)
            ):
                record["val_loss"] = summary["val_loss"] = evaluate(
                    model, valid_sampler, cfg.val_batches, val_loss, dist
                )
            run_log.metrics(record, show="tok_per_s" in record or "val_loss" in record)
            summary["loss"] = loss
            if cfg.save_every and step % cfg.save_every == 0 and step < cfg.iters:
                # with dist every rank takes part (a pipeline gathers its stages); rank 0 writes
                save = checkpoint.save_checkpoint if dist is None else dist.save_checkpoint
                save(
                    run_dir,
                    step,
                    model,
                    plan,
                    optimizer,
                    train_sampler,
                    meta or {},
                    cfg.keep_last,
                    totals=totals.so_far(),
                )
    finally:
        run_log.close()
    own_s = time.perf_counter() - t0
    summary.update(steps=cfg.iters, seconds=own_s, peak_mem_gb=mx.get_peak_memory() / 1e9)
    if dist is not None:  # every rank's peak memory, traffic (pipeline: bubble) over the run
        summary.update(dist.summary_fields())
    summary.update(totals.summary(summary["peak_mem_gb"]))  # the whole run's, over its attempts
    if shapes is not None and own_s > 0:
        # This attempt's mean (validation and checkpoint time included, as in the step records).
        summary["model_tflop"] = run_flops / 1e12
        summary["matmul_gflops"] = rate
        summary["mfu"] = run_flops / own_s / 1e9 / rate
    return summary


def _flop_counting(model, dist=None):
    """(shapes, float32 matmul GFLOPS measured now) for the MFU figures, or (None, None) for a
    model family the FLOP count does not know (train/flops.py). Several processes: the shapes
    of the whole model (a pipeline stage holds only its layers) and the world's rate."""
    from mlxlab.runtime import measure_matmul_gflops

    try:
        shapes = model_shapes(model) if getattr(dist, "shapes", None) is None else dist.shapes
    except (UserError, AttributeError) as e:
        log.debug("no FLOP count for this model: %s", e)
        return None, None
    rate = measure_matmul_gflops()
    return shapes, rate if dist is None else rate * dist.size


def write_summary(run_dir: Path, summary: dict) -> None:
    atomic_write_text(run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
