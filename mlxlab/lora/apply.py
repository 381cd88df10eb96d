"""Attach, remove and fuse adapters on any mlx-lm model, using mlx-lm's own layers.

Three kinds (`lora.type`): `lora` (mlx-lm's LoRALinear), `dora` (mlx-lm's DoRALinear: the
LoRA update plus a trained magnitude per output row, mlx_lm.tuner.dora) and `full` (the chosen
modules' own weights and biases trained, as mlx_lm.lora's `full` trains whole layers).

Targets are chosen by projection name, not by family: `q` matches any module named `q_proj`
inside a transformer layer, whatever the architecture calls the surrounding blocks; `all` is
every linear of the chosen layers (for `full`: every module with parameters, norms included,
what mlx_lm.lora --fine-tune-type full trains).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.tuner.dora import DoRALinear
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
_ADAPTED = (LoRALinear, DoRALinear)
KINDS = ("lora", "dora", "full")


@dataclass(frozen=True)
class LoraPlan:
    """Which modules get adapters: layer indices and module paths relative to a layer."""

    layers: tuple[int, ...]
    keys: tuple[str, ...]  # e.g. ("self_attn.q_proj", "mlp.down_proj")
    rank: int
    scale: float
    dropout: float
    kind: str = "lora"  # lora | dora | full (rank, scale and dropout unused)

    def module_paths(self, model) -> list[str]:
        """Full paths (`model.layers.3.self_attn.q_proj`) of every adapted module present."""
        prefix = layers_prefix(model)
        paths = []
        for i in self.layers:
            present = dict(model.layers[i].named_modules())
            paths += [f"{prefix}.{i}.{k}".rstrip(".") for k in self.keys if k in present]
        return paths


def layers_prefix(model) -> str:
    """The parameter path of `model.layers` (`model.layers` for most mlx-lm models)."""
    first = model.layers[0]
    for name, module in model.named_modules():
        if module is first:
            return name.rsplit(".", 1)[0]
    raise UserError("cannot locate the transformer layers in this model")


def layer_keys(layer, kind: str = "lora") -> dict[str, str]:
    """Module path -> leaf name for every linear (or already adapted) module in a layer; for
    `full`, every module holding parameters of its own (norms too)."""
    if kind == "full":  # "" is the layer itself, where it holds arrays (Gemma 4's scalar)
        return {
            path: path.rsplit(".", 1)[-1]
            for path, m in layer.named_modules()
            if not isinstance(m, _ADAPTED) and _own_params(m)
        }
    return {
        path: path.rsplit(".", 1)[-1]
        for path, m in layer.named_modules()
        if isinstance(m, (*_LINEAR, *_ADAPTED))
    }


def _own_params(module) -> list[str]:
    """Names of the parameters a module holds itself (not in its submodules; `_`-names are not
    parameters in MLX, e.g. a RoPE's `_freqs`)."""
    return [k for k, v in module.items() if isinstance(v, mx.array) and not k.startswith("_")]


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
    kind = cfg.type
    available: dict[str, str] = {}
    for i in layers:
        available.update(layer_keys(model.layers[i], kind))
    keys, missing = [], []
    for target in cfg.targets:
        leaf = SHORT_NAMES.get(target)
        matched = [
            p
            for p, name in available.items()
            if target == "all" or (leaf and name == leaf) or p == target
        ]
        if not matched:
            missing.append(target)
        keys += [k for k in matched if k not in keys]
    if missing:
        raise UserError(
            f"LoRA targets {missing} match no module in the chosen layers; "
            f"available: {', '.join(sorted(available))} (short names: "
            f"{', '.join(SHORT_NAMES)}, all)"
        )
    if kind == "full":
        quantized = sorted(
            {
                k
                for i in layers
                for k, m in model.layers[i].named_modules()
                if k in keys and isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
            }
        )
        if quantized:
            raise UserError(
                f"lora.type=full on quantized modules ({', '.join(quantized)}): their packed "
                "weights cannot be trained; use lora.type=lora or dora on a quantized base, "
                "or full fine-tuning on a float model"
            )
    return LoraPlan(layers, tuple(sorted(keys)), cfg.rank, cfg.scale, cfg.dropout, kind)


def apply(model, lora_plan: LoraPlan, seed: int | None = None) -> list[str]:
    """Make the planned modules trainable as `lora_plan.kind` says: wrapped in mlx-lm's
    LoRALinear or DoRALinear, or (full) their own weights unfrozen; freeze everything else.

    Returns the adapted module paths. `seed` makes the A-matrix init reproducible.
    """
    if seed is not None:
        mx.random.seed(seed)
    training = model.training  # new modules start in training mode; keep the model's mode
    model.freeze()
    prefix = layers_prefix(model)
    wrapper = {"lora": LoRALinear, "dora": DoRALinear}.get(lora_plan.kind)
    for i in lora_plan.layers:
        layer = model.layers[i]
        present = dict(layer.named_modules())
        updates = []
        for key in lora_plan.keys:
            module = present.get(key)
            if module is None:
                continue  # e.g. Gemma 4 KV-shared layers have no k/v projections
            if isinstance(module, _ADAPTED):
                raise UserError(f"{prefix}.{i}.{key} already has a LoRA adapter")
            if wrapper is None:  # full: the module's own arrays train
                module.unfreeze(keys=_own_params(module), recurse=False)
                continue
            updates.append(
                (
                    key,
                    wrapper.from_base(
                        module, r=lora_plan.rank, dropout=lora_plan.dropout, scale=lora_plan.scale
                    ),
                )
            )
        if updates:
            layer.update_modules(tree_unflatten(updates))
    model.train(training)
    mx.eval(model.trainable_parameters())
    return lora_plan.module_paths(model)


def lora_modules(model) -> list[tuple[str, LoRALinear | DoRALinear]]:
    """The LoRA and DoRA wrappers (both hold `linear`, `lora_a`, `lora_b`, `scale`)."""
    return [(p, m) for p, m in model.named_modules() if isinstance(m, _ADAPTED)]


def adapter_parameters(model) -> dict[str, mx.array]:
    """The adapter's arrays by full parameter name: what `apply` left trainable (lora_a and
    lora_b; DoRA's magnitudes `m`; a full fine-tune's weights and biases)."""
    return dict(tree_flatten(model.trainable_parameters()))


def remove(model) -> None:
    """Put the original linears back (LoRA and DoRA adapters are dropped; a full fine-tune's
    weights are the model's own and stay)."""
    restore = [(p, m.linear) for p, m in lora_modules(model)]
    if restore:
        model.update_modules(tree_unflatten(restore))


def fuse(model) -> None:
    """Merge every adapter into its base weight (LoRA: W + scale * (A B)^T; DoRA: that,
    rescaled to the magnitudes m), leaving plain (or re-quantized) linears. A full fine-tune
    is already in the weights."""
    fused = [(p, m.fuse(dequantize=False)) for p, m in lora_modules(model)]
    if fused:
        model.update_modules(tree_unflatten(fused))
