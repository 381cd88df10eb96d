"""Backward modes: full, per-layer checkpointed, and segmented.

Segmented backward: run the forward in layer segments and keep only each segment's output (a
boundary, evaluated, so nothing of its graph survives); then walk the segments backwards, one
`mx.vjp` per segment with the boundary and the segment's LoRA parameters as primals. The last
segment is differentiated together with the loss head and is not run in the first pass, so it
costs one forward, not two. Only one segment's activations are alive at a time. Gemma 4's KV-shared layers attend with a donor layer's K/V: when a cut falls
between donor and sharer, the donor's K/V cross it as a second boundary stream, and the
cotangents from every sharer are summed before the donor's segment is differentiated.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map_with_path, tree_unflatten

from mlxlab.errors import UserError
from mlxlab.models.runners import Runner, runner_for
from mlxlab.train.losses import head_ce

log = logging.getLogger(__name__)

MODES = ("full", "checkpoint", "segmented")


def head_loss(runner: Runner, h, positions, labels, weights, chunk: int = 0):
    """Final norm + response-only CE from the last hidden state (pre-norm)."""
    return head_ce(runner.model, runner.norm(h), positions, labels, weights, chunk)


# --- plans ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    segments: tuple[tuple[int, ...], ...]  # consecutive layer indices, covering every layer

    def describe(self, runner: Runner) -> str:
        parts = []
        for seg in self.segments:
            marks = "".join("G" if runner.is_global(i) else "s" for i in seg)
            parts.append(f"[{seg[0]}-{seg[-1]}:{marks}]" if len(seg) > 1 else f"[{seg[0]}:{marks}]")
        return f"{len(self.segments)} segments " + " ".join(parts) + "  (G global, s sliding)"


def plan_by_size(num_layers: int, size: int) -> Plan:
    if size < 1:
        raise UserError(f"segment_size must be >= 1, got {size}")
    return Plan(
        tuple(tuple(range(i, min(i + size, num_layers))) for i in range(0, num_layers, size))
    )


def plan_auto(runner: Runner, layer_cost: dict[str, float], budget: float) -> Plan:
    """Greedy packing under `budget` bytes of activations per segment.

    Global (full-attention, O(L^2)) layers go into segments of their own; runs of sliding layers
    are packed while their summed measured cost stays within the budget.
    """
    segments, current, used = [], [], 0.0
    for i in range(len(runner.layers)):
        kind = "global" if runner.is_global(i) else "sliding"
        cost = layer_cost[kind]
        if kind == "global":
            if current:
                segments.append(tuple(current))
            segments.append((i,))
            current, used = [], 0.0
            continue
        if current and used + cost > budget:
            segments.append(tuple(current))
            current, used = [], 0.0
        current.append(i)
        used += cost
    if current:
        segments.append(tuple(current))
    return Plan(tuple(segments))


def measure_layer_costs(model, inputs: mx.array) -> dict[str, float]:
    """Peak activation bytes of one layer's vjp, for a sliding and a global layer, at `inputs`."""
    runner = runner_for(model)
    h, ctx = runner.embed(inputs)
    mx.eval(h)
    costs = {}
    for kind in ("sliding", "global"):
        idx = next(
            (
                i
                for i in range(len(runner.layers))
                if runner.is_global(i) == (kind == "global") and i not in runner.kv_donors()
            ),
            None,
        )
        if idx is None:
            continue
        mx.synchronize()
        mx.clear_cache()
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        out, grads = mx.vjp(lambda x, idx=idx: runner.layer(idx, x, ctx)[0], [h], [mx.ones_like(h)])
        mx.eval(out, grads)
        costs[kind] = float(mx.get_peak_memory() - base)
        del out, grads
    costs.setdefault("global", costs.get("sliding", 0.0))
    costs.setdefault("sliding", costs["global"])
    return costs


