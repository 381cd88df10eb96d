"""A tiny model with LoRA on q, k, v, o and down, its B matrices non-zero (so gradients reach A
too), and examples of given (length, response offset) shapes: what the backward and packing
tests train on."""

from __future__ import annotations

from mlxlab.config import LoraConfig
from mlxlab.lora import apply as lora
from mlxlab.models import tiny
from tests.helpers.training import examples


def lora_model(family: str, shapes, seed: int = 0):
    """(model, examples): examples[i] has shapes[i] = (tokens after BOS, response offset)."""
    import mlx.core as mx

    model, _, _ = tiny.build(family, seed=seed)
    plan = lora.plan(model, LoraConfig(targets=["q", "k", "v", "o", "down"], rank=4))
    lora.apply(model, plan, seed=seed)
    mx.random.seed(seed)
    for _, m in lora.lora_modules(model):
        m.lora_b = 0.05 * mx.random.normal(m.lora_b.shape)
    return model, examples(shapes, seed)
