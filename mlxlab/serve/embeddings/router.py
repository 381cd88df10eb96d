"""OpenAI `POST /v1/embeddings` over the served embedding model (`serve.embeddings_model`).

Texts are tokenized on the render thread (an input over the model's length is a 400 naming
it, unless `truncate`), token arrays are checked against the vocabulary, then the vectors are
computed on the engine thread, one batch per engine call (serve/sidecars.py), so a large
request lets generations run between its batches. `dimensions` shortens the vectors (first
components, renormalized) for models trained for it (Matryoshka); for others, any value but
the model's own width is a 400."""

from __future__ import annotations

import numpy as np
from fastapi import APIRouter, Request

from mlxlab.embed.model import TooLong, batches, check_lengths, shorten
from mlxlab.serve import sidecars
from mlxlab.serve.embeddings import encode
from mlxlab.serve.embeddings.protocol import EmbeddingsRequest
from mlxlab.serve.http import APIError, protocol_route
from mlxlab.serve.openai.protocol import OpenAIError, error_shape
from mlxlab.serve.pipeline import off_loop

router = APIRouter(route_class=protocol_route(error_shape, OpenAIError))


def _token_ids(embedder, body: EmbeddingsRequest) -> list[list[int]]:
    texts, ids = body.texts_or_ids()
    try:
        if texts is not None:
            return embedder.tokenize(texts, truncate=body.truncate)
        for i, seq in enumerate(ids):
            bad = next((t for t in seq if not 0 <= t < embedder.vocab_size), None)
            if bad is not None:
                raise APIError(
                    400,
                    f"input[{i}]: token id {bad} is not in [0, {embedder.vocab_size})",
                    param=f"input[{i}]",
                )
        if body.truncate:
            return [seq[: embedder.max_tokens] for seq in ids]
        check_lengths(ids, embedder.max_tokens)
        return ids
    except TooLong as e:
        raise APIError(400, str(e), param=f"input[{e.index}]", code="input_too_long") from None


def _dimensions(embedder, wanted: int | None) -> int:
    native = embedder.dimensions
    if wanted is None or wanted == native:
        return native
    if wanted > native:
        raise APIError(
            400, f"dimensions: this model's vectors have {native}, not {wanted}", param="dimensions"
        )
    if not embedder.matryoshka:
        raise APIError(
            400,
            f"dimensions: {embedder.name} was not trained for shortened vectors (Matryoshka); "
            f"its vectors have {native} dimensions",
            param="dimensions",
        )
    return wanted


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingsRequest, request: Request):
    embedder = sidecars.embedder(request)
    dims = _dimensions(embedder, body.dimensions)
    ids = await off_loop(_token_ids, embedder, body)
    vectors = np.zeros((len(ids), embedder.dimensions), np.float32)
    for rows in batches(ids):
        batch = [ids[i] for i in rows]
        vectors[rows] = await sidecars.on_engine(request, lambda b=batch: embedder.embed(b))
    if dims != embedder.dimensions:
        vectors = shorten(vectors, dims)
    tokens = sum(len(s) for s in ids)
    return encode.body(vectors, body.encoding_format, embedder.name, tokens)
