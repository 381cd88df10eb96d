"""Segment pipeline (pipeline.py), one rank's stage: what it holds and what it computes.

`backward.mode=segmented backward.pipeline=true` under `mlx.launch -n K`: the plan's segments
(backward.segment_size layers each) are cut into K runs of consecutive segments, balanced by
their FLOPs with the loss head counted on the last run (pipeline_plan.py), and rank k holds only
its run's layers, weights and LoRA arrays both (the model is loaded lazily and the other layers'
arrays replaced by empty ones before anything reads them), plus the embedding on rank 0 and the
final norm and loss head on rank K-1 (a tied head is the embedding again). A model too large for
one machine's memory trains across several.

A step's micro-batches (its `grad_accum` batches of `batch_size`) flow through the ranks:
rank k runs the forward of its segments (train/backward.py `Segments`, the code the
single-process segmented backward runs) and sends the boundary (the hidden state, Gemma 4's
donor K/V streams whose sharers sit on later ranks, Gemma 4's per-layer inputs of later
layers) to rank k+1 with `mx.distributed.send` (a header of shapes and dtypes first:
world.py's `encode`); the last rank runs its segments' vjps with the loss head and the
cotangents travel back the same way, each rank adding its sharers' cotangents to a donor
stream's before passing it on. The order is one-forward-one-backward, receiving before sending
a cotangent back (`pipeline_plan.schedule`, deadlock-free with blocking transfers); each rank
measures the time it waits in transfers (`bubble` in the step records).

Every number is computed by the same functions from the same inputs as in one process running
the segmented backward with the same grad_accum, so the loss, the metrics and the LoRA gradients
are equal bit for bit; the micro-batches' dropout seeds are drawn as that process draws them.
`Stage` is the base of pipeline.py's `Pipeline`, which adds the trainer's hooks (the loss and
the gradient norm across ranks, the per-rank reports, checkpoints, the adapter, resume).
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from mlxlab.errors import UserError
from mlxlab.train.pipeline_plan import assign_stages, schedule, segment_costs
from mlxlab.train.world import HEADER, World, decode, encode

log = logging.getLogger(__name__)

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclasses.dataclass
class _Micro:
    """One micro-batch's state on this rank, from its forward to its backward."""

    base: int
    arrays: tuple
    ctx: object = None
    bounds: dict = dataclasses.field(default_factory=dict)  # segment -> its input boundary
    kv: dict = dataclasses.field(default_factory=dict)  # donor layer -> (k, v)
    received: list | None = None  # what the previous rank sent
    cotangents: list | None = None  # what the next rank sent back
    d_in: object = None  # the cotangent of this rank's input boundary
    dkv: dict = dataclasses.field(default_factory=dict)
    grads: dict = dataclasses.field(default_factory=dict)
    outs: list | None = None  # loss, ntoks, *metrics (last rank)
    sent_shapes: list | None = None  # what went forward and comes back as cotangents


