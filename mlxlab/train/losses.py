"""Losses returning (loss, ntoks): mean cross-entropy over trained tokens, and their count.

`response_ce` projects only the trained positions to the vocabulary. Gemma's 262k-entry
vocabulary makes full logits the largest tensor in training ([B, L, 262144] float32 is 4.3 GB
at L=4096); the response is usually a fraction of the sequence.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


def hidden_states(model, inputs: mx.array) -> mx.array:
    """The final-normed hidden states of an mlx-lm model (everything before the LM head)."""
    return model.model(inputs)


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


def response_ce(model, inputs, positions, labels, weights):
    """Cross-entropy at `positions` only (flat indices into inputs' B*T)."""
    h = hidden_states(model, inputs)
    h = h.reshape(-1, h.shape[-1])[positions]
    logits = lm_head(model, h)
    ce = nn.losses.cross_entropy(logits, labels) * weights
    ntoks = weights.sum()
    return ce.astype(mx.float32).sum() / ntoks, ntoks


def masked_ce(model, inputs, targets, mask):
    """The same loss through full logits [B, T, V] and a dense mask (reference and tests)."""
    logits = model(inputs)
    ce = nn.losses.cross_entropy(logits, targets) * mask
    ntoks = mask.sum()
    return ce.astype(mx.float32).sum() / ntoks, ntoks
