"""Sentence vectors -> OpenAI's embeddings body (pure). base64 is the vector's float32 bytes,
little-endian, as OpenAI's SDKs decode it (`np.frombuffer(base64.b64decode(s), "<f4")`)."""

from __future__ import annotations

import base64

import numpy as np


def vector(v: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode("ascii")
    return [float(x) for x in v]


def body(vectors: np.ndarray, encoding_format: str, model: str, tokens: int) -> dict:
    return {
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": vector(v, encoding_format)}
            for i, v in enumerate(vectors)
        ],
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
