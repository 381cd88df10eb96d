"""A Transcript -> the HTTP response for the requested `response_format` (pure)."""

from __future__ import annotations

from fastapi.responses import JSONResponse, Response

from mlxlab.audio import formats
from mlxlab.audio.speech import Transcript
from mlxlab.serve.audio.protocol import Hearing

CONTENT = {
    "application/json": {},
    "text/plain": {},
    "application/x-subrip": {},
    "text/vtt": {},
}
"""The 200 answer's content types (for the OpenAPI schema)."""


def body(t: Transcript, h: Hearing) -> dict | str:
    return formats.render(t, h.response_format, words=h.words, segments=h.segments)


def response(t: Transcript, h: Hearing) -> Response:
    out = body(t, h)
    if isinstance(out, dict):
        return JSONResponse(out)
    return Response(out, media_type=formats.MEDIA_TYPES[h.response_format])
