"""Model FLOPs of a LoRA training step, from the model's shapes and the batch's real lengths.

`step_flops` is the one formula; everything is a matmul count (2 FLOPs per multiply-add), from
the real (unpadded) lengths, so padding is not counted as work:

- linear layers: 2 x (weights of the layers' frozen projections) per token, forward;
- LoRA: 2 x r x (in + out) per adapted projection per token, forward;
- attention: per layer and sequence, Q.K^T and P.V each 2 x heads x head_dim per attended
  (query, key) pair; causal pairs are L(L+1)/2, or with a sliding window W, sum_t min(t+1, W);
- the LM head: 2 x hidden x vocabulary per trained (response) position only, since the loss
  applies the head only there.

Backward with frozen base weights computes no weight gradient for them: linear layers and the
head cost one more forward's worth (the input gradient), attention two (dQ, dK, dV, dP), LoRA
two (input and weight gradients). The checkpointed and segmented modes run each layer's forward
again inside the backward: one more forward of the layers (not the head). MFU, as large-scale
trainers report it, is these FLOPs per second over the machine's measured float32 matmul rate
(`runtime.measure_matmul_gflops`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shapes:
    """What the count needs from a model."""

    linear_weights: int  # frozen projection weights of all layers (in x out summed)
    lora_weights: int  # sum of r x (in + out) over adapted projections
    heads: list[int]  # per layer: attention (query) heads
    head_dim: list[int]  # per layer
    windows: list[int | None]  # per layer: sliding window, None for full attention
    hidden: int
    vocab: int
    layer_linear: list[int] = ()  # per layer: its share of linear_weights
    layer_lora: list[int] = ()  # per layer: its share of lora_weights


def model_shapes(model) -> Shapes:
    """Shapes of an mlx-lm model (with or without LoRA applied)."""

    from mlxlab.models.runners import runner_for

    runner = runner_for(model)
    args = model.args
    window = getattr(args, "sliding_window", None) or getattr(model.model, "window_size", None)
    heads, dims, windows, layer_linear, layer_lora = [], [], [], [], []
    for i, layer in enumerate(runner.layers):
        linear, lora = module_weights(layer)
        layer_linear.append(linear)
        layer_lora.append(lora)
        attn = layer.self_attn
        h = attn.n_heads
        q = attn.q_proj
        q = getattr(q, "linear", q)
        heads.append(h)
        dims.append(q.weight.shape[0] // h)
        windows.append(None if runner.is_global(i) else window)
    vocab = model.model.embed_tokens.weight.shape[0]
    return Shapes(
        sum(layer_linear),
        sum(layer_lora),
        heads,
        dims,
        windows,
        args.hidden_size,
        vocab,
        layer_linear,
        layer_lora,
    )


def module_weights(module) -> tuple[int, int]:
    """(frozen projection weights, LoRA r x (in + out) weights) of the linear layers in `module`."""
    import mlx.nn as nn

    linear = lora = 0
    # A LoRA wrapper is not an nn.Linear; its frozen base (`.linear`) is, and is counted.
    for _, m in module.named_modules():
        if hasattr(m, "lora_a") and hasattr(m, "lora_b"):
            lora += m.lora_a.shape[1] * (m.lora_a.shape[0] + m.lora_b.shape[1])
        elif isinstance(m, nn.QuantizedLinear):
            linear += m.weight.shape[0] * m.weight.shape[1] * 32 // m.bits
        elif isinstance(m, nn.Linear):
            linear += m.weight.shape[0] * m.weight.shape[1]
    return linear, lora


def attention_flops(heads: int, head_dim: int, window: int | None, lengths: list[int]) -> int:
    """Forward FLOPs of one layer's Q.K^T and P.V over sequences of `lengths`."""
    return sum(2 * 2 * heads * head_dim * attended_pairs(n, window) for n in lengths)


def layer_flops(shapes: Shapes, i: int, lengths: list[int]) -> int:
    """Forward FLOPs of layer `i` (projections, LoRA, attention) over sequences of `lengths`."""
    tokens = sum(lengths)
    return 2 * (shapes.layer_linear[i] + shapes.layer_lora[i]) * tokens + attention_flops(
        shapes.heads[i], shapes.head_dim[i], shapes.windows[i], lengths
    )


def attended_pairs(length: int, window: int | None) -> int:
    """Causal (query, key) pairs of one sequence, within a sliding window if given."""
    if window is None or window >= length:
        return length * (length + 1) // 2
    return window * (window + 1) // 2 + (length - window) * window


def step_flops(
    shapes: Shapes, lengths: list[int], trained: int, mode: str, head_chunk: int = 0
) -> dict:
    """FLOPs of one training step over sequences of `lengths` (real tokens of each input row)
    with `trained` response positions, for backward `mode` (full | checkpoint | segmented);
    `head_chunk` > 0 adds the loss head's recomputed forward."""
    tokens = sum(lengths)
    lin = 2 * shapes.linear_weights * tokens
    lora = 2 * shapes.lora_weights * tokens
    att = sum(
        attention_flops(h, d, w, lengths)
        for h, d, w in zip(shapes.heads, shapes.head_dim, shapes.windows, strict=True)
    )
    head = 2 * shapes.hidden * shapes.vocab * trained
    forward = lin + lora + att + head
    backward = lin + 2 * lora + 2 * att + head
    recompute = (lin + lora + att) if mode in ("checkpoint", "segmented") else 0
    if head_chunk and head_chunk < trained:
        recompute += head
    return {
        "forward": forward,
        "backward": backward,
        "recompute": recompute,
        "total": forward + backward + recompute,
    }