class Stage:
    """One rank's stage of a segment-pipeline run (see the module doc): `Pipeline`
    (train/pipeline.py) is the run's `dist`."""

    def __init__(self, world: World, model, plan, stages, shapes, head_chunk: int, held: tuple):
        from mlxlab.models.runners import runner_for

        self.world, self.model, self.plan, self.stages = world, model, plan, stages
        self.shapes, self.head_chunk, self.held = shapes, head_chunk, held
        self.runner = runner_for(model)
        self.k, self.n = world.rank, world.size
        self.first_seg, self.last_seg = stages[self.k]
        self.layer_stage = {
            i: r
            for r, (a, b) in enumerate(stages)
            for s in range(a, b + 1)
            for i in plan.segments[s]
        }
        self.has_pli = bool(getattr(self.runner.inner, "hidden_size_per_layer_input", 0))
        self.objective = None
        self.seg = None
        self.window_wait = self.window_wall = 0.0  # since the last log record
        self.window_steps = 0
        self.window_bytes = world.bytes_sent
        self.run_wait = self.run_wall = 0.0  # over the run

    # --- building a stage --------------------------------------------------------------------

    @classmethod
    def build(
        cls,
        world: World,
        model,
        cfg,
        lengths: list[tuple[int, int]] = (),
        start: dict | None = None,
    ) -> Stage:
        """Place the segments, then drop (never read) every array this rank does not hold.
        `lengths` ((tokens, trained) of the training rows) weighs segments and the loss head by
        their FLOPs; without it (or a FLOP count for the family) segments count by layers.
        `start`: the adapter the run starts from (lora.init), DPO's reference."""
        from mlxlab.models.runners import runner_for
        from mlxlab.train.backward import plan_by_size
        from mlxlab.train.flops import model_shapes

        if cfg.backward.plan != "size":
            raise UserError(
                "backward.pipeline takes backward.plan=size (plan=auto measures layers on one "
                "process, which a pipeline stage cannot hold)"
            )
        runner = runner_for(model)
        plan = plan_by_size(len(runner.layers), cfg.backward.segment_size)
        try:
            shapes = model_shapes(model)  # the whole model's, for the FLOP count
        except (UserError, AttributeError):
            shapes = None
        if shapes is not None and lengths:
            costs, head = segment_costs(
                shapes,
                plan,
                sum(n for n, _ in lengths) / len(lengths),
                sum(t for _, t in lengths) / len(lengths),
                cfg.backward.head_chunk,
            )
            stages = assign_stages(costs, world.size, tail=head)
        else:
            stages = assign_stages([len(s) for s in plan.segments], world.size)
        from mlxlab.train.objectives import PairObjective

        self = cls(world, model, plan, stages, shapes, cfg.backward.head_chunk, (0, 0))
        self._use(PairObjective.from_config(cfg, start))
        self.held = self._drop_others()
        if cfg.grad_accum == 1:
            log.warning(
                "warning: backward.pipeline with grad_accum=1: one micro-batch per step, so the "
                "ranks take turns; grad_accum=4 or more keeps them busy (batch_size is per "
                "micro-batch)"
            )
        return self

    def _keeps(self, name: str) -> bool:
        """Does this rank hold parameter `name`?"""
        m = _LAYER.search(name)
        if m:
            return self.layer_stage[int(m.group(1))] == self.k
        first, last = self.k == 0, self.k == self.n - 1
        tied = not (
            "lm_head" in self.model and not getattr(self.model, "tie_word_embeddings", False)
        )
        if name.startswith("lm_head."):
            return last
        if ".embed_tokens." in f".{name}":
            return first or (last and tied)
        if name.startswith("model.norm.") or not name.startswith("model."):
            return True  # the final norm (small) and anything outside the inner model
        return first  # embedding-side extras (Gemma 4's per-layer inputs)

    def _owner(self, name: str) -> int | None:
        m = _LAYER.search(name)
        return self.layer_stage[int(m.group(1))] if m else None

    def _drop_others(self) -> tuple[int, int]:
        """Replace the arrays this rank does not hold with empty ones, then read the rest;
        (bytes held, bytes of the whole model)."""
        flat = tree_flatten(self.model.parameters())
        total = sum(v.nbytes for _, v in flat)
        drop = [(k, mx.zeros((0,), v.dtype)) for k, v in flat if not self._keeps(k)]
        self.model.update(tree_unflatten(drop))
        mx.eval(self.model.parameters())
        mx.clear_cache()
        held = sum(v.nbytes for _, v in tree_flatten(self.model.parameters()))
        return held, total

    def describe(self) -> str:
        parts = []
        for r, (a, b) in enumerate(self.stages):
            layers = [i for s in range(a, b + 1) for i in self.plan.segments[s]]
            parts.append(f"rank {r} segments {a}-{b} (layers {layers[0]}-{layers[-1]})")
        held, total = self.held
        return (
            f"segment pipeline over {self.n} ranks: {', '.join(parts)}; segments of "
            f"{len(self.plan.segments[0])} layers; rank {self.k} holds {held / 1e9:.3f} of "
            f"{total / 1e9:.3f} GB of weights; 1F1B over each step's micro-batches (grad_accum)"
        )

    def _use(self, objective) -> None:
        """The objective (None: SFT) whose head the last segment runs."""
        from mlxlab.train.backward import Segments

        self.objective = objective
        self.seg = Segments(self.model, self.plan, self.head_chunk, objective)
        self._streams()

    def grad_fn(self):
        """A GradFn of one micro-batch (a one-micro-batch pipeline step); the trainer hands a
        step's micro-batches to `grads` instead."""
        return lambda model, batch: self.run([batch])[0]

    def _streams(self) -> None:
        """What crosses each cut: K/V streams of donors whose sharers sit on later ranks, and
        (Gemma 4) the per-layer inputs of later ranks' layers."""
        seg = self.seg
        self.fwd_streams = []
        self.pli_layers = []
        for r in range(self.n - 1):
            end = self.stages[r][1]
            self.fwd_streams.append(
                sorted({d for j, d in seg.donors.items() if seg.seg_of[d] <= end < seg.seg_of[j]})
            )
            later = sorted(i for i, st in self.layer_stage.items() if st > r)
            self.pli_layers.append(later if self.has_pli else [])

    # --- one step ----------------------------------------------------------------------------

    def _segments(self):
        return range(self.first_seg, self.last_seg + 1)

    def _bases(self, micro: int) -> list[int]:
        """The micro-batches' dropout seeds, drawn as one process running the segmented backward
        draws them (each draw follows segment 0's vjp and its dropout draws)."""
        draws = (
            sum(
                1
                for i in self.plan.segments[0]
                for _, m in self.model.layers[i].named_modules()
                if isinstance(m, nn.Dropout) and getattr(m, "_p_1", 1.0) < 1.0
            )
            if self.model.training
            else 0
        )
        bases = []
        for _ in range(micro):
            base = int(mx.random.randint(0, 2**30, ()).item())
            bases.append(base)
            mx.random.seed(base)
            for _ in range(draws):
                mx.random.uniform(shape=(1,))
        return bases

    def run(self, batches) -> list[tuple]:
        """(loss, ntoks, gradients, *metrics) of each micro-batch; loss and metrics are real on
        the last rank only (`reduce` brings them to the others)."""
        from mlxlab.train.backward import _grad_tree

        t0 = time.perf_counter()
        waited = 0.0
        if self.objective is not None and self.objective.needs_reference:
            batches = [
                b if b.ref is not None else dataclasses.replace(b, ref=self._reference(b))
                for b in batches
            ]
        bases = self._bases(len(batches))
        micro = [_Micro(base, b.arrays()) for base, b in zip(bases, batches, strict=True)]
        for op, m in schedule(self.k, self.n, len(batches)):
            st = micro[m]
            if op in ("recv_f", "send_f", "recv_b", "send_b"):
                t = time.perf_counter()
                getattr(self, "_" + op)(st, m)
                waited += time.perf_counter() - t
            elif op == "F":
                self._forward(st)
            else:
                self._backward(st)
        out = []
        for st in micro:
            grads = _grad_tree(self.model, st.grads)
            if st.outs is not None:
                out.append((*st.outs[:2], grads, *st.outs[2:]))
            else:
                aux = [] if self.objective is None else [mx.zeros((len(self.objective.metrics),))]
                out.append((mx.array(0.0), mx.array(0.0), grads, *aux))
        wall = time.perf_counter() - t0
        self.window_wait += waited
        self.window_wall += wall
        self.window_steps += 1
        self.run_wait += waited
        self.run_wall += wall
        return out

    def _head(self, st):
        _, positions, labels, weights, _, ref = self.seg.unpack(st.arrays)
        return positions, labels, weights, ref

    def _forward(self, st: _Micro) -> None:
        seg, runner = self.seg, self.runner
        inputs, _, _, _, segments, _ = seg.unpack(st.arrays)
        if self.k == 0:
            h, st.ctx = runner.embed(inputs, segments)
            h = mx.stop_gradient(h)
        else:
            h, st.kv, pli = st.received
            st.ctx = runner.context(h, segments)
            for i, x in pli.items():
                st.ctx.per_layer_inputs[i] = x
            st.received = None
        mx.eval(h, [m for m in st.ctx.masks if isinstance(m, mx.array)])
        st.bounds[self.first_seg] = h
        for s in self._segments():
            if s == seg.last:  # runs once, inside its vjp with the head
                break
            h, kv_out = seg.forward(s, st.base, h, st.ctx, st.kv)
            st.bounds[s + 1] = h
            st.kv.update(kv_out)
        if self.k == self.n - 1:
            self._backward(st)  # the last rank's F is forward and backward
        else:  # (Gemma 4) later layers' per-layer inputs: computed here, not inside the send
            mx.eval([st.ctx.per_layer_inputs[i] for i in self.pli_layers[self.k]])

    def _backward(self, st: _Micro) -> None:
        if self.k == self.n - 1 and st.outs is not None:
            return  # (done in its F)
        seg = self.seg
        dh = None
        if self.k < self.n - 1:
            dh, *flat = st.cotangents
            st.dkv = {
                d: [flat[2 * i], flat[2 * i + 1]] for i, d in enumerate(self.fwd_streams[self.k])
            }
            st.cotangents = None
        for s in reversed(self._segments()):
            out, dh, grads = seg.backward(
                s, st.base, st.ctx, st.bounds[s], st.kv, dh, st.dkv, self._head(st)
            )
            if out is not None:
                st.outs = list(out)
            st.grads.update(grads)
        st.d_in = dh
        st.bounds, st.ctx = {}, None  # free this micro-batch's activations

    # transfers: the forward message is (h, K/V of fwd_streams, per-layer inputs of later
    # layers), preceded by its header; the backward one is (dh, dK/dV of the same streams).

    def _send_f(self, st: _Micro, m: int) -> None:
        h = st.bounds[self.last_seg + 1]
        arrays = [h] + [x for d in self.fwd_streams[self.k] for x in st.kv[d]]
        arrays += [st.ctx.per_layer_inputs[i] for i in self.pli_layers[self.k]]
        what = f"sending micro-batch {m}'s boundary to rank {self.k + 1}"
        self.world.send(encode(arrays), self.k + 1, what)
        for a in arrays:
            self.world.send(a, self.k + 1, what)
        st.sent_shapes = [
            (a.shape, a.dtype) for a in arrays[: 1 + 2 * len(self.fwd_streams[self.k])]
        ]
        del st.bounds[self.last_seg + 1]

    def _recv_f(self, st: _Micro, m: int) -> None:
        src = self.k - 1
        streams, pli = self.fwd_streams[src], self.pli_layers[src]
        count = 1 + 2 * len(streams) + len(pli)
        what = f"waiting for micro-batch {m}'s boundary from rank {src}"
        shapes = decode(self.world.recv((count * HEADER,), mx.int64, src, what))
        got = [self.world.recv(shape, dtype, src, what) for shape, dtype in shapes]
        h = got[0]
        kv = {d: (got[1 + 2 * i], got[2 + 2 * i]) for i, d in enumerate(streams)}
        rest = dict(zip(pli, got[1 + 2 * len(streams) :], strict=True))
        st.received = [h, kv, rest]

    def _send_b(self, st: _Micro, m: int) -> None:
        arrays = [st.d_in] + [x for d in self.fwd_streams[self.k - 1] for x in st.dkv[d]]
        what = f"sending micro-batch {m}'s cotangents to rank {self.k - 1}"
        for a in arrays:
            self.world.send(a, self.k - 1, what)
        st.d_in, st.dkv = None, {}

    def _recv_b(self, st: _Micro, m: int) -> None:
        what = f"waiting for micro-batch {m}'s cotangents from rank {self.k + 1}"
        st.cotangents = [
            self.world.recv(shape, dtype, self.k + 1, what) for shape, dtype in st.sent_shapes
        ]

    # --- forward only: validation and DPO's reference ----------------------------------------

    def _forward_only(self, arrays, head, out_shapes, what: str) -> list[mx.array]:
        """The batch through every rank's layers (no dropout draws, no graph), `head(h_normed)`
        on the last rank; its arrays (`out_shapes`) on every rank."""
        seg, runner = self.seg, self.runner
        inputs, _, _, _, segments, _ = seg.unpack(arrays)
        st = _Micro(0, arrays)
        if self.k == 0:
            h, st.ctx = runner.embed(inputs, segments)
        else:
            self._recv_f(st, 0)
            h, st.kv, pli = st.received
            st.ctx = runner.context(h, segments)
            for i, x in pli.items():
                st.ctx.per_layer_inputs[i] = x
        for s in self._segments():
            h, kv_out = seg.run_segment(s, h, st.ctx, {d: st.kv[d] for d in seg.incoming[s]})
            st.kv.update(kv_out)
            mx.eval(h, kv_out)
        if self.k < self.n - 1:
            st.bounds[self.last_seg + 1] = h
            self._send_f(st, 0)
            outs = [mx.zeros(shape, dtype) for shape, dtype in out_shapes]
        else:
            outs = [mx.stop_gradient(x) for x in head(runner.norm(h))]
            mx.eval(outs)
        return self.world.broadcast_arrays(outs, what, root=self.n - 1)

    def val_loss(self, loss_fn):
        """Validation's loss through the pipeline: what `response_ce` / the objective's `loss`
        compute in one process (`loss_fn` is that function; its head runs on the last rank)."""
        from mlxlab.train.losses import head_ce

        def pipelined(model, *arrays):
            _, positions, labels, weights, _, ref = self.seg.unpack(arrays)

            def head(h):
                if self.objective is None:
                    return head_ce(model, h, positions, labels, weights)[:1]
                return self.objective.head(model, h, positions, labels, weights, ref)[:1]

            return self._forward_only(arrays, head, [((), mx.float32)], "validating")

        return pipelined

    def _reference(self, batch) -> mx.array:
        """DPO's reference log-probs of a batch's rows (adapters off, or the starting adapter
        swapped in; eval mode), as objectives.reference_logps computes them in one process."""
        from mlxlab.train.objectives import adapter_swapped, adapters_off, row_logps

        model = self.model
        start = self.objective.start if self.objective is not None else None
        was_training = model.training
        model.eval()
        try:
            with adapters_off(model) if start is None else adapter_swapped(model, start):
                out = self._forward_only(
                    batch.arrays(),
                    lambda h: [
                        row_logps(model, h, batch.positions, batch.labels, batch.weights)[0]
                    ],
                    [((batch.inputs.shape[0],), mx.float32)],
                    "computing reference log-probs",
                )
        finally:
            model.train(was_training)
        return out[0]

    def precompute_reference(
        self, model, sampler, path, model_name: str = "", start: dict | None = None
    ) -> None:
        """objectives.precompute_reference through the pipeline: every rank runs each batch's
        forward, rank 0 reads and writes the file."""
        from mlxlab.train.objectives import precompute_reference

        precompute_reference(
            model,
            sampler,
            path,
            model_name,
            start,
            world=self.world,
            reference=lambda _model, batch: self._reference(batch),
        )
