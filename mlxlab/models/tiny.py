"""Tiny random-init models for tests: mlx-lm's own model classes with small, seeded configs.

Each family keeps the features of the real ones that our code must handle: GQA (Llama),
attention biases (Qwen2), q/k norms (Qwen3), sliding-window plus global layers (Gemma 3),
KV-shared layers and per-layer inputs (Gemma 4). Built in well under a second and saved as
ordinary mlx-lm directories.
"""

from __future__ import annotations

import json
from pathlib import Path

from mlxlab.models.tokenizers import build_tiny

TINY_VOCAB = 512

# Configs in Hugging Face form, as config.json would hold them; mlx-lm's ModelArgs parse them.
TINY_CONFIGS: dict[str, dict] = {
    "llama": {
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
    },
    "qwen3": {
        "model_type": "qwen3",
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": True,
    },
    "qwen2": {
        # q/k/v projections carry biases.
        "model_type": "qwen2",
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": True,
    },
    "gemma3": {
        # 6 layers with pattern 3: layers 2 and 5 are global, the rest slide over 16 tokens.
        "model_type": "gemma3_text",
        "hidden_size": 64,
        "num_hidden_layers": 6,
        "intermediate_size": 128,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "query_pre_attn_scalar": 32,
        "sliding_window": 16,
        "sliding_window_pattern": 3,
        "max_position_embeddings": 2048,
    },
    "gemma4": {
        # 6 layers, the last 2 share K/V from earlier layers; per-layer inputs of width 8.
        "model_type": "gemma4_text",
        "hidden_size": 64,
        "num_hidden_layers": 6,
        "intermediate_size": 128,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "global_head_dim": 64,
        "rms_norm_eps": 1e-6,
        "vocab_size_per_layer_input": TINY_VOCAB,
        "num_kv_shared_layers": 2,
        "hidden_size_per_layer_input": 8,
        "sliding_window": 16,
        "sliding_window_pattern": 3,
        "max_position_embeddings": 2048,
        "final_logit_softcapping": 30.0,
    },
}

FAMILIES = tuple(TINY_CONFIGS)


def tiny_config(family: str) -> dict:
    if family not in TINY_CONFIGS:
        raise ValueError(f"unknown tiny family {family!r}; choose one of {', '.join(FAMILIES)}")
    cfg = dict(TINY_CONFIGS[family], vocab_size=TINY_VOCAB)
    cfg.update(bos_token_id=2, eos_token_id=[1, 5], pad_token_id=0)
    return cfg


def build(family: str, seed: int = 0):
    """(model, tokenizer, config) for a tiny random-init model of `family`, float32."""
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm.utils import _get_classes

    config = tiny_config(family)
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    # Norm weights start at 0 (Gemma, 1 + w) or 1; perturb every parameter so no layer is an
    # identity and a wrong mapping anywhere shows in the logits.
    key = mx.random.key(seed + 1)
    flat = tree_map(lambda p: p + 0.02 * mx.random.normal(p.shape, key=key), model.parameters())
    model.update(flat)
    mx.eval(model.parameters())
    return model, build_tiny(TINY_VOCAB), config


def save(out_dir: str | Path, family: str, seed: int = 0) -> Path:
    """Build a tiny model and write it as an mlx-lm model directory."""
    from mlx_lm.utils import save_config, save_model

    model, tokenizer, config = build(family, seed)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_model(out_dir, model)
    save_config(dict(config), out_dir / "config.json")
    tokenizer.save_pretrained(str(out_dir))
    gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return out_dir
