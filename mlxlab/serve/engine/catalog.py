"""What the server can say about a model from its files, before (or without) loading it: the
weights' bytes once loaded (from the safetensors headers and the compute dtype), its context
length and whether it reads images (config.json). Nothing here reads a weight or touches MLX's
arrays; `GET /v1/models` lists unloaded models with these, and the engine's memory planning
(engine/models.py) decides from `weight_bytes` whether a model fits before it loads it."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

# safetensors dtypes -> bytes per element
DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
FLOATS = ("F16", "BF16", "F32", "F64")


@dataclass
class Facts:
    """A model directory's facts; None where its files do not say."""

    weight_bytes: int | None
    context_length: int | None
    vision: bool | None


def tensors(path: Path) -> dict[str, dict]:
    """The tensor table of a safetensors file (its JSON header; no tensor is read)."""
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > 100 << 20:
            raise ValueError(f"{path}: a {n}-byte header is not a safetensors header")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def weight_bytes(model_dir: Path, target_bytes: int, copies: bool) -> int:
    """The bytes the weights take once loaded: floating tensors at the compute dtype
    (`target_bytes` each: mlx-lm's set_dtype casts them), the rest (quantized words) as stored;
    `copies`: plus the bf16 copies decode steps read of 2-D weights stored in bf16 (the CPU's
    lossless decode copies, models/fastdecode.py). Raises OSError/ValueError on unreadable files."""
    total = 0
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir} has no *.safetensors weights")
    for f in files:
        for t in tensors(f).values():
            n = 1
            for d in t["shape"]:
                n *= int(d)
            kind = t["dtype"]
            if kind in FLOATS:
                total += n * target_bytes
                if copies and kind == "BF16" and len(t["shape"]) == 2:
                    total += n * 2
            else:
                total += n * DTYPE_BYTES.get(kind, 4)
    return total


def facts(model_dir: Path | None, dtype: str = "auto", decode_head: str = "auto") -> Facts:
    """What `model_dir`'s files say (all None without a directory, or where they cannot be read)."""
    if model_dir is None:
        return Facts(None, None, None)
    context = vision = None
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
        text = config.get("text_config") or {}
        context = config.get("max_position_embeddings") or text.get("max_position_embeddings")
        vision = "vision_config" in config
    except (OSError, ValueError, AttributeError):
        pass
    try:
        size = weight_bytes(Path(model_dir), *compute_terms(dtype, decode_head))
    except (OSError, ValueError, KeyError, TypeError):
        size = None
    return Facts(size, int(context) if isinstance(context, int) else None, vision)


WEIGHT_FILES = ("*.safetensors", "*.bin", "*.npz", "*.gguf", "*.pt", "*.pth")
"""What counts as a weight file when a model's size is estimated from the disk."""


def planned_bytes(model_dir: Path, dtype: str = "auto", decode_head: str = "auto") -> int:
    """The bytes a load of `model_dir` is planned with (engine/models.py `plan_load`): the
    weights' from the safetensors headers (every weight of every file: a VLM's vision tower
    too); where those cannot be read, an upper bound from the weight files' sizes on disk (as if
    every byte were a 2-byte float cast to the compute dtype, plus its decode copy); ValueError
    when there are no weight files to size (the model is refused rather than planned as 0)."""
    target, copies = compute_terms(dtype, decode_head)
    try:
        return weight_bytes(Path(model_dir), target, copies)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    disk = 0
    for pattern in WEIGHT_FILES:
        for f in Path(model_dir).glob(pattern):
            try:
                disk += f.stat().st_size
            except OSError:
                pass
    if not disk:
        raise ValueError(f"{model_dir}: no weight files to tell the memory it needs from")
    return disk * max(1, target // 2) + (disk if copies else 0)


def compute_terms(dtype: str, decode_head: str) -> tuple[int, bool]:
    """(bytes per floating weight at the compute dtype, whether bf16 decode copies are kept)."""
    import mlx.core as mx

    from mlxlab.runtime import resolve_dtype

    target = resolve_dtype(dtype)
    on_cpu = mx.default_device() == mx.cpu
    return target.size, on_cpu and target == mx.float32 and decode_head != "exact"
