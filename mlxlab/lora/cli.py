"""Adapters outside training.

    python -m mlxlab lora check adapter=outputs/quickstart/<run>/adapter
    python -m mlxlab lora fuse adapter=outputs/quickstart/<run>/adapter out=fused-model

`check` validates every tensor name and shape against the base model and prints the adapter's
layout; `fuse` merges the adapter into the base weights and writes an mlx-lm model directory
(atomically) that `mlx_lm.load` and `model=` load like any other.
"""

from __future__ import annotations

from pathlib import Path

from mlxlab.cli import run_hydra
from mlxlab.config import LoraToolConfig
from mlxlab.errors import UserError


def fuse_to_dir(cfg: LoraToolConfig) -> Path:
    from mlx_lm.utils import load as mlx_lm_load
    from mlx_lm.utils import save

    from mlxlab.fsutil import atomic_dir
    from mlxlab.lora import apply as lora_apply
    from mlxlab.lora import io as lora_io
    from mlxlab.models.zoo import resolve
    from mlxlab.runtime import resolve_dtype

    src = resolve(cfg.model)
    model, tokenizer, config = mlx_lm_load(str(src), return_config=True)
    model.set_dtype(resolve_dtype("float32"))  # merge in full precision, then store
    lora_io.load(model, cfg.adapter)
    lora_apply.fuse(model)
    model.set_dtype(resolve_dtype(cfg.dtype))
    return atomic_dir(
        Path(cfg.out).expanduser(), lambda tmp: save(tmp, src, model, tokenizer, config)
    )


def run(cfg: LoraToolConfig) -> None:
    if not cfg.adapter:
        raise UserError("adapter=DIR is required")
    if cfg.action == "check":
        from mlxlab.lora import io as lora_io
        from mlxlab.models.zoo import load

        model, _ = load(cfg.model, decode_head="exact")
        plan, weights = lora_io.read_plan(cfg.adapter, model)
        print(
            f"ok: {len(weights)} tensors, rank {plan.rank}, scale {plan.scale}, "
            f"layers {list(plan.layers)}, projections {', '.join(plan.keys)}"
        )
    else:
        if not cfg.out:
            raise UserError("lora fuse needs out=DIR for the fused model")
        print(fuse_to_dir(cfg))


def main(argv: list[str]) -> None:
    run_hydra("lora", argv, run, positional=("action",))
