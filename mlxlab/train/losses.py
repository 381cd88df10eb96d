"""Losses returning (loss, ntoks): mean cross-entropy over trained tokens, and their count
(with examples' loss weights: the weighted mean, and the weights' sum).

`response_ce` projects only the trained positions to the vocabulary. Gemma's 262k-entry
vocabulary makes full logits the largest tensor in training ([B, L, 262144] float32 is 4.3 GB
at L=4096); the response is usually a fraction of the sequence. `token_ce` is the one
cross-entropy of training: on the CPU in float32 it is the compiled kernel
(mlxlab/kernels/ce.cpp; MLX's CPU softmax over 262k logits took longer than the head's matmul),
elsewhere MLX's own.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


def hidden_states(model, inputs: mx.array, segments: mx.array | None = None) -> mx.array:
    """The final-normed hidden states of an mlx-lm model (everything before the LM head).

    Through the layer runner (models/runners.py) where the family has one: it equals
    `model.model(inputs)` bit for bit on MLX's ops (Gemma 3's fast layers on the training
    kernels to float rounding), takes packed rows (`segments`, data/batches.py), and runs
    the same (fast) layers as the segmented and checkpointed backward, so every mode computes
    the same numbers."""
    from mlxlab.errors import UserError
    from mlxlab.models.runners import forward_hidden, runner_for

    try:
        runner = runner_for(model)
    except UserError:
        if segments is not None:
            raise
        return model.model(inputs)
    return forward_hidden(runner, inputs, segments)


def lm_head(model, h: mx.array) -> mx.array:
    """Logits from hidden states, as the model's own __call__ computes them."""
    if "lm_head" in model and not getattr(model, "tie_word_embeddings", False):
        logits = model.lm_head(h)
    else:
        logits = model.model.embed_tokens.as_linear(h)
    cap = getattr(model, "final_logit_softcapping", None)
    if cap:
        logits = mx.tanh(logits / cap) * cap
    return logits


def token_ce(logits: mx.array, labels: mx.array) -> mx.array:
    """Per-token cross-entropy of logits [..., V] against integer labels [...]."""
    from mlxlab import kernels

    kernel = kernels.cross_entropy()
    if (
        kernel is not None
        and logits.dtype == mx.float32
        and logits.ndim == 2
        and mx.default_device() == mx.cpu
    ):
        return kernel(logits, labels)[0]
    return nn.losses.cross_entropy(logits, labels)


def head_ce(model, h: mx.array, positions, labels, weights, chunk: int = 0):
    """(mean CE by `weights`, their sum) at `positions` (flat indices into h's B*T) from
    final-normed states h.

    `chunk` > 0 runs the head over that many positions at a time, each chunk under
    `mx.checkpoint`: its logits ([chunk, vocabulary]) are recomputed in the backward instead of
    kept, so the head's peak memory is one chunk's, for one more head matmul. (The head's weight
    is frozen in LoRA training; a checkpointed chunk would not differentiate it.)"""
    h = h.reshape(-1, h.shape[-1])[positions]
    ntoks = weights.sum()
    n = h.shape[0]
    if chunk > 0 and _head_is_trainable(model):
        from mlxlab.errors import UserError

        raise UserError("backward.head_chunk needs a frozen LM head (it would get no gradient)")
    if chunk <= 0 or chunk >= n:
        ce = token_ce(lm_head(model, h), labels) * weights
        return ce.astype(mx.float32).sum() / ntoks, ntoks

    def part(hc, lc, wc):
        return (token_ce(lm_head(model, hc), lc) * wc).astype(mx.float32).sum()

    part = mx.checkpoint(part)
    total = sum(
        part(h[i : i + chunk], labels[i : i + chunk], weights[i : i + chunk])
        for i in range(0, n, chunk)
    )
    return total / ntoks, ntoks


def _head_is_trainable(model) -> bool:
    from mlx.utils import tree_flatten

    head = model.lm_head if "lm_head" in model else model.model.embed_tokens
    return bool(tree_flatten(head.trainable_parameters()))


def response_ce(model, inputs, positions, labels, weights, segments=None, head_chunk: int = 0):
    """Cross-entropy at `positions` only (flat indices into inputs' B*T)."""
    h = hidden_states(model, inputs, segments)
    return head_ce(model, h, positions, labels, weights, head_chunk)


def masked_ce(model, inputs, targets, mask):
    """The same loss through full logits [B, T, V] and a dense mask (reference and tests)."""
    logits = model(inputs)
    ce = nn.losses.cross_entropy(logits, targets) * mask
    ntoks = mask.sum()
    return ce.astype(mx.float32).sum() / ntoks, ntoks
