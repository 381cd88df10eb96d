"""Tiny random-init vision-language models for tests: mlx-vlm's own model classes with small,
seeded configs, saved as mlx-vlm model directories that load offline.

No real VLM weights can be installed from PyPI, so the vision path is tested on these. Each
family keeps what the serving code must handle in the real ones:

- `gemma3`: Gemma 3 (SigLIP tower, pooled to a fixed number of soft tokens per image, a
  `<start_of_image>` placeholder the processor expands); mlx-lm reads its language model too.
- `qwen2`: Qwen2-VL (dynamic resolution: the image's size sets its token count; 3-D mRoPE
  positions; the chat template only in the processor's chat_template.json, as mlx-community's
  conversions ship it); mlx-lm reads its language model too.
- `qwen2_5`: Qwen2.5-VL (windowed vision attention; mlx-lm reads it as Qwen2-VL).
- `paligemma`: PaliGemma (SigLIP + Gemma, no chat template: mlx-vlm's own prompt format), a
  family mlx-lm has no text class for, so the server runs every request of it through mlx-vlm.

Each directory holds config.json, safetensors weights (mlx-vlm's parameter names, which both
mlx-vlm's and mlx-lm's loaders read), a byte-level BPE tokenizer trained offline (as
`tokenizers.build_tiny`) with the family's image tokens, the image processor's configuration and
a chat template that renders image parts.
"""

from __future__ import annotations

import json
from pathlib import Path

from mlxlab.models.tiny import TINY_CONFIGS
from mlxlab.models.tokenizers import build_tiny

# Gemma 3's turn format with image parts (`{"type": "image"}` -> <start_of_image>); a system
# message is folded into the first user turn, as Gemma 3's own template does.
GEMMA3_VL_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set first = messages[0]['content'] if messages[0]['content'] is string else "
    "messages[0]['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') -%}"
    "{%- set first_prefix = first + '\n\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else 'user' -%}"
    "{{- '<start_of_turn>' + role + '\n' + (first_prefix if loop.first else '') -}}"
    "{%- if message['content'] is string -%}{{- message['content'] | trim -}}"
    "{%- elif message['content'] is not none -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{- '<start_of_image>' -}}"
    "{%- elif item['type'] == 'text' -%}{{- item['text'] | trim -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<end_of_turn>\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}"
)

