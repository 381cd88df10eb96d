"""Adapters out of and into mlxlab's (mlx-lm's) layout: PEFT and llama.cpp's GGUF LoRA.

    python -m mlxlab lora export adapter=DIR format=peft out=DIR    # transformers + peft
    python -m mlxlab lora export adapter=DIR format=gguf out=FILE   # llama.cpp --lora
    python -m mlxlab lora import adapter=PEFT_DIR out=DIR           # PEFT -> mlx-lm layout

mlx-lm computes a LoRA update as `scale * (x @ A) @ B` with A [in, r] and B [r, out]; PEFT and
llama.cpp as `(alpha / r) * B' A' x` with A' = A^T [r, in] and B' = B^T [out, r]. So the arrays
are transposed and alpha = scale * r (`use_rslora` PEFT adapters: alpha = scale * sqrt(r)).

PEFT: `adapter_config.json` (peft_type LORA, r, lora_alpha, target_modules as module paths
inside a layer, layers_to_transform) and `adapter_model.safetensors` with PEFT's names,
`base_model.model.<module>.lora_A.weight` / `lora_B.weight` (DoRA: `lora_magnitude_vector`,
`use_dora: true`). mlx-lm's module paths are Hugging Face's for the supported families.

GGUF (llama.cpp's convert_lora_to_gguf.py conventions): general.type=adapter,
adapter.type=lora, adapter.lora.alpha, general.architecture the base's, and per projection
`blk.N.attn_q.weight.lora_a` [r, in] / `.lora_b` [out, r] (numpy order; ggml's ne reversed),
float32. Llama's q/k rows are permuted for llama.cpp's rope as its converter permutes the base
(B's rows only). llama.cpp has no DoRA, and a full fine-tune is a model: both are refused
(`lora fuse`, then convert the model).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np

from mlxlab.errors import UserError
from mlxlab.fsutil import atomic_dir, atomic_write, writable_dir
from mlxlab.lora import apply as lora_apply
from mlxlab.lora import io as lora_io

FORMATS = ("peft", "gguf")
PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
# mlx-lm model_type -> llama.cpp architecture (the base GGUF's general.architecture)
GGUF_ARCH = {"gemma3_text": "gemma3", "llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


def _arrays(weights: dict) -> dict[str, np.ndarray]:
    import mlx.core as mx

    return {k: np.array(v.astype(mx.float32)) for k, v in weights.items()}


def _split(name: str) -> tuple[str, str]:
    """`model.layers.3.self_attn.q_proj.lora_a` -> (`model.layers.3.self_attn.q_proj`, `lora_a`)."""
    module, _, leaf = name.rpartition(".")
    return module, leaf


def _refuse_full(plan: lora_apply.LoraPlan, fmt: str) -> None:
    if plan.kind == "full":
        raise UserError(
            f"a full fine-tune is a model, not an adapter: {fmt} has no form for it; "
            "`lora fuse` it into a model directory (and convert that) instead"
        )


# --- PEFT ------------------------------------------------------------------------------------


def peft_state(plan: lora_apply.LoraPlan, weights: dict) -> tuple[dict, dict[str, np.ndarray]]:
    """(adapter_config.json, tensors) of the PEFT form of an adapter read by lora_io.read_plan."""
    _refuse_full(plan, "PEFT")
    tensors: dict[str, np.ndarray] = {}
    for name, value in _arrays(weights).items():
        module, leaf = _split(name)
        key = PEFT_PREFIX + module
        if leaf == "lora_a":
            tensors[f"{key}.lora_A.weight"] = np.ascontiguousarray(value.T)
        elif leaf == "lora_b":
            tensors[f"{key}.lora_B.weight"] = np.ascontiguousarray(value.T)
        elif leaf == "m" and plan.kind == "dora":
            tensors[f"{key}.lora_magnitude_vector"] = value
        else:
            raise UserError(f"{name}: not a LoRA/DoRA tensor PEFT has a name for")
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": plan.rank,
        "lora_alpha": plan.scale * plan.rank,
        "lora_dropout": plan.dropout,
        "target_modules": sorted(plan.keys),
        "layers_to_transform": sorted(plan.layers),
        "layers_pattern": "layers",
        "bias": "none",
        "fan_in_fan_out": False,
        "use_dora": plan.kind == "dora",
        "use_rslora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    return config, tensors


def export_peft(adapter: str | Path, model, out: str | Path, base: str | None = None) -> Path:
    """Write the adapter at `adapter` (checked against `model`) as a PEFT adapter directory."""
    from safetensors.numpy import save_file

    plan, weights = lora_io.read_plan(adapter, model)
    config, tensors = peft_state(plan, weights)
    if base:
        config["base_model_name_or_path"] = base

    def write(tmp: Path) -> None:
        save_file(tensors, str(tmp / PEFT_WEIGHTS), metadata={"format": "pt"})
        (tmp / PEFT_CONFIG).write_text(json.dumps(config, indent=2) + "\n")

    return atomic_dir(Path(out).expanduser(), write)


def import_peft(peft_dir: str | Path, model, out: str | Path) -> Path:
    """A PEFT LoRA (or DoRA) adapter directory -> an adapter in mlx-lm's layout at `out`,
    checked against `model` before anything is written."""
    import mlx.core as mx
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    src = Path(peft_dir).expanduser()
    for name in (PEFT_CONFIG, PEFT_WEIGHTS):
        if not (src / name).is_file():
            mlx_lm_layout = (src / lora_io.CONFIG).is_file()
            raise UserError(
                f"{src} is not a PEFT adapter directory (no {name})"
                + ("; it is in mlx-lm's layout already, use it as it is" if mlx_lm_layout else "")
            )
    try:
        config = json.loads((src / PEFT_CONFIG).read_text())
        tensors = load_file(str(src / PEFT_WEIGHTS))
    except (OSError, ValueError, SafetensorError) as e:  # JSON's is a ValueError
        raise UserError(f"{src}: unreadable PEFT adapter ({e})") from None
    if not isinstance(config, dict):
        raise UserError(f"{src}: {PEFT_CONFIG} must hold a JSON object")
    problems = []
    if config.get("peft_type") != "LORA":
        problems.append(f"peft_type {config.get('peft_type')!r} (only LORA)")
    for key, fine in (
        ("rank_pattern", {}),
        ("alpha_pattern", {}),
        ("modules_to_save", None),
        ("fan_in_fan_out", False),
        ("bias", "none"),
    ):
        if (config.get(key) or fine) != fine:
            problems.append(f"{key}={config.get(key)!r} (mlx-lm's LoRA has no form for it)")
    r = config.get("r", 0)
    r = r if isinstance(r, int) and not isinstance(r, bool) else 0
    if r < 1:
        problems.append(f"r={config.get('r')!r}")
    alpha = config.get("lora_alpha", r)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
        problems.append(f"lora_alpha={alpha!r}")
    if problems:
        raise UserError(f"PEFT adapter {src}: " + "; ".join(problems))
    alpha = float(alpha)
    scale = alpha / (math.sqrt(r) if config.get("use_rslora") else r)
    kind = "dora" if config.get("use_dora") else "lora"
    leaves = {"lora_A.weight": "lora_a", "lora_B.weight": "lora_b", "lora_magnitude_vector": "m"}
    pattern = re.compile(
        r"(?:base_model\.model\.)?(.+)\.(lora_A\.weight|lora_B\.weight|lora_magnitude_vector)"
    )
    weights, bad = {}, []
    for name, value in tensors.items():
        m = pattern.fullmatch(name)
        if m is None:
            bad.append(name)
            continue
        module, leaf = m.group(1), leaves[m.group(2)]
        weights[f"{module}.{leaf}"] = mx.array(value.T if leaf != "m" else value).astype(mx.float32)
    if bad:
        raise UserError(
            f"PEFT adapter {src}: tensors mlx-lm has no place for: {', '.join(bad[:4])}"
        )
    prefix = lora_apply.layers_prefix(model) + "."
    found = [n[len(prefix) :].split(".", 1) for n in weights if n.startswith(prefix)]
    if len(found) != len(weights) or not weights:
        raise UserError(f"PEFT adapter {src}: its tensors are not on {prefix}N.* modules")
    layers = tuple(sorted({int(i) for i, _ in found}))
    keys = tuple(sorted({rest.rpartition(".")[0] for _, rest in found}))
    plan = lora_apply.LoraPlan(layers, keys, r, scale, float(config.get("lora_dropout", 0.0)), kind)
    meta = {
        "imported_from": str(src.absolute()),
        "peft_base": config.get("base_model_name_or_path"),
    }

    def write(tmp: Path) -> None:
        mx.save_safetensors(str(tmp / lora_io.WEIGHTS), weights, metadata={"format": "mlx"})
        config_out = lora_io.adapter_config(plan, len(model.layers))
        (tmp / lora_io.CONFIG).write_text(json.dumps(config_out, indent=2) + "\n")
        meta_out = {"layers": list(layers), "base": lora_io.base_fingerprint(model), **meta}
        (tmp / lora_io.META).write_text(json.dumps(meta_out, indent=2) + "\n")
        lora_io.read_plan(tmp, model)  # every name and shape fits the model, or nothing lands

    return atomic_dir(Path(out).expanduser(), write)


# --- GGUF ------------------------------------------------------------------------------------


def _permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's `permute(w, n_head)` on the rows (llama's q/k rope layout)."""
    shape = w.shape
    return w.reshape(n_heads, 2, shape[0] // n_heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def gguf_tensors(plan: lora_apply.LoraPlan, weights: dict, model) -> tuple[str, dict]:
    """(llama.cpp architecture, {gguf name: array}) of a LoRA adapter on `model`."""
    from mlxlab.models.gguf import ARCHS

    _refuse_full(plan, "GGUF")
    if plan.kind == "dora":
        raise UserError("llama.cpp has no DoRA adapters: export format=peft, or `lora fuse` it")
    model_type = getattr(model, "model_type", None) or getattr(model.args, "model_type", None)
    arch_name = GGUF_ARCH.get(model_type)
    if arch_name is None:
        raise UserError(
            f"GGUF export knows the architectures {', '.join(sorted(GGUF_ARCH))}; "
            f"this model is {model_type!r}"
        )
    arch = ARCHS[arch_name]
    to_gguf = {hf: g for g, hf in arch.block_names.items()}
    prefix = lora_apply.layers_prefix(model) + "."
    args = model.args
    heads = {
        "self_attn.q_proj": args.num_attention_heads,
        "self_attn.k_proj": getattr(args, "num_key_value_heads", args.num_attention_heads),
    }
    out: dict[str, np.ndarray] = {}
    for name, value in _arrays(weights).items():
        module, leaf = _split(name)
        i, _, key = module[len(prefix) :].partition(".")
        if not module.startswith(prefix) or key not in to_gguf or leaf not in ("lora_a", "lora_b"):
            raise UserError(f"{name}: llama.cpp has no tensor for it")
        if leaf == "lora_a":
            t = value.T  # [r, in]
        else:
            t = value.T  # [out, r]
            if arch.permute_qk and key in heads:
                t = _permute(t, heads[key])
        out[f"blk.{int(i)}.{to_gguf[key]}.weight.{leaf}"] = np.ascontiguousarray(t)
    return arch_name, out


def export_gguf(adapter: str | Path, model, out: str | Path, base: str | None = None) -> Path:
    """Write the LoRA adapter at `adapter` (checked against `model`) as a llama.cpp GGUF
    adapter (`llama-cli -m BASE.gguf --lora OUT`)."""
    import gguf

    plan, weights = lora_io.read_plan(adapter, model)
    arch, tensors = gguf_tensors(plan, weights, model)
    out = Path(out).expanduser()
    if out.suffix != ".gguf":
        raise UserError(f"out={out}: a GGUF adapter is a .gguf file")
    writable_dir(out.parent)

    def write(tmp: Path) -> None:
        w = gguf.GGUFWriter(str(tmp), arch)
        w.add_type(gguf.GGUFType.ADAPTER)
        w.add_string(gguf.Keys.Adapter.TYPE, "lora")
        w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(plan.scale * plan.rank))
        w.add_name(f"mlxlab LoRA ({base or 'base model'})")
        for name in sorted(tensors):
            w.add_tensor(name, tensors[name].astype(np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    return atomic_write(out, write)