def make_plan(model, cfg, batch_shape: tuple[int, int]) -> Plan:
    """The segment plan for BackwardConfig `cfg`; `auto` measures layer costs at `batch_shape`."""
    runner = runner_for(model)
    n = len(runner.layers)
    if cfg.plan == "size":
        return plan_by_size(n, cfg.segment_size)
    inputs = mx.zeros(batch_shape, mx.int32)
    costs = measure_layer_costs(model, inputs)
    mx.clear_cache()
    budget = cfg.memory_target_gb * 1e9 - mx.get_active_memory()
    if budget < costs["sliding"]:
        log.warning(
            f"warning: memory_target_gb={cfg.memory_target_gb} leaves {budget / 1e9:.2f} GB "
            f"for activations, less than one layer needs ({costs['sliding'] / 1e9:.2f} GB); "
            "using one layer per segment"
        )
    return plan_auto(runner, costs, budget)


def make_grad_fn(model, cfg, batch_shape: tuple[int, int], compile: bool = True, objective=None):
    """(GradFn, description) for BackwardConfig `cfg`. `objective` (train/objectives.py
    PairObjective, train/grpo GRPOObjective; None: SFT) makes every mode differentiate that
    loss instead, its GradFn
    returning the objective's metrics as a fourth value; a DPO batch without reference
    log-probs gets them computed first (adapters off, or the objective's starting adapter)."""
    import functools

    from mlxlab.train.losses import response_ce
    from mlxlab.train.trainer import full_backward

    chunk = cfg.head_chunk
    head = f", loss head in chunks of {chunk} positions" if chunk else ""
    if objective is not None:
        head += ", " + getattr(objective, "description", f"{objective.kind} on pairs")
    if cfg.mode == "full":
        if objective is not None:
            loss_fn = functools.partial(objective.loss, head_chunk=chunk)
        else:
            loss_fn = functools.partial(response_ce, head_chunk=chunk) if chunk else response_ce
        grad_fn, how = full_backward(model, loss_fn, compile=compile), "full backward" + head
    elif cfg.mode == "checkpoint":
        grad_fn = checkpointed_backward(model, chunk, objective)
        how = "per-layer checkpointed backward" + head
    else:
        plan = make_plan(model, cfg, batch_shape)
        grad_fn = segmented_backward(model, plan, head_chunk=chunk, objective=objective)
        how = "segmented backward: " + plan.describe(runner_for(model)) + head
    if objective is None or not objective.needs_reference:
        return grad_fn, how
    return with_reference(grad_fn, objective.start), how


def with_reference(grad_fn, start=None):
    """A GradFn that first fills a batch's missing reference log-probs (objectives.py; `start`:
    the adapter the run started from, else the base model)."""
    import dataclasses

    from mlxlab.train.objectives import reference_logps

    def wrapped(model, batch):
        if batch.ref is None:
            batch = dataclasses.replace(batch, ref=reference_logps(model, batch, start))
        return grad_fn(model, batch)

    return wrapped


# --- gradient functions -----------------------------------------------------------------------


def _layer_params(model, layer_ids) -> list[tuple[str, mx.array]]:
    """(full name, array) of the trainable parameters of the given layers, in order."""
    out = []
    for i in layer_ids:
        out += [(f"{i}.{k}", v) for k, v in tree_flatten(model.layers[i].trainable_parameters())]
    return out


def _set_layer_params(model, named: list[tuple[str, mx.array]]) -> None:
    by_layer: dict[int, list] = {}
    for name, value in named:
        i, key = name.split(".", 1)
        by_layer.setdefault(int(i), []).append((key, value))
    for i, items in by_layer.items():
        model.layers[i].update(tree_unflatten(items))


def _grad_tree(model, flat: dict[str, mx.array]):
    """Gradients by `<layer>.<key>` -> the tree of model.trainable_parameters()."""
    prefix = "layers."

    def pick(path, value):
        after = path.split(prefix, 1)[1] if prefix in path else None
        grad = flat.get(after) if after is not None else None
        return grad if grad is not None else mx.zeros_like(value)

    return tree_map_with_path(pick, model.trainable_parameters())


