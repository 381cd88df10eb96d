"""Gemma 3's decoder layer for training on the CPU, on mlxlab's kernels (mlxlab/kernels/layer.cpp).

MLX's CPU backend runs exp and tanh one op at a time on one thread (~28 ns per element on the
2-core development machine), so in gemma3-270m's training step at 1152 tokens the attention
softmax (inside `mx.fast.scaled_dot_product_attention`, which on the CPU falls back to matmul,
softmax, matmul) and the MLP's gelu_approx took longer than the layer's matmuls. Those two sit
inside mlx-lm's Attention and MLP `__call__`, so this module composes the same layer from the
layer's own submodules (its projections with their LoRA wrappers, norms and RoPE, called as
mlx-lm calls them), with two substitutions: the masked softmax of the attention scores and
gelu_approx(g) * u run as mlxlab kernels. The masks are computed inside the softmax from the
query and key positions (causal, the sliding window, packed rows' example starts), so no mask
array is built.

It is used where it applies and equals mlx-lm's layer to float rounding (tests/test_fastlayers.py):
float32 on the CPU with the kernels built, not turned off (MLXLAB_TRAIN_KERNELS=off), for every
backward mode alike (losses.hidden_states runs the full backward through the same layers), so
the modes stay bit-exact with each other. `diag parity` compares with mlx-lm's own layer under
`kernels.off("train")`.
"""

from __future__ import annotations

import mlx.core as mx


def usable(h: mx.array):
    """The training kernels for hidden states `h`, or None (then mlx-lm's layer runs)."""
    from mlxlab import kernels

    if h.dtype != mx.float32 or mx.default_device() != mx.cpu:
        return None
    return kernels.train()


def example_starts(segments: mx.array) -> mx.array:
    """Per position of packed rows [B, T], the first position of its example (segments are
    contiguous runs of one number)."""
    t = segments.shape[1]
    idx = mx.arange(t, dtype=mx.int32)[None]
    prev = mx.concatenate([segments[:, :1] - 1, segments[:, :-1]], axis=1)
    return mx.cummax(mx.where(segments != prev, idx, 0), axis=1)


QUERY_BLOCK = 256
"""Queries per block of the attention (see `attention`); rows up to this long run as one block."""


def _blocks(n: int, window: int | None, block: int):
    """(q0, q1, k0) per block of queries: each against the keys it can see, k0 .. q1 - 1 (causal;
    back to the sliding window's start)."""
    return [
        (q0, min(n, q0 + block), max(0, q0 - window + 1) if window else 0)
        for q0 in range(0, n, block)
    ]


def attention(kern, attn, x: mx.array, window: int | None, starts: mx.array | None) -> mx.array:
    """mlx-lm Gemma 3 Attention.__call__ without a cache, its softmax on the kernel.

    Over rows longer than QUERY_BLOCK the queries go in blocks, each block against only the keys
    it can see (up to its last query; from the sliding window's start): the masked part of the
    L x L score and value products is never computed (at 1152 tokens, window 512, blocks of 256:
    0.51x the products of a sliding layer, 0.60x of a global one)."""
    b, n, _ = x.shape
    q = attn.q_proj(x).reshape(b, n, attn.n_heads, -1).transpose(0, 2, 1, 3)
    k = attn.k_proj(x).reshape(b, n, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    v = attn.v_proj(x).reshape(b, n, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    q = attn.rope(attn.q_norm(q))
    k = attn.rope(attn.k_norm(k))
    d = q.shape[-1]
    kv, rep = attn.n_kv_heads, attn.n_heads // attn.n_kv_heads
    parts = []
    for q0, q1, k0 in _blocks(n, window, QUERY_BLOCK):
        m = q1 - q0
        # grouped-query: the query heads of one K/V head stacked as rows, [B, kv, rep * m, D]
        qg = (q if m == n else q[:, :, q0:q1]).reshape(b, kv, rep * m, d)
        kb = k if (k0, q1) == (0, n) else k[:, :, k0:q1]
        vb = v if (k0, q1) == (0, n) else v[:, :, k0:q1]
        scores = qg @ kb.swapaxes(-1, -2)
        p = kern.attention_softmax(
            scores, attn.scale, window or 0, starts, queries=m, q_offset=q0, k_offset=k0
        )
        parts.append((p @ vb).reshape(b, attn.n_heads, m, d))
    out = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)
    return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(b, n, -1))


def mlp(kern, module, y: mx.array) -> mx.array:
    """mlx-lm Gemma 3 MLP.__call__ with gelu_approx(gate) * up on the kernel."""
    return module.down_proj(kern.gelu_mul(module.gate_proj(y), module.up_proj(y)))


def gemma3_layer(kern, layer, x: mx.array, window: int | None, starts: mx.array | None):
    """mlx-lm Gemma 3 TransformerBlock.__call__ (float32, no cache) on the kernels."""
    r = attention(kern, layer.self_attn, layer.input_layernorm(x), window, starts)
    h = x + layer.post_attention_layernorm(r)
    r = mlp(kern, layer.mlp, layer.pre_feedforward_layernorm(h))
    return h + layer.post_feedforward_layernorm(r)
