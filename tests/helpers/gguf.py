"""Write small synthetic GGUF files from tiny mlx-lm models, the way llama.cpp's converter does.

Independent of mlxlab's reader on purpose: tensor names come from gguf-py's own
`TensorNameMap`, Llama's q/k rows are permuted as llama.cpp's `LlamaModel.permute` does, and
Gemma's norms are stored as `1 + w`. Converting such a file back must give the source model.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

GGUF_ARCH = {"llama": "LLAMA", "qwen2": "QWEN2", "qwen3": "QWEN3", "gemma3_text": "GEMMA3"}
ARCH_NAME = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3"}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.LlamaModel.permute (rows of q/k)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def tokenizer_fields(tokenizer_dir: Path) -> dict:
    """gpt2-style (byte-level BPE) tokenizer metadata from a tokenizer.json."""
    data = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    tokens = [None] * len(vocab)
    for tok, idx in vocab.items():
        tokens[idx] = tok
    specials = {t["content"] for t in data["added_tokens"] if t.get("special")}
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    types = [3 if t in specials else 1 for t in tokens]
    return {"tokens": tokens, "merges": merges, "types": types}


def write_gguf(
    path: Path,
    weights: dict[str, np.ndarray],
    config: dict,
    tokenizer_dir: Path,
    qtype=None,
    chat_template: str | None = None,
) -> Path:
    """Write `weights` (HF names, float32) as a GGUF; 2-D matrices stored as `qtype`."""
    import gguf
    from gguf.quants import quantize

    model_type = config["model_type"]
    arch = ARCH_NAME[model_type]
    n_layers = config["num_hidden_layers"]
    name_map = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, GGUF_ARCH[model_type]), n_layers)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(n_layers)
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_rope_freq_base(config["rope_theta"])
    w.add_context_length(config.get("max_position_embeddings", 2048))
    if "sliding_window" in config and config["sliding_window"]:
        w.add_sliding_window(config["sliding_window"])
    if model_type == "gemma3_text":  # as per-layer flags, the form newer llama.cpp writes
        pattern = config["sliding_window_pattern"]
        w.add_sliding_window_pattern([(i + 1) % pattern != 0 for i in range(n_layers)])
    tok = tokenizer_fields(tokenizer_dir)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tok["tokens"])
    w.add_token_merges(tok["merges"])
    w.add_token_types(tok["types"])
    w.add_bos_token_id(config["bos_token_id"])
    w.add_eos_token_id(config["eos_token_id"][0])
    w.add_pad_token_id(config["pad_token_id"])
    w.add_add_bos_token(True)
    if chat_template:
        w.add_chat_template(chat_template)

    for hf_name, value in weights.items():
        value = np.asarray(value, dtype=np.float32)
        if model_type == "gemma3_text" and hf_name.endswith("norm.weight"):
            value = value + 1.0
        if model_type == "llama" and hf_name.endswith("q_proj.weight"):
            value = llama_cpp_permute(value, config["num_attention_heads"])
        if model_type == "llama" and hf_name.endswith("k_proj.weight"):
            value = llama_cpp_permute(value, config["num_key_value_heads"])
        name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        if qtype is not None and value.ndim == 2:
            q = quantize(value, qtype)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qtype)
        elif value.ndim == 2 and qtype is None:
            w.add_tensor(name, value)
        else:
            w.add_tensor(name, value)  # norms and biases stay F32, as llama.cpp keeps them
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def roundtrip(value: np.ndarray, qtype) -> np.ndarray:
    """What a 2-D tensor becomes after storing it as `qtype` and reading it back."""
    from gguf.quants import dequantize, quantize

    if qtype is None or value.ndim != 2:
        return value
    return dequantize(quantize(np.asarray(value, np.float32), qtype), qtype)
