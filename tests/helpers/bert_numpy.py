"""A plain numpy BERT sentence encoder (Hugging Face's BertModel maths in float64, then the
sentence-transformers Pooling and Normalize modules), read straight from a model directory's
safetensors and config: the reference mlxlab's embeddings are checked against."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file
from scipy.special import erf


def _ln(x, g, b, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * g + b


def _gelu(x):
    return 0.5 * x * (1.0 + erf(x / np.sqrt(2.0)))


def sentence_vector(model_dir: str | Path, ids: list[int]) -> np.ndarray:
    """One input's sentence vector (no padding: the reference sees the sequence alone)."""
    d = Path(model_dir)
    cfg = json.loads((d / "config.json").read_text())
    settings = json.loads((d / "embedding.json").read_text())
    w = {
        k.removeprefix("bert."): v.astype(np.float64)
        for k, v in load_file(str(d / "model.safetensors")).items()
    }
    eps, heads = cfg["layer_norm_eps"], cfg["num_attention_heads"]
    n = len(ids)
    x = (
        w["embeddings.word_embeddings.weight"][ids]
        + w["embeddings.position_embeddings.weight"][:n]
        + w["embeddings.token_type_embeddings.weight"][0]
    )
    x = _ln(x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"], eps)
    dh = x.shape[-1] // heads
    for i in range(cfg["num_hidden_layers"]):
        p = f"encoder.layer.{i}."

        def lin(name, h, p=p):
            return h @ w[p + name + ".weight"].T + w[p + name + ".bias"]

        q, k, v = (
            lin(f"attention.self.{t}", x).reshape(n, heads, dh).transpose(1, 0, 2)
            for t in ("query", "key", "value")
        )
        scores = q @ k.transpose(0, 2, 1) / np.sqrt(dh)
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        ctx = (scores / scores.sum(-1, keepdims=True)) @ v
        ctx = ctx.transpose(1, 0, 2).reshape(n, -1)
        a = _ln(
            lin("attention.output.dense", ctx) + x,
            w[p + "attention.output.LayerNorm.weight"],
            w[p + "attention.output.LayerNorm.bias"],
            eps,
        )
        x = _ln(
            lin("output.dense", _gelu(lin("intermediate.dense", a))) + a,
            w[p + "output.LayerNorm.weight"],
            w[p + "output.LayerNorm.bias"],
            eps,
        )
    pooling = settings["pooling"]
    if pooling == "cls":
        vec = x[0]
    elif pooling == "max":
        vec = x.max(0)
    elif pooling == "mean_sqrt_len_tokens":
        vec = x.sum(0) / np.sqrt(n)
    else:
        vec = x.mean(0)
    if settings["normalize"]:
        vec = vec / max(np.linalg.norm(vec), 1e-12)
    return vec