# Qwen2-VL's ChatML format with image parts (<|vision_start|><|image_pad|><|vision_end|>).
QWEN_VL_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- elif message['content'] is not none -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif item['type'] == 'text' -%}{{- item['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)

_GEMMA_TOKENS = {
    "boi_token": "<start_of_image>",
    "eoi_token": "<end_of_image>",
    "image_token": "<image_soft_token>",
}
_PALI_TOKENS = {"image_token": "<image>"}
# The SigLIP tower of the tiny Gemma 3 and PaliGemma: 32 x 32 images in 8-pixel patches.
_SIGLIP = {
    "model_type": "siglip_vision_model",
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "intermediate_size": 64,
    "num_attention_heads": 2,
    "patch_size": 8,
    "image_size": 32,
}
# Its image processing (preprocessor_config.json): 32 x 32, scaled to [-1, 1].
_SIGLIP_PROCESSING = {
    "size": {"height": 32, "width": 32},
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "do_resize": True,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "do_convert_rgb": True,
}
_QWEN_TOKENS = {
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
    "vision_start_token": "<|vision_start|>",
    "vision_end_token": "<|vision_end|>",
}

# The Qwen image processor's settings: 4-pixel patches merged 2 x 2, so each 8 x 8 pixels make
# one token; images are resized into [16 x 16, 32 x 32] pixels (4 to 16 tokens).
_QWEN_PROCESSOR = {
    "patch_size": 4,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "min_pixels": 16 * 16,
    "max_pixels": 32 * 32,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "do_convert_rgb": True,
}

FAMILIES = ("gemma3", "qwen2", "qwen2_5", "paligemma")
# The perturbation's scale per family: large enough that greedy answers vary with the image
# (at 0.05 the Qwen models repeat one token whatever they are shown).
NOISE = {"gemma3": 0.05, "qwen2": 0.3, "qwen2_5": 0.3, "paligemma": 0.3}


def _tokenizer(family: str):
    """The tiny trained BPE (ids 0-5 Gemma-style specials) plus the family's image tokens. No
    BOS is added by the tokenizer itself: the chat templates write it where the family has one."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    backend = build_tiny(512).backend_tokenizer
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    if family in ("gemma3", "paligemma"):
        tok = PreTrainedTokenizerFast(
            tokenizer_object=backend,
            bos_token="<bos>",
            eos_token="<eos>",
            pad_token="<pad>",
            unk_token="<unk>",
            extra_special_tokens=dict(_GEMMA_TOKENS if family == "gemma3" else _PALI_TOKENS),
        )
        if family == "gemma3":  # PaliGemma has none: it takes a prompt, not a chat
            tok.chat_template = GEMMA3_VL_TEMPLATE
        return tok
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<pad>",
        unk_token="<unk>",
        extra_special_tokens=dict(_QWEN_TOKENS),
    )
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    return tok


def tiny_config(family: str, tok) -> dict:
    """config.json for a tiny VLM of `family`, its token ids taken from `tok`."""
    if family not in FAMILIES:
        raise ValueError(f"unknown tiny VLM family {family!r}; choose one of {', '.join(FAMILIES)}")
    vocab = len(tok)
    ids = tok.convert_tokens_to_ids
    if family == "gemma3":
        # A 32 x 32 image in 8-pixel patches (4 x 4), pooled to 2 x 2 = 4 soft tokens.
        return {
            "model_type": "gemma3",
            "image_token_index": ids(_GEMMA_TOKENS["image_token"]),
            "boi_token_index": ids(_GEMMA_TOKENS["boi_token"]),
            "eoi_token_index": ids(_GEMMA_TOKENS["eoi_token"]),
            "mm_tokens_per_image": 4,
            "vocab_size": vocab,
            "pad_token_id": 0,
            "bos_token_id": 2,
            "eos_token_id": [1, 5],
            # the text-only tiny Gemma 3's language model (models/tiny.py)
            "text_config": {
                **TINY_CONFIGS["gemma3"],
                "vocab_size": vocab,
                "mm_tokens_per_image": 4,
            },
            "vision_config": {**_SIGLIP, "num_channels": 3, "layer_norm_eps": 1e-6},
        }
    if family == "paligemma":
        # A 32 x 32 image in 8-pixel patches: 16 image tokens before the prompt.
        return {
            "model_type": "paligemma",
            "image_token_index": ids(_PALI_TOKENS["image_token"]),
            "vocab_size": vocab,
            "hidden_size": 64,
            "projection_dim": 64,
            "pad_token_id": 0,
            "bos_token_id": 2,
            "eos_token_id": 1,
            "text_config": {
                "model_type": "gemma",
                "hidden_size": 64,
                "num_hidden_layers": 2,
                "intermediate_size": 128,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "head_dim": 32,
                "vocab_size": vocab,
                "num_image_tokens": 16,
                "max_position_embeddings": 2048,
            },
            "vision_config": {**_SIGLIP, "projection_dim": 64},
        }
    vision = {
        "model_type": "qwen2_vl" if family == "qwen2" else "qwen2_5_vl",
        "depth": 2,
        "num_heads": 2,
        "patch_size": 4,
        "spatial_patch_size": 4,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "in_channels": 3,
    }
    if family == "qwen2":
        vision.update(embed_dim=32, hidden_size=64, mlp_ratio=2)
    else:  # windowed attention over 16-pixel windows, the last block global
        vision.update(
            hidden_size=32,
            intermediate_size=64,
            out_hidden_size=64,
            window_size=16,
            fullatt_block_indexes=[1],
        )
    return {
        "model_type": "qwen2_vl" if family == "qwen2" else "qwen2_5_vl",
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": True,
        "vocab_size": vocab,
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
        "image_token_id": ids(_QWEN_TOKENS["image_token"]),
        "video_token_id": ids(_QWEN_TOKENS["video_token"]),
        "vision_start_token_id": ids(_QWEN_TOKENS["vision_start_token"]),
        "vision_end_token_id": ids(_QWEN_TOKENS["vision_end_token"]),
        "bos_token_id": None,  # Qwen has none (transformers' config class defaults to 151643)
        "eos_token_id": [ids("<|im_end|>"), 1],
        "pad_token_id": 0,
        "vision_config": vision,
    }


def build(family: str, seed: int = 0):
    """(mlx-vlm model, tokenizer, config) for a tiny random-init VLM of `family`, float32."""
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    tok = _tokenizer(family)
    config = tiny_config(family, tok)
    arch, _ = get_model_and_args(config)
    cfg = json.loads(json.dumps(config))  # mlx-vlm's loader fills these in place, as here
    cfg.setdefault("text_config", {})
    cfg.setdefault("vision_config", {})
    model_config = update_module_configs(
        arch.ModelConfig.from_dict(cfg), arch, cfg, ["text", "vision"]
    )
    mx.random.seed(seed)
    model = arch.Model(model_config)
    # As tiny.build: perturb every parameter, so no norm is an identity and a wrong mapping of
    # any weight (or of the image into the prompt) shows in the tokens.
    key = mx.random.key(seed + 1)
    model.update(
        tree_map(
            lambda p: p + NOISE[family] * mx.random.normal(p.shape, key=key), model.parameters()
        )
    )
    lm = model.language_model
    if hasattr(lm, "lm_head") and getattr(model_config.text_config, "tie_word_embeddings", True):
        # Tied, as in the real checkpoints (which ship no lm_head): mlx-lm reads the embedding.
        lm.lm_head.weight = lm.model.embed_tokens.weight
    mx.eval(model.parameters())
    return model, tok, config


def save(out_dir: str | Path, family: str, seed: int = 0) -> Path:
    """Build a tiny VLM and write it as an mlx-vlm model directory."""
    from mlx_vlm.utils import save_weights

    model, tok, config = build(family, seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_weights(out, model)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    ids = {k: config.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    gen = {k: v for k, v in ids.items() if v is not None}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    tok.save_pretrained(str(out))
    if family == "gemma3":
        processor = {
            **_SIGLIP_PROCESSING,
            "image_processor_type": "Gemma3ImageProcessor",
            "processor_class": "Gemma3Processor",
            "resample": 2,
            "do_pan_and_scan": False,
        }
        (out / "preprocessor_config.json").write_text(json.dumps(processor, indent=2) + "\n")
        (out / "processor_config.json").write_text(
            json.dumps({"processor_class": "Gemma3Processor", "image_seq_length": 4}, indent=2)
        )
        return out
    if family == "paligemma":
        processor = {
            **_SIGLIP_PROCESSING,
            "image_processor_type": "SiglipImageProcessor",
            "processor_class": "PaliGemmaProcessor",
            "image_seq_length": 16,
            "resample": 3,
        }
        (out / "preprocessor_config.json").write_text(json.dumps(processor, indent=2) + "\n")
        (out / "processor_config.json").write_text(
            json.dumps({"processor_class": "PaliGemmaProcessor", "image_seq_length": 16}, indent=2)
        )
        return out
    name = "Qwen2VL" if family == "qwen2" else "Qwen2_5_VL"
    processor = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": f"{name}Processor",
        **_QWEN_PROCESSOR,
    }
    for fname in ("preprocessor_config.json", "video_preprocessor_config.json"):
        (out / fname).write_text(json.dumps(processor, indent=2) + "\n")
    (out / "processor_config.json").write_text(
        json.dumps({"processor_class": f"{name}Processor"}, indent=2) + "\n"
    )
    # The template in the processor's file only, as mlx-community's Qwen2-VL conversions ship it.
    (out / "chat_template.json").write_text(
        json.dumps({"chat_template": QWEN_VL_TEMPLATE}, indent=2) + "\n"
    )
    return out