class Segments:
    """The segmented backward's steps, one segment at a time: `segmented_backward` runs them all
    in one process, the segment pipeline (train/pipeline_stage.py) runs each rank's on that rank, so
    both compute the same numbers. `objective` (a PairObjective) puts its pair head on the last
    segment instead of the SFT loss."""

    def __init__(self, model, plan: Plan, head_chunk: int = 0, objective=None):
        self.model, self.plan, self.head_chunk, self.objective = model, plan, head_chunk, objective
        self.runner = runner = runner_for(model)
        self.donors = donors = runner.kv_donors()  # sharer -> donor
        self.seg_of = seg_of = {i: s for s, seg in enumerate(plan.segments) for i in seg}
        # K/V streams that cross cuts: donors whose sharers sit in a later segment.
        crossing = sorted({d for j, d in donors.items() if seg_of[d] < seg_of[j]})
        self.outgoing = [[d for d in crossing if seg_of[d] == s] for s in range(len(plan.segments))]
        self.incoming = [
            sorted({donors[j] for j in seg if j in donors and seg_of[donors[j]] < s})
            for s, seg in enumerate(plan.segments)
        ]
        self.last = len(plan.segments) - 1

    def run_segment(self, s, h, ctx, kv_in: dict):
        kvs = dict(kv_in)
        for i in self.plan.segments[s]:
            d = self.donors.get(i)
            h, kv = self.runner.layer(i, h, ctx, kvs.get(d) if d is not None else None)
            if kv is not None:
                kvs[i] = kv
        return h, {d: kvs[d] for d in self.outgoing[s]}

    def unpack(self, batch_arrays):
        """(inputs, positions, labels, weights, packed segments or None, reference or None)."""
        inputs, positions, labels, weights, *rest = batch_arrays
        segments = rest[0] if self.objective is None and rest else None
        ref = rest[0] if self.objective is not None and rest else None
        return inputs, positions, labels, weights, segments, ref

    def forward(self, s, base, h, ctx, kv_store: dict):
        """Segment s's first pass (s < last): its output boundary, evaluated (no graph), and the
        K/V streams it starts."""
        mx.random.seed(base + s)
        h, kv_out = self.run_segment(s, h, ctx, {d: kv_store[d] for d in self.incoming[s]})
        mx.eval(h, kv_out)  # evaluated boundaries hold no graph
        return h, kv_out

    def backward(self, s, base, ctx, h_in, kv_store: dict, dh, dkv: dict, head: tuple):
        """One segment's vjp: recompute it from its input boundary `h_in` (with the head, for the
        last), given the cotangents of its output (`dh`, and in `dkv` those of the K/V streams it
        starts, summed over their sharers). Adds the cotangents of the streams it reads into
        `dkv` (in place) and returns (outputs, cotangent of h_in, {layer.key: gradient});
        outputs are (loss, ntoks, *metrics) for the last segment, else None."""
        model, runner, objective = self.model, self.runner, self.objective
        named = _layer_params(model, self.plan.segments[s])
        names = [n for n, _ in named]
        incoming = self.incoming[s]
        kv_in = [x for d in incoming for x in kv_store[d]]
        n_kv = len(kv_in)
        positions, labels, weights, ref = head

        def fn(*primals):
            h, kv_flat, params = primals[0], primals[1 : 1 + n_kv], primals[1 + n_kv :]
            _set_layer_params(model, list(zip(names, params, strict=True)))
            kv = {d: (kv_flat[2 * k], kv_flat[2 * k + 1]) for k, d in enumerate(incoming)}
            h_out, kv_out = self.run_segment(s, h, ctx, kv)
            if s == self.last:
                if objective is not None:
                    return list(
                        objective.head(
                            model,
                            runner.norm(h_out),
                            positions,
                            labels,
                            weights,
                            ref,
                            self.head_chunk,
                        )
                    )
                return list(head_loss(runner, h_out, positions, labels, weights, self.head_chunk))
            return [h_out] + [x for d in self.outgoing[s] for x in kv_out[d]]

        if s == self.last:
            cot = [mx.array(1.0), mx.array(0.0)]
            if objective is not None:
                cot.append(mx.zeros((len(objective.metrics),), mx.float32))
        else:
            cot = [dh]
            for d in self.outgoing[s]:
                k, v = kv_store[d]
                cot += dkv.get(d) or [mx.zeros_like(k), mx.zeros_like(v)]
        mx.random.seed(base + s)
        outs, vjps = mx.vjp(fn, [h_in, *kv_in, *(v for _, v in named)], cot)
        _set_layer_params(model, named)  # put the original arrays back
        d_h_in = vjps[0]
        for k, d in enumerate(incoming):
            add = [vjps[1 + 2 * k], vjps[2 + 2 * k]]
            dkv[d] = [a + b for a, b in zip(dkv[d], add, strict=True)] if d in dkv else add
        grads = dict(zip(names, vjps[1 + n_kv :], strict=True))
        outs = outs if s == self.last else None
        mx.eval(outs, d_h_in, list(grads.values()), list(dkv.values()))
        return outs, d_h_in, grads


