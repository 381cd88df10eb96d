"""The shared workload of the diagnostics: real text, and rank-8 LoRA on every projection."""

from __future__ import annotations

from mlxlab.config import LoraConfig


def text_ids(tokenizer, length: int) -> list[int]:
    """`length` tokens of real text (the stdlib docstrings the tiny tokenizer is trained on)."""
    from mlxlab.models.tokenizers import _tiny_corpus

    ids = tokenizer.encode("\n\n".join(_tiny_corpus()))
    if len(ids) < length:
        ids = ids * (length // len(ids) + 1)
    return ids[:length]


def attach_lora(model, seed: int = 0, kind: str = "lora"):
    """Rank-8 LoRA (or DoRA, or full fine-tuning: lora.type) on q k v o gate up down of every
    layer; returns the plan."""
    from mlxlab.lora import apply as lora

    plan = lora.plan(model, LoraConfig(type=kind, targets=list(lora.SHORT_NAMES), rank=8))
    lora.apply(model, plan, seed=seed)
    return plan


def training_setup(model_name: str, dtype: str, length: int, offset: int, kind: str = "lora"):
    """(model with LoRA (`kind`) in training mode, the token ids, their batch trained from
    `offset`)."""
    from mlxlab.data.batches import collate
    from mlxlab.data.datasets import Example
    from mlxlab.models.zoo import load

    model, tokenizer = load(model_name, dtype, decode_head="exact")  # as training loads it
    attach_lora(model, kind=kind)
    model.train()
    ids = text_ids(tokenizer, length)
    return model, ids, collate([Example(ids, offset)])
