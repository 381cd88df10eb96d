"""Adapters outside training.

    python -m mlxlab lora check adapter=outputs/quickstart/<run>/adapter
    python -m mlxlab lora fuse adapter=outputs/quickstart/<run>/adapter out=fused-model
    python -m mlxlab lora export adapter=RUN format=peft|gguf out=DIR|FILE.gguf
    python -m mlxlab lora import adapter=PEFT_DIR out=DIR

`check` validates every tensor name and shape against the base model and prints the adapter's
layout; `fuse` merges the adapter into the base weights and writes an mlx-lm model directory
(atomically) that `mlx_lm.load` and `model=` load like any other. `export` and `import`
convert to and from PEFT's layout and llama.cpp's GGUF LoRA (mlxlab/lora/export.py).
"""

from __future__ import annotations

from pathlib import Path

from mlxlab.cli import run_hydra
from mlxlab.config import LoraToolConfig
from mlxlab.errors import UserError
from mlxlab.fsutil import fresh_output


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
    if cfg.action in ("export", "import"):
        from mlxlab.lora import export
        from mlxlab.models.zoo import load

        if not cfg.out:
            what = (
                "the adapter directory"
                if cfg.action == "import"
                else ("a .gguf file" if cfg.format == "gguf" else "the PEFT directory")
            )
            raise UserError(f"lora {cfg.action} needs out= ({what})")
        kind = "file" if cfg.action == "export" and cfg.format == "gguf" else "directory"
        fresh_output(cfg.out, cfg.force, kind)
        model, _ = load(cfg.model, decode_head="exact", decode_kernel=False)
        if cfg.action == "import":
            print(export.import_peft(cfg.adapter, model, cfg.out))
        elif cfg.format == "gguf":
            print(export.export_gguf(cfg.adapter, model, cfg.out, cfg.model))
        else:
            print(export.export_peft(cfg.adapter, model, cfg.out, cfg.model))
    elif cfg.action == "check":
        from mlxlab.lora import io as lora_io
        from mlxlab.models.zoo import load

        model, _ = load(cfg.model, decode_head="exact")
        plan, weights = lora_io.read_plan(cfg.adapter, model)
        what = {
            "lora": f"rank {plan.rank}, scale {plan.scale}",
            "dora": f"DoRA rank {plan.rank}, scale {plan.scale}",
            "full": "full fine-tune",
        }[plan.kind]
        print(
            f"ok: {len(weights)} tensors, {what}, layers {list(plan.layers)}, "
            f"{'modules' if plan.kind == 'full' else 'projections'} {', '.join(plan.keys)}"
        )
    else:
        if not cfg.out:
            raise UserError("lora fuse needs out=DIR for the fused model")
        fresh_output(cfg.out, cfg.force)
        print(fuse_to_dir(cfg))


def main(argv: list[str]) -> None:
    run_hydra("lora", argv, run, positional=("action",))
