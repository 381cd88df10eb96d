"""Data parallel: N processes train one run, each on its share of every batch.

mlx-lm's trainer (mlx_lm/tuner/trainer.py) is the reference: rank-strided batches, gradients
summed with `all_sum` before the update, losses and token counts reduced. mlxlab keeps its own
loop (train/trainer.py) and injects this object as `dist`:

- Every rank walks the same seeded sequence of batches (data/batches.py `shard=`) and collates
  units rank, rank + N, ... of each, padded to the whole batch's width; `batch_size` is the
  global batch, so the same config trains the same examples per step on any world size.
- A rank weights its micro-batches by its units over the world's (the sizes are summed first),
  so one `all_sum` of the weighted gradients, loss and metrics gives what one process computes
  over the whole batch: the token-weighted mean loss for SFT, the pair mean for DPO/ORPO (ORPO's
  NLL term as a token mean per share, as with grad_accum). The sum is then clipped and applied
  on every rank, identically, so the ranks' adapters stay equal.
- Exactness: bit for bit what one process computes for the ranks' shares, one after the other,
  added (tested). Against the whole batch in one pass it differs by rounding: BLAS blocks a
  share's smaller products differently, and every sum over rows or positions (the loss, each
  weight gradient) is split into partial sums that the all_sum adds. Measured: 6.6e-7 of each
  gradient's largest entry, 7e-8 of the loss (tiny-llama SFT, tests/test_distributed.py); more
  on ill-conditioned random tiny models (2.3e-5 DPO on tiny-gemma3). With lora.dropout > 0
  each rank draws its own masks (the rank is folded into the step's seed).
- Rank 0 alone writes (checkpoints, adapter, metrics, wandb, config.yaml, summary); a resumed
  run is restored on rank 0 and its state (LoRA, optimizer, sampler position, step) copied bit
  for bit to the others, which need no access to the run directory.
"""

from __future__ import annotations

import logging
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from mlxlab.train.world import World

log = logging.getLogger(__name__)


def _arrays_only(tree):
    """(flat (key, array) pairs, other leaves) of a tree; the optimizer state holds some scalars."""
    arrays, other = [], []
    for k, v in tree_flatten(tree):
        (arrays if isinstance(v, mx.array) else other).append((k, v))
    # by name: a restored optimizer state's tree is in the file's order, not the init's
    return sorted(arrays, key=lambda kv: kv[0]), other


class DataParallel:
    """The `dist` of a data-parallel run (see the module doc)."""

    mode = "data"
    shapes = None  # FLOP counting reads the model itself

    def __init__(self, world: World):
        self.world = world
        self.steps = 0  # steps since the last log record, and the world's bytes then
        self.bytes_then = world.bytes_sent

    @property
    def size(self) -> int:
        return self.world.size

    @property
    def writer(self) -> bool:
        return self.world.writer

    def world_info(self) -> dict:
        return {"size": self.size, "mode": self.mode}

    # --- a step ------------------------------------------------------------------------------

    def total_units(self, units: float) -> float:
        return float(self.world.sum_values([units], "summing the batch's size")[0])

    def grads(self, model, grad_fn, batches):
        # Dropout: fold the rank into the step's seeded stream, so shares draw their own masks.
        mx.random.seed(int(mx.random.randint(0, 2**30, ()).item()) + self.world.rank)
        self.steps += 1
        return (grad_fn(model, b) for b in batches)

    def reduce(self, loss_sum, acc, metrics):
        tree = {"grads": acc, "loss": loss_sum}
        if metrics is not None:
            tree["metrics"] = metrics
        out = self.world.sum_tree(tree, "summing gradients")
        return out["loss"], out["grads"], out.get("metrics")

    def clip(self, acc, grad_clip):
        from mlxlab.train.trainer import clip_or_norm

        return clip_or_norm(acc, grad_clip)

    def counts(self, tokens: int, trained: int, flops: float):
        t, n, f = self.world.sum_values([tokens, trained, flops], "summing token counts")
        return int(t), int(n), f

    def sum_values(self, values: list[float]) -> list[float]:
        return self.world.sum_values(values, "summing validation losses")

    def val_loss(self, loss_fn):
        return loss_fn

    def log_fields(self) -> dict:
        """Every rank's peak memory and payload sent per step since the last record."""
        sent = (self.world.bytes_sent - self.bytes_then) / max(self.steps, 1)
        self.steps, self.bytes_then = 0, self.world.bytes_sent
        rows = self.world.gather_values([mx.get_peak_memory() / 1e9, sent / 1e6])
        return {
            "peak_mem_gb": max(r[0] for r in rows),
            "peak_mem_gb_ranks": [r[0] for r in rows],
            "sent_mb_ranks": [r[1] for r in rows],
        }

    def summary_fields(self) -> dict:
        rows = self.world.gather_values([mx.get_peak_memory() / 1e9, self.world.bytes_sent / 1e6])
        return {
            "peak_mem_gb": max(r[0] for r in rows),
            "peak_mem_gb_ranks": [r[0] for r in rows],
            "sent_mb_ranks": [r[1] for r in rows],
        }

    # --- state -------------------------------------------------------------------------------

    def on_writer(self, fn, what: str):
        return self.world.agree(fn, what)

    def sync(self, model, optimizer, sampler, start: int) -> int:
        """Rank 0's LoRA arrays, optimizer state, sampler position and step, bit for bit, on
        every rank; returns the step."""
        params = model.trainable_parameters()
        model.update(self.world.broadcast_tree(params, "copying rank 0's adapter"))
        arrays, other = _arrays_only(optimizer.state)
        got = self.world.broadcast_arrays([v for _, v in arrays], "copying the optimizer state")
        optimizer.state = tree_unflatten(
            [(k, v) for (k, _), v in zip(arrays, got, strict=True)] + other
        )
        pos = mx.array([start, sampler.epoch, sampler.index], mx.int64)
        start, sampler.epoch, sampler.index = self.world.broadcast_arrays(
            [pos], "copying the step and data position"
        )[0].tolist()
        mx.eval(model.parameters(), optimizer.state)
        return start

    def save_checkpoint(
        self, run_dir: Path, step, model, plan, optimizer, sampler, meta, keep, totals=None
    ):
        from mlxlab.train.checkpoint import save_checkpoint

        if self.writer:  # every rank holds the same state
            save_checkpoint(
                run_dir,
                step,
                model,
                plan,
                optimizer,
                sampler,
                meta,
                keep,
                self.world_info(),
                totals=totals,
            )

    def precompute_reference(
        self, model, sampler, path, model_name: str = "", start: dict | None = None
    ) -> None:
        """DPO's reference log-probs: each rank its share of every batch; rank 0 the file."""
        from mlxlab.train.objectives import precompute_reference

        precompute_reference(model, sampler, path, model_name, start, world=self.world)

    def save_adapter(self, model, plan, out_dir: Path, meta: dict) -> Path:
        from mlxlab.lora import io as lora_io

        return lora_io.save(model, plan, out_dir, meta=meta) if self.writer else out_dir