def segmented_backward(model, plan: Plan, timer=None, head_chunk: int = 0, objective=None):
    """GradFn computing the full backward's gradients one segment at a time.

    `timer(phase)`, if given, is called after each evaluated phase ("embed", "forward s",
    "backward s"): `diag profile` times the step by phase that way. `objective` (a
    PairObjective) differentiates its pair loss: both sides of every pair go through the
    segments together, as rows of the batch, and its metrics come back as a fourth value."""
    mark = timer or (lambda phase: None)
    seg = Segments(model, plan, head_chunk, objective)
    runner, last = seg.runner, seg.last

    def grad_fn(model_, batch):
        assert model_ is model, "segmented_backward was built for another model"
        inputs, positions, labels, weights, segments, ref = seg.unpack(batch.arrays())
        # Dropout: each segment draws from its own seed, so its recomputation inside the vjp
        # sees the same masks as its first run.
        base = int(mx.random.randint(0, 2**30, ()).item())
        h, ctx = runner.embed(inputs, segments)
        h = mx.stop_gradient(h)
        mx.eval(h, [m for m in ctx.masks if isinstance(m, mx.array)])
        mark("embed")
        bounds, kv_store = [h], {}
        for s in range(last):  # the last segment runs once, inside its vjp with the head
            h, kv_out = seg.forward(s, base, h, ctx, kv_store)
            mark(f"forward {s}")
            bounds.append(h)
            kv_store.update(kv_out)

        dkv: dict[int, list] = {}
        grads: dict[str, mx.array] = {}
        dh = outs = None
        for s in reversed(range(last + 1)):
            out, dh, g = seg.backward(
                s, base, ctx, bounds[s], kv_store, dh, dkv, (positions, labels, weights, ref)
            )
            outs = out if out is not None else outs
            grads.update(g)
            mark(f"backward {s}")
        loss, ntoks, *aux = outs
        return (loss, ntoks, _grad_tree(model, grads), *aux)

    return grad_fn


def checkpointed_backward(model, head_chunk: int = 0, objective=None):
    """GradFn with each layer wrapped in mx.checkpoint (recomputed in the backward).

    Like `mlx_lm.lora --grad-checkpoint`, but by wrapping the call, not patching the class.
    `objective` (a PairObjective): its pair loss, metrics as a fourth value.
    """
    runner = runner_for(model)
    donors = runner.kv_donors()

    def loss_fn(params, inputs, positions, labels, weights, *rest):
        segments = rest[0] if objective is None and rest else None
        ref = rest[0] if objective is not None and rest else None
        model.update(params)
        base = int(mx.random.randint(0, 2**30, ()).item())
        h, ctx = runner.embed(inputs, segments)
        h = mx.stop_gradient(h)
        kvs = {}
        for i, layer in enumerate(runner.layers):
            shared = kvs.get(donors[i]) if i in donors else None

            keeps_kv = i in set(donors.values())

            def body(p, x, *kv, i=i, layer=layer, keeps_kv=keeps_kv):
                mx.random.seed(base + i)  # the recomputation redraws the same dropout masks
                layer.update(p)
                out, kv_out = runner.layer(i, x, ctx, tuple(kv) if kv else None)
                return (out, *kv_out) if keeps_kv else out

            out = mx.checkpoint(body)(layer.trainable_parameters(), h, *(shared or ()))
            if keeps_kv:
                h, kvs[i] = out[0], (out[1], out[2])
            else:
                h = out
        if objective is not None:
            return objective.head(
                model, runner.norm(h), positions, labels, weights, ref, head_chunk
            )
        return head_loss(runner, h, positions, labels, weights, head_chunk)

    value_and_grad = mx.value_and_grad(loss_fn)

    def grad_fn(model_, batch):
        assert model_ is model, "checkpointed_backward was built for another model"
        params = model.trainable_parameters()
        (loss, ntoks, *aux), grads = value_and_grad(params, *batch.arrays())
        model.update(params)
        return (loss, ntoks, grads, *aux)

    return grad_fn
