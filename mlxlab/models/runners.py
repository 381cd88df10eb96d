"""Run an mlx-lm decoder layer by layer: embed, any range of layers, final norm.

The segmented backward (mlxlab/train/backward.py) needs the model's forward cut into pieces
that take and return plain arrays. One generic runner covers the families whose layers are
called as `layer(h, mask, cache)`; small subclasses add what a family's own `__call__` does
differently (Gemma 3's embedding scale and global/sliding masks; Gemma 4's per-layer inputs and
KV-shared layers). On MLX's ops each reproduces its model's forward bit for bit;
tests/test_runners.py checks that against `model.model(inputs)` for every family. In float32 on
the CPU, Gemma 3's layers run on mlxlab's training kernels instead (models/fastlayers.py), equal
to float rounding (tests/test_fastlayers.py).

Packed rows (several examples in one row, data.pack) pass `segments` to `embed`: each position's
example number in its row. The masks are then block-diagonal: a position attends only to earlier
positions of its own example (and, on sliding-window layers, within the window). Positions are
not renumbered: RoPE makes attention depend only on the distance between query and key, so an
example attends the same at any offset in the row (equal to float rounding; tests/test_pack.py).
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
    fast: object = None  # the training kernels, where the runner's fast layers use them
    starts: object = None  # packed rows, for the fast layers: each position's example start


class Runner:
    """llama-style families: `layer(h, mask, cache)`, optional sliding-window layers."""

    window_attr: str | None = None  # the inner model's sliding-window attribute, where required

    def __init__(self, model):
        self.model = model
        self.inner = model.model
        self.layers = model.layers

    def embed(self, inputs: mx.array, segments: mx.array | None = None) -> tuple[mx.array, Context]:
        h = self.inner.embed_tokens(inputs)
        return h, self.context(h, segments)

    def context(self, h: mx.array, segments: mx.array | None = None) -> Context:
        """The Context of a batch whose hidden states look like `h` (only its shape and dtype are
        read): what a segment-pipeline stage that holds no embedding builds (Gemma 4's per-layer
        inputs, which need the tokens' embeddings, it receives: train/pipeline_stage.py)."""
        return Context(masks=self._masks(h) if segments is None else self.packed_masks(segments))

    def window(self, i: int) -> int | None:
        """Layer i's sliding window, or None for full attention."""
        if self.is_global(i):
            return None
        if self.window_attr is None:  # llama-style: `sliding_window` where the family has one
            return getattr(self.inner, "sliding_window", None)
        return getattr(self.inner, self.window_attr)

    def packed_masks(self, segments: mx.array) -> list:
        """Per layer, the boolean [B, 1, T, T] mask of packed rows (`segments` [B, T])."""
        t = segments.shape[1]
        q = mx.arange(t)[:, None]
        k = mx.arange(t)[None]
        same = segments[:, :, None] == segments[:, None, :]
        full = (same & (q >= k))[:, None]
        by_window: dict = {}
        masks = []
        for i in range(len(self.layers)):
            w = self.window(i)
            if w not in by_window:
                by_window[w] = full if w is None else full & (q < k + w)
            masks.append(by_window[w])
        return masks

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
    """Gemma 3; in float32 on the CPU its layers run on mlxlab's kernels (models/fastlayers.py)."""

    window_attr = "window_size"

    def embed(self, inputs, segments=None):
        h = self.inner.embed_tokens(inputs)
        h = h * mx.array(self.inner.args.hidden_size**0.5, mx.bfloat16).astype(h.dtype)
        return h, self.context(h, segments)

    def context(self, h, segments=None):
        from mlxlab.models import fastlayers

        fast = fastlayers.usable(h)
        if fast is not None:  # masks come from positions inside the kernel: none to build
            starts = None if segments is None else fastlayers.example_starts(segments)
            return Context(masks=[None] * len(self.layers), fast=fast, starts=starts)
        return Context(masks=self._masks(h) if segments is None else self.packed_masks(segments))

    def layer(self, i, h, ctx, shared_kv=None):
        if ctx.fast is None:
            return super().layer(i, h, ctx, shared_kv)
        from mlxlab.models.fastlayers import gemma3_layer

        return gemma3_layer(ctx.fast, self.layers[i], h, self.window(i), ctx.starts), None

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
    window_attr = "window_size"

    def embed(self, inputs, segments=None):
        emb = self.inner.embed_tokens(inputs)
        h = emb * self.inner.embed_scale
        ctx = self.context(h, segments)
        if self.inner.hidden_size_per_layer_input:
            pli = self.inner._get_per_layer_inputs(inputs, emb)
            pli = self.inner._project_per_layer_inputs(h, pli)
            ctx.per_layer_inputs = [pli[:, :, i, :] for i in range(len(self.layers))]
        return h, ctx

    def context(self, h, segments=None):
        if segments is None:
            masks = self.inner._make_masks(h, [None] * len(self.layers))
        else:
            masks = self.packed_masks(segments)
        return Context(masks=masks, per_layer_inputs=[None] * len(self.layers))

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


def forward_hidden(runner: Runner, inputs: mx.array, segments: mx.array | None = None) -> mx.array:
    """The whole stack through the runner (equals `model.model(inputs)`; see the module doc)."""
    h, ctx = runner.embed(inputs, segments)
    kvs: dict[int, tuple] = {}
    donors = runner.kv_donors()
    for i in range(len(runner.layers)):
        h, kv = runner.layer(i, h, ctx, kvs.get(donors[i]) if i in donors else None)
        if kv is not None:
            kvs[i] = kv
    return runner.norm(h)
