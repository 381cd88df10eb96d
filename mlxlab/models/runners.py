"""Run an mlx-lm decoder layer by layer: embed, any range of layers, final norm.

The segmented backward (mlxlab/train/backward.py) needs the model's forward cut into pieces
that take and return plain arrays. One generic runner covers the families whose layers are
called as `layer(h, mask, cache)`; small subclasses add what a family's own `__call__` does
differently (Gemma 3's embedding scale and global/sliding masks; Gemma 4's per-layer inputs and
KV-shared layers). Each reproduces its model's forward bit for bit; tests/test_runners.py checks
that against `model.model(inputs)` for every family.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.models.base import create_attention_mask

from mlxlab.errors import UserError


@dataclass
class Context:
    """Per-batch constants the layers need besides the hidden state (no trainable inputs)."""

    masks: list  # one per layer: "causal", an array, or None
    per_layer_inputs: list = field(default_factory=list)  # Gemma 4 only


class Runner:
    """llama-style families: `layer(h, mask, cache)`, optional sliding-window layers."""

    def __init__(self, model):
        self.model = model
        self.inner = model.model
        self.layers = model.layers

    def embed(self, inputs: mx.array) -> tuple[mx.array, Context]:
        h = self.inner.embed_tokens(inputs)
        return h, Context(masks=self._masks(h))

    def _masks(self, h) -> list:
        full = create_attention_mask(h, None)
        window = getattr(self.inner, "sliding_window", None)
        sliding = create_attention_mask(h, None, window_size=window) if window else full
        return [sliding if getattr(layer, "use_sliding", False) else full for layer in self.layers]

    def layer(self, i: int, h: mx.array, ctx: Context, shared_kv=None):
        """(h, kv): kv is what a later layer may share (only Gemma 4 returns one)."""
        return self.layers[i](h, ctx.masks[i], None), None

    def norm(self, h: mx.array) -> mx.array:
        return self.inner.norm(h)

    def kv_donors(self) -> dict[int, int]:
        """sharer layer -> donor layer whose K/V it attends with (empty: no sharing)."""
        return {}

    def is_global(self, i: int) -> bool:
        """Full-attention (O(L^2) memory) layer, as opposed to a sliding-window one."""
        return not getattr(self.layers[i], "use_sliding", False)


class Gemma3Runner(Runner):
    def embed(self, inputs):
        h = self.inner.embed_tokens(inputs)
        h = h * mx.array(self.inner.args.hidden_size**0.5, mx.bfloat16).astype(h.dtype)
        return h, Context(masks=self._masks(h))

    def _masks(self, h):
        pattern = self.inner.sliding_window_pattern
        full = create_attention_mask(h, None)
        sliding = (
            create_attention_mask(h, None, window_size=self.inner.window_size)
            if pattern > 1
            else None
        )
        return [full if self.is_global(i) else sliding for i in range(len(self.layers))]

    def is_global(self, i):
        pattern = self.inner.sliding_window_pattern
        return i % pattern == pattern - 1


class Gemma4Runner(Runner):
    def embed(self, inputs):
        emb = self.inner.embed_tokens(inputs)
        h = emb * self.inner.embed_scale
        per_layer = [None] * len(self.layers)
        if self.inner.hidden_size_per_layer_input:
            pli = self.inner._get_per_layer_inputs(inputs, emb)
            pli = self.inner._project_per_layer_inputs(h, pli)
            per_layer = [pli[:, :, i, :] for i in range(len(self.layers))]
        masks = self.inner._make_masks(h, [None] * len(self.layers))
        return h, Context(masks=masks, per_layer_inputs=per_layer)

    def layer(self, i, h, ctx, shared_kv=None):
        h, kvs, _ = self.layers[i](
            h,
            ctx.masks[i],
            None,
            per_layer_input=ctx.per_layer_inputs[i],
            shared_kv=shared_kv,
            offset=None if shared_kv is None else 0,
        )
        return h, kvs

    def kv_donors(self):
        return {j: d for j, d in enumerate(self.inner.previous_kvs) if d != j}

    def is_global(self, i):
        return self.layers[i].layer_type == "full_attention"


RUNNERS = {
    "llama": Runner,
    "mistral": Runner,
    "qwen2": Runner,
    "qwen3": Runner,
    "gemma3_text": Gemma3Runner,
    "gemma4_text": Gemma4Runner,
}


def runner_for(model) -> Runner:
    model_type = getattr(model, "model_type", None) or getattr(
        getattr(model, "args", None), "model_type", None
    )
    if model_type not in RUNNERS:
        raise UserError(
            f"segmented/checkpointed backward does not support model type {model_type!r}; "
            f"supported: {', '.join(sorted(RUNNERS))}"
        )
    return RUNNERS[model_type](model)


def forward_hidden(runner: Runner, inputs: mx.array) -> mx.array:
    """The whole stack through the runner (equals `model.model(inputs)`)."""
    h, ctx = runner.embed(inputs)
    kvs: dict[int, tuple] = {}
    donors = runner.kv_donors()
    for i in range(len(runner.layers)):
        h, kv = runner.layer(i, h, ctx, kvs.get(donors[i]) if i in donors else None)
        if kv is not None:
            kvs[i] = kv
    return runner.norm(h)
