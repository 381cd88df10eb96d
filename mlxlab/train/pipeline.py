"""Segment pipeline: the segmented backward's segments spread over the ranks of a run.

`backward.mode=segmented backward.pipeline=true` under `mlx.launch -n K`: rank k holds a run of
consecutive segments, and a step's micro-batches flow through the ranks (pipeline_stage.py: what
a rank holds and computes, its transfers; pipeline_plan.py: the placement and the order).
`Pipeline` is the run's `dist` (train/trainer.py): that stage plus the trainer's hooks.

Exactness: the loss, the metrics and the LoRA gradients are those of one process running the
segmented backward with the same grad_accum, bit for bit (pipeline_stage.py). The global gradient
norm gathers each array's squared sum from its owner and adds them in the single process's order,
so clipping, the optimizer update and the adapter are bit-identical too
(tests/test_distributed.py). Checkpoints and the adapter are gathered on rank 0 and written in
the single-process format.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from mlxlab.train.pipeline_stage import Stage
from mlxlab.train.world import share


class Pipeline(Stage):
    """The `dist` of a segment-pipeline run (train/trainer.py; see the module doc)."""

    mode = "pipeline"

    @property
    def size(self) -> int:
        return self.n

    @property
    def writer(self) -> bool:
        return self.world.writer

    def world_info(self) -> dict:
        return {"size": self.n, "mode": self.mode}

    # --- the trainer's hooks -----------------------------------------------------------------

    def total_units(self, units: float) -> float:
        return units  # every rank sees the whole batches

    def grads(self, model, grad_fn, batches):
        return iter(self.run(batches))

    def reduce(self, loss_sum, acc, metrics):
        arrays = [loss_sum] + ([] if metrics is None else [metrics])
        got = self.world.broadcast_arrays(arrays, "sharing the loss", root=self.n - 1)
        return got[0], acc, (None if metrics is None else got[1])

    def clip(self, acc, grad_clip):
        """The single process's clip_grad_norm (or plain norm), with each array's squared sum
        computed by its owner and added in the same order."""
        flat = tree_flatten(acc)
        if grad_clip:
            sq = [
                (g.astype(mx.float32) if g.dtype == mx.float16 else g).square().sum()
                for _, g in flat
            ]
        else:
            sq = [mx.sum(g.astype(mx.float32) ** 2) for _, g in flat]
        mine = mx.stack(
            [s if g.size else mx.zeros_like(s) for s, (_, g) in zip(sq, flat, strict=True)]
        )
        every = self.world.all_sum(mine, "summing the gradient norm")  # one owner per entry
        parts = [every[i] for i in range(len(flat))]
        if not grad_clip:
            return acc, mx.sqrt(sum(parts))
        total = 0.0
        for s in parts:
            total = total + s
        total_norm = mx.sqrt(total)
        normalizer = mx.minimum(grad_clip / (total_norm + 1e-6), 1.0)

        def scale(g):
            if mx.issubdtype(g.dtype, mx.floating):
                return (g * normalizer).astype(g.dtype)
            return g * normalizer

        return tree_unflatten([(k, scale(g)) for k, g in flat]), total_norm

    def counts(self, tokens: int, trained: int, flops: float):
        return tokens, trained, flops

    def sum_values(self, values):
        return values

    def log_fields(self) -> dict:
        wait = self.window_wait / self.window_wall if self.window_wall else 0.0
        sent = (self.world.bytes_sent - self.window_bytes) / max(self.window_steps, 1)
        rows = self.world.gather_values([mx.get_peak_memory() / 1e9, wait, sent / 1e6])
        self.window_wait = self.window_wall = 0.0
        self.window_steps, self.window_bytes = 0, self.world.bytes_sent
        return _rank_fields(rows)

    def summary_fields(self) -> dict:
        wait = self.run_wait / self.run_wall if self.run_wall else 0.0
        rows = self.world.gather_values(
            [mx.get_peak_memory() / 1e9, wait, self.world.bytes_sent / 1e6, self.held[0] / 1e9]
        )
        return {
            **_rank_fields(rows),
            "weights_gb_ranks": [r[3] for r in rows],
            "weights_gb_model": self.held[1] / 1e9,
        }

    # --- state: resume, checkpoints, the adapter ---------------------------------------------

    def on_writer(self, fn, what: str):
        return self.world.agree(fn, what)

    def _share_owned(self, flat, to_all: bool, what: str) -> dict:
        """Each owner's arrays of `flat` (name, array) on rank 0 (`to_all`: on every rank), bit
        for bit. Arrays no rank owns (the optimizer's step) are the same everywhere: left out."""
        got, values = {}, dict(flat)
        for r in range(self.n):
            # by name: a restored optimizer state's tree is in the file's order, not the init's
            names = sorted(k for k in values if self._owner(k) == r)
            if not names:
                continue
            mine = [values[k] for k in names] if self.k == r else None
            shared = share(self.world, mine, len(names), r, what)
            if to_all or self.k == 0:
                got.update(zip(names, shared, strict=True))
        return got

    @contextmanager
    def _gathered(self, optimizer=None):
        """Rank 0's model (and optimizer) hold every rank's arrays for a while: a checkpoint or
        the adapter is written from there in the single-process format."""
        params = tree_flatten(self.model.trainable_parameters())
        p_full = self._share_owned(params, False, "gathering the adapter")
        o_full = {}
        if optimizer is not None:
            opt = [(k, v) for k, v in tree_flatten(optimizer.state) if isinstance(v, mx.array)]
            o_full = self._share_owned(opt, False, "gathering the optimizer state")
        if self.k != 0:
            yield
            return
        saved_state = optimizer.state if optimizer is not None else None
        self.model.update(tree_unflatten(list(p_full.items())))
        if optimizer is not None:
            optimizer.state = _with_arrays(optimizer.state, o_full)
        try:
            yield
        finally:
            self.model.update(tree_unflatten(params))
            if optimizer is not None:
                optimizer.state = saved_state

    def save_checkpoint(
        self, run_dir: Path, step, model, plan, optimizer, sampler, meta, keep, totals=None
    ):
        from mlxlab.train.checkpoint import save_checkpoint

        with self._gathered(optimizer):
            if self.writer:
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

    def save_adapter(self, model, plan, out_dir: Path, meta: dict) -> Path:
        from mlxlab.lora import io as lora_io

        with self._gathered():
            if self.writer:
                return lora_io.save(model, plan, out_dir, meta=meta)
        return out_dir

    def sync(self, model, optimizer, sampler, start: int) -> int:
        """After rank 0 restored a checkpoint (its model and optimizer then hold every array),
        each rank takes its own arrays from it and rank 0 lets the others' go; the step and
        the data position go to every rank."""
        pos = mx.array([start, sampler.epoch, sampler.index], mx.int64)
        start, sampler.epoch, sampler.index = self.world.broadcast_arrays(
            [pos], "copying the step and data position"
        )[0].tolist()
        if start == 0:  # nothing restored: every rank initialized the same LoRA arrays
            return start
        params = tree_flatten(model.trainable_parameters())
        opt = [(k, v) for k, v in tree_flatten(optimizer.state) if isinstance(v, mx.array)]
        p_all = self._from_root(params, "copying the restored adapter")
        o_all = self._from_root(opt, "copying the restored optimizer state")
        model.update(tree_unflatten(list(p_all.items())))
        optimizer.state = _with_arrays(optimizer.state, o_all)
        mx.eval(model.parameters(), optimizer.state)
        mx.clear_cache()
        return start

    def _from_root(self, flat, what: str) -> dict:
        """Rank 0's arrays of `flat`: an owner keeps its own (shapes come along), the other
        ranks an empty array in their place; arrays without an owner (the optimizer's step and
        rate) every rank takes."""
        values = dict(flat)
        names = sorted(values)  # (see _share_owned)
        got = share(
            self.world, [values[k] for k in names] if self.k == 0 else None, len(names), 0, what
        )
        return {
            k: v if self._owner(k) in (None, self.k) else mx.zeros((0,), v.dtype)
            for k, v in zip(names, got, strict=True)
        }


def _with_arrays(tree, arrays: dict):
    """`tree` (the optimizer state) with the arrays at the names in `arrays` replaced."""
    flat = [(k, arrays.get(k, v)) for k, v in tree_flatten(tree)]
    return tree_unflatten(flat)


def _rank_fields(rows: list[list[float]]) -> dict:
    """Per-rank [peak GB, waiting share, MB sent, ...] as the step and summary fields."""
    return {
        "peak_mem_gb": max(r[0] for r in rows),
        "peak_mem_gb_ranks": [r[0] for r in rows],
        "bubble": sum(r[1] for r in rows) / len(rows),
        "bubble_ranks": [r[1] for r in rows],
        "sent_mb_ranks": [r[2] for r in rows],
    }
