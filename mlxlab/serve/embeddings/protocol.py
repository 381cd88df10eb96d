"""OpenAI `POST /v1/embeddings` request: `input` (a string, a list of strings, a token array,
or a list of token arrays), `model` (any name: the served embedding model answers),
`encoding_format` (float | base64), `dimensions`, `user`; and `truncate` (an extension, as
Hugging Face's TEI names it: cut inputs over the model's length instead of refusing them).
Errors in the OpenAI shape."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema

from mlxlab.serve.http import APIError, Int, OptInt

MAX_INPUTS = 2048  # OpenAI's limit on inputs per request


_TEXT = {"type": "string", "minLength": 1}
_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
INPUT_SCHEMA = {
    "anyOf": [
        _TEXT,
        {"type": "array", "items": _TEXT, "minItems": 1, "maxItems": MAX_INPUTS},
        _IDS,
        {"type": "array", "items": _IDS, "minItems": 1, "maxItems": MAX_INPUTS},
    ],
    "description": "A text, texts, a token array or token arrays (ids below the model's "
    "vocabulary size); none empty",
}
"""What `texts_or_ids` accepts, as the OpenAPI schema says it (its checks keep their messages)."""


class EmbeddingsRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    input: Annotated[str | list[str] | list[Int] | list[list[Int]], WithJsonSchema(INPUT_SCHEMA)]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: OptInt = Field(None, ge=1)
    user: str | None = None
    truncate: bool = False

    def texts_or_ids(self) -> tuple[list[str] | None, list[list[int]] | None]:
        """(texts, None) or (None, token id lists); a 400 for an empty or oversized input."""
        value = self.input
        if isinstance(value, str):
            value = [value]
        if not value:
            raise APIError(400, "input is empty", param="input")
        if isinstance(value[0], int):  # one token array (its length is tokens, not inputs)
            value = [value]
        if len(value) > MAX_INPUTS:
            raise APIError(400, f"input: {len(value)} inputs, at most {MAX_INPUTS}", param="input")
        if isinstance(value[0], str):
            for i, text in enumerate(value):
                if not text:
                    raise APIError(400, f"input[{i}] is an empty string", param=f"input[{i}]")
            return list(value), None
        for i, ids in enumerate(value):
            if not ids:
                raise APIError(400, f"input[{i}] is an empty token array", param=f"input[{i}]")
        return None, [list(ids) for ids in value]
