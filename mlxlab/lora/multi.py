"""Several LoRA adapters on one model at once, chosen per forward pass or per batch row.

Every projection any attached adapter targets is wrapped once in a `MultiLoRA` that holds the
base linear and one (A, B, scale) slot per adapter (a DoRA adapter's slot adds its magnitude
factor m / ||W + scale (A B)^T||, fixed while the base is frozen). Which slots apply is one shared `Selection`
set before a forward pass: a spec for the whole batch (`()`, `("a",)`, or stacked `("a", "b")`:
the deltas summed in that order, each with its own scale), or one spec per batch row. With
nothing selected a wrapper returns `base(x)` itself, so an attached-but-unused adapter leaves base
outputs byte-identical; one selected adapter computes exactly what mlx-lm's `LoRALinear` (or
`DoRALinear`) computes. A DoRA adapter rescales the whole output, so it is not a delta that
stacks: it is selected alone (per batch or per row: its rows take its output, `mx.where`).
A full fine-tune replaces weights and is served fused instead (`lora fuse`).
Wrappers whose last adapter is detached are replaced by their base linear again.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from mlxlab.lora.apply import layers_prefix


class Selection:
    """The adapters the current forward pass uses (shared by every wrapper).

    Either one spec for the whole batch (`ids`), or one per batch row (`set_rows`, the batched
    lane): then each wrapper adds, for stack position k and each adapter at that position, that
    adapter's delta times a 0/1 row mask. A row gets its own adapters' deltas in its own order and
    `+ 0 * delta` elsewhere, which leaves a row's values exactly what its spec alone computes.
    """

    def __init__(self):
        self.ids: tuple[str, ...] = ()
        self.masked: list[tuple[str, mx.array]] | None = None

    def set_rows(self, rows: list[tuple[str, ...]]) -> None:
        if len(set(rows)) <= 1:  # one spec for every row: the plain path, no masks
            self.ids, self.masked = (rows[0] if rows else ()), None
            return
        self.ids, self.masked = (), []
        for k in range(max(len(r) for r in rows)):
            names = dict.fromkeys(r[k] for r in rows if len(r) > k)
            for name in names:
                mask = [1.0 if len(r) > k and r[k] == name else 0.0 for r in rows]
                self.masked.append((name, mx.array(mask)[:, None, None]))

    def clear(self) -> None:
        self.ids, self.masked = (), None


class MultiLoRA(nn.Module):
    def __init__(self, linear: nn.Module, selection: Selection):
        super().__init__()
        self.linear = linear
        self._selection = selection
        object.__setattr__(self, "_slots", {})  # a plain attribute: not parameters of the model

    def __call__(self, x):
        y = self.linear(x)
        sel = self._selection
        for name, mask in [(name, None) for name in sel.ids] + (sel.masked or []):
            slot = self._slots.get(name)
            if slot is None:
                continue
            if len(slot) == 4:  # DoRA: its own output, on its rows
                out = self._dora(x, *slot)
                y = out if mask is None else mx.where(mask > 0, out, y)
                continue
            a, b, scale = slot
            delta = scale * ((x @ a) @ b)
            y = y + (delta if mask is None else mask * delta).astype(x.dtype)
        return y

    def _dora(self, x, a, b, scale, factor):
        """mlx-lm DoRALinear.__call__ (dropout off), its norm factor precomputed."""
        base = self.linear
        w = base.weight
        if isinstance(base, nn.QuantizedLinear):
            w = mx.dequantize(
                w,
                base.scales,
                base.biases,
                group_size=base.group_size,
                bits=base.bits,
                mode=base.mode,
            )
        out = x @ w.T + (scale * ((x @ a) @ b)).astype(x.dtype)
        out = factor.astype(x.dtype) * out
        return out + base.bias if "bias" in base else out


def attach(model, name: str, plan, weights: dict, selection: Selection) -> list[str]:
    """Give every projection `plan` targets a slot `name` holding its (A, B, scale), wrapping it
    in a `MultiLoRA` the first time; `plan`/`weights` come from `lora.io.read_plan` (checked).
    Returns the module paths that got a slot."""
    if plan.kind == "full":
        from mlxlab.errors import UserError

        raise UserError(
            f"adapter {name!r} is a full fine-tune (its own weights, not an adapter): serve it "
            "fused (python -m mlxlab lora fuse adapter=... out=DIR, then model=DIR)"
        )
    prefix = layers_prefix(model)
    modules, new_arrays = [], []
    for i in plan.layers:
        layer = model.layers[i]
        present = dict(layer.named_modules())
        wraps = []
        for key in plan.keys:
            a = weights.get(f"{prefix}.{i}.{key}.lora_a")
            b = weights.get(f"{prefix}.{i}.{key}.lora_b")
            module = present.get(key)
            if module is None or a is None or b is None:
                continue
            if not isinstance(module, MultiLoRA):
                module = MultiLoRA(module, selection)
                wraps.append((key, module))
            dtype = module.linear.weight.dtype
            if dtype not in (mx.float32, mx.float16, mx.bfloat16):
                dtype = mx.float32  # quantized base weights: the deltas stay in float
            slot = (a.astype(dtype), b.astype(dtype), plan.scale)
            if plan.kind == "dora":
                m = weights.get(f"{prefix}.{i}.{key}.m")
                slot += (_dora_factor(module.linear, slot[0], slot[1], plan.scale, m),)
            module._slots[name] = slot
            new_arrays += [v for v in slot if isinstance(v, mx.array)]
            modules.append(f"{prefix}.{i}.{key}")
        if wraps:
            layer.update_modules(tree_unflatten(wraps))
    mx.eval(new_arrays)
    return modules


def _dora_factor(linear, a, b, scale, m):
    """m / ||W + scale (A B)^T|| per output row, as DoRALinear computes it in each call."""
    w = linear.weight
    if isinstance(linear, nn.QuantizedLinear):
        w = mx.dequantize(
            w,
            linear.scales,
            linear.biases,
            group_size=linear.group_size,
            bits=linear.bits,
            mode=linear.mode,
        )
    adapted = w + (scale * b.T) @ a.T
    return m.astype(a.dtype) / mx.linalg.norm(adapted, axis=1)


def detach(model, name: str) -> None:
    """Drop slot `name` everywhere; wrappers left without slots give back their base linear."""
    for layer in model.layers:
        restore = []
        for path, module in layer.named_modules():
            if isinstance(module, MultiLoRA):
                module._slots.pop(name, None)
                if not module._slots:
                    restore.append((path, module.linear))
        if restore:
            layer.update_modules(tree_unflatten(restore))
