"""GGUF -> mlx-lm model directory (safetensors, config.json, tokenizer, generation_config.json).

Supported architectures: Gemma 3 (text), Llama, Qwen2, Qwen3. Tensor types: whatever
`gguf.quants.dequantize` reads (F32, F16, BF16, Q4_0/1, Q5_0/1, Q8_0, Q2_K..Q6_K, ...).

llama.cpp's conventions undone here:
- Gemma stores RMSNorm weights as `1 + w`; mlx-lm's gemma3_text wants `w` (subtract 1).
- Llama's q/k projections are row-permuted for llama.cpp's rope layout; permute them back.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mlxlab.errors import UserError
from mlxlab.fsutil import atomic_dir
from mlxlab.models import tokenizers as tok_lib

CONVERTER_VERSION = 1

# Per-block tensor names, llama.cpp -> Hugging Face (mlx-lm loads HF names).
_BLOCK_COMMON = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


@dataclass(frozen=True)
class Arch:
    model_type: str
    block_names: dict = field(default_factory=dict)
    norm_offset: float = 0.0  # llama.cpp stores Gemma norms as 1 + w
    permute_qk: bool = False  # llama.cpp permutes Llama's q/k rows
    skip: tuple = ("rope_freqs",)


ARCHS = {
    "gemma3": Arch(
        "gemma3_text",
        {
            **_BLOCK_COMMON,
            "post_attention_norm": "post_attention_layernorm",
            "ffn_norm": "pre_feedforward_layernorm",
            "post_ffw_norm": "post_feedforward_layernorm",
        },
        norm_offset=1.0,
    ),
    "llama": Arch(
        "llama", {**_BLOCK_COMMON, "ffn_norm": "post_attention_layernorm"}, permute_qk=True
    ),
    "qwen2": Arch("qwen2", {**_BLOCK_COMMON, "ffn_norm": "post_attention_layernorm"}),
    "qwen3": Arch("qwen3", {**_BLOCK_COMMON, "ffn_norm": "post_attention_layernorm"}),
}


def _model_config(reader, arch_name: str, tensor_names: set[str], vocab_size: int) -> dict:
    a = arch_name

    def req(key):
        value = tok_lib.read_field(reader, f"{a}.{key}")
        if value is None:
            raise UserError(f"GGUF metadata lacks {a}.{key}; the file is incomplete")
        return value

    n_heads = int(req("attention.head_count"))
    hidden = int(req("embedding_length"))
    cfg = {
        "model_type": ARCHS[a].model_type,
        "hidden_size": hidden,
        "num_hidden_layers": int(req("block_count")),
        "intermediate_size": int(req("feed_forward_length")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(
            tok_lib.read_field(reader, f"{a}.attention.head_count_kv", n_heads)
        ),
        "head_dim": int(tok_lib.read_field(reader, f"{a}.attention.key_length", hidden // n_heads)),
        "rms_norm_eps": float(req("attention.layer_norm_rms_epsilon")),
        "vocab_size": vocab_size,
        "max_position_embeddings": int(tok_lib.read_field(reader, f"{a}.context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
    }
    theta = tok_lib.read_field(reader, f"{a}.rope.freq_base")
    if a == "gemma3":
        cfg["rope_theta"] = float(theta or 1_000_000.0)
        cfg["rope_local_base_freq"] = 10_000.0  # not in the GGUF; Gemma 3 uses 10k locally
        cfg["sliding_window"] = int(
            tok_lib.read_field(reader, f"{a}.attention.sliding_window", 512)
        )
        cfg["sliding_window_pattern"] = _swa_pattern(
            tok_lib.read_field(reader, f"{a}.attention.sliding_window_pattern")
        )
        cfg["query_pre_attn_scalar"] = cfg["head_dim"]
        scaling = tok_lib.read_field(reader, f"{a}.rope.scaling.factor")
        if scaling and float(scaling) != 1.0:
            cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(scaling)}
    else:
        cfg["rope_theta"] = float(theta or 10_000.0)
    if a == "qwen2":
        cfg["attention_bias"] = True
    return cfg


def _swa_pattern(value) -> int:
    """Gemma 3's "every Nth layer is global" from GGUF metadata (absent: llama.cpp's fixed 6)."""
    if value is None:
        return 6
    if isinstance(value, (list, tuple)):  # per-layer "is sliding" flags
        return next((i + 1 for i, sliding in enumerate(value) if not sliding), len(value) + 1)
    return int(value)


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Invert llama.cpp's `permute(w, n_head)` on the rows of a q/k weight (or bias)."""
    shape = w.shape
    # llama.cpp: (heads, 2, d/2) -> (heads, d/2, 2); undo: view as (heads, d/2, 2), swap back.
    return w.reshape(n_heads, shape[0] // n_heads // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _hf_name(arch: Arch, gguf_name: str) -> str | None:
    base, _, suffix = gguf_name.rpartition(".")  # suffix: weight | bias
    if base in arch.skip:
        return None
    if base in _TOP:
        return f"{_TOP[base]}.{suffix}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in arch.block_names:
        return f"model.layers.{parts[1]}.{arch.block_names[parts[2]]}.{suffix}"
    raise UserError(f"unexpected tensor {gguf_name!r} for architecture {arch.model_type}")


def read_tensors(reader, arch_name: str, config: dict) -> dict[str, np.ndarray]:
    """All tensors as float32 numpy arrays under Hugging Face names, llama.cpp quirks undone."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    arch = ARCHS[arch_name]
    out = {}
    for t in reader.tensors:
        name = _hf_name(arch, t.name)
        if name is None:
            continue
        qtype = GGMLQuantizationType(t.tensor_type)
        try:
            w = dequantize(t.data, qtype)
        except NotImplementedError as e:
            raise UserError(f"tensor {t.name}: unsupported GGUF type {qtype.name}") from e
        w = np.asarray(w, dtype=np.float32).reshape([int(d) for d in reversed(t.shape)])
        if arch.norm_offset and name.endswith("norm.weight"):
            w = w - np.float32(arch.norm_offset)
        if arch.permute_qk and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = _unpermute(w, config["num_attention_heads"])
        elif arch.permute_qk and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = _unpermute(w, config["num_key_value_heads"])
        out[name] = w
    return out


def open_gguf(path: str | Path):
    """A GGUFReader, or a one-line UserError for a missing, truncated or corrupt file."""
    import gguf

    path = Path(path)
    if not path.is_file():
        raise UserError(f"no such GGUF file: {path}")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # gguf raises ValueError/IndexError/struct errors on bad files
        raise UserError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e})") from e


def architecture(reader) -> str:
    arch = tok_lib.read_field(reader, "general.architecture")
    if arch not in ARCHS:
        raise UserError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(sorted(ARCHS))}"
        )
    return arch


def convert(
    gguf_path: str | Path,
    out_dir: str | Path,
    dtype: str = "bfloat16",
    force: bool = False,
    verify: bool = True,
) -> Path:
    """Convert a GGUF file into an mlx-lm model directory at `out_dir`, atomically.

    The directory appears only once complete and verified (it loads with mlx-lm and gives finite
    logits); an interrupted run leaves at most a `.tmp-*` sibling, removed on the next run.
    Returns `out_dir`. Idempotent: an existing complete directory is kept unless `force`.
    """
    import mlx.core as mx

    out_dir = Path(out_dir).expanduser().absolute()
    if (out_dir / "config.json").exists() and not force:
        return out_dir
    t0 = time.perf_counter()
    reader = open_gguf(gguf_path)
    arch_name = architecture(reader)
    tokenizer, tok_info = tok_lib.from_gguf(reader, arch_name)
    tensor_names = {t.name for t in reader.tensors}
    config = _model_config(reader, arch_name, tensor_names, tok_info["vocab_size"])
    config.update(tok_info["config"])
    weights = read_tensors(reader, arch_name, config)
    mx_dtype = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}.get(dtype)
    if mx_dtype is None:
        raise UserError(
            f"unknown dtype {dtype!r} for conversion; choose bfloat16, float16, float32"
        )

    def write(tmp: Path) -> None:
        arrays = {k: mx.array(v).astype(mx_dtype) for k, v in weights.items()}
        mx.save_safetensors(str(tmp / "model.safetensors"), arrays, metadata={"format": "mlx"})
        del arrays
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "generation_config.json", tok_info["generation_config"])
        tokenizer.save_pretrained(str(tmp))
        _write_json(
            tmp / "mlxlab_source.json",
            {
                "source": str(Path(gguf_path).absolute()),
                "architecture": arch_name,
                "dtype": dtype,
                "converter_version": CONVERTER_VERSION,
                "seconds": round(time.perf_counter() - t0, 1),
            },
        )
        if verify:
            verify_model_dir(tmp)

    try:
        return atomic_dir(out_dir, write)
    except UserError as e:
        raise UserError(f"cannot write {out_dir}: {e}") from e


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def verify_model_dir(path: str | Path) -> None:
    """Load the directory with mlx-lm and check a short forward pass gives finite logits."""
    import mlx.core as mx
    from mlx_lm.utils import load_model, load_tokenizer

    model, _ = load_model(Path(path))
    tokenizer = load_tokenizer(Path(path))
    ids = tokenizer.encode("The capital of France is")
    logits = model(mx.array(ids)[None])
    if not bool(mx.all(mx.isfinite(logits)).item()):
        raise RuntimeError(f"conversion check failed: non-finite logits from {path}")
