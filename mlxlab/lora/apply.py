"""Attach, remove and fuse LoRA adapters on any mlx-lm model, using mlx-lm's own LoRA layers.

Targets are chosen by projection name, not by family: `q` matches any module named `q_proj`
inside a transformer layer, whatever the architecture calls the surrounding blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.tuner.lora import LoRALinear

from mlxlab.config import LoraConfig
from mlxlab.errors import UserError

SHORT_NAMES = {
    "q": "q_proj",
    "k": "k_proj",
    "v": "v_proj",
    "o": "o_proj",
    "gate": "gate_proj",
    "up": "up_proj",
    "down": "down_proj",
}
_LINEAR = (nn.Linear, nn.QuantizedLinear)


@dataclass(frozen=True)
class LoraPlan:
    """Which modules get adapters: layer indices and module paths relative to a layer."""

    layers: tuple[int, ...]
    keys: tuple[str, ...]  # e.g. ("self_attn.q_proj", "mlp.down_proj")
    rank: int
    scale: float
    dropout: float

    def module_paths(self, model) -> list[str]:
        """Full paths (`model.layers.3.self_attn.q_proj`) of every adapted module present."""
        prefix = layers_prefix(model)
        paths = []
        for i in self.layers:
            present = dict(model.layers[i].named_modules())
            paths += [f"{prefix}.{i}.{k}" for k in self.keys if k in present]
        return paths


def layers_prefix(model) -> str:
    """The parameter path of `model.layers` (`model.layers` for most mlx-lm models)."""
    first = model.layers[0]
    for name, module in model.named_modules():
        if module is first:
            return name.rsplit(".", 1)[0]
    raise UserError("cannot locate the transformer layers in this model")


def layer_keys(layer) -> dict[str, str]:
    """Module path -> leaf name for every linear (or already adapted) module in a layer."""
    return {
        path: path.rsplit(".", 1)[-1]
        for path, m in layer.named_modules()
        if isinstance(m, (*_LINEAR, LoRALinear))
    }


def plan(model, cfg: LoraConfig) -> LoraPlan:
    """Resolve targets and layers against `model`; every target must match somewhere."""
    n = len(model.layers)
    if cfg.layers == "all":
        layers = tuple(range(n))
    elif isinstance(cfg.layers, int):
        if not 1 <= cfg.layers <= n:
            raise UserError(f"lora.layers={cfg.layers}: the model has {n} layers")
        layers = tuple(range(n - cfg.layers, n))
    else:
        layers = tuple(sorted({int(i) for i in cfg.layers}))
        bad = [i for i in layers if not 0 <= i < n]
        if bad or not layers:
            raise UserError(f"lora.layers {list(cfg.layers)}: indices must be in 0..{n - 1}")
    available: dict[str, str] = {}
    for i in layers:
        available.update(layer_keys(model.layers[i]))
    keys, missing = [], []
    for target in cfg.targets:
        leaf = SHORT_NAMES.get(target)
        matched = [p for p, name in available.items() if (leaf and name == leaf) or p == target]
        if not matched:
            missing.append(target)
        keys += [k for k in matched if k not in keys]
    if missing:
        raise UserError(
            f"LoRA targets {missing} match no module in the chosen layers; "
            f"available: {', '.join(sorted(available))} (short names: {', '.join(SHORT_NAMES)})"
        )
    return LoraPlan(layers, tuple(sorted(keys)), cfg.rank, cfg.scale, cfg.dropout)


def apply(model, lora_plan: LoraPlan, seed: int | None = None) -> list[str]:
    """Replace the planned linears with mlx-lm LoRALinear layers; freeze everything else.

    Returns the adapted module paths. `seed` makes the A-matrix init reproducible.
    """
    if seed is not None:
        mx.random.seed(seed)
    training = model.training  # new modules start in training mode; keep the model's mode
    model.freeze()
    prefix = layers_prefix(model)
    for i in lora_plan.layers:
        layer = model.layers[i]
        present = dict(layer.named_modules())
        updates = []
        for key in lora_plan.keys:
            module = present.get(key)
            if module is None:
                continue  # e.g. Gemma 4 KV-shared layers have no k/v projections
            if isinstance(module, LoRALinear):
                raise UserError(f"{prefix}.{i}.{key} already has a LoRA adapter")
            updates.append(
                (
                    key,
                    LoRALinear.from_base(
                        module, r=lora_plan.rank, dropout=lora_plan.dropout, scale=lora_plan.scale
                    ),
                )
            )
        if updates:
            layer.update_modules(tree_unflatten(updates))
    model.train(training)
    mx.eval(model.trainable_parameters())
    return lora_plan.module_paths(model)


def lora_modules(model) -> list[tuple[str, LoRALinear]]:
    return [(p, m) for p, m in model.named_modules() if isinstance(m, LoRALinear)]


def adapter_parameters(model) -> dict[str, mx.array]:
    """The LoRA tensors (lora_a, lora_b) by full parameter name."""
    return {
        k: v
        for k, v in tree_flatten(model.parameters())
        if k.rsplit(".", 1)[-1] in ("lora_a", "lora_b")
    }


def remove(model) -> None:
    """Put the original linears back (the adapters are dropped)."""
    restore = [(p, m.linear) for p, m in lora_modules(model)]
    if restore:
        model.update_modules(tree_unflatten(restore))


def fuse(model) -> None:
    """Merge every adapter into its base weight (W + scale * (A B)^T), leaving plain linears."""
    fused = [(p, m.fuse(dequantize=False)) for p, m in lora_modules(model)]
    if fused:
        model.update_modules(tree_unflatten(fused))
