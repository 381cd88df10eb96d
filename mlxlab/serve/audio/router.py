"""OpenAI `POST /v1/audio/transcriptions` and `POST /v1/audio/translations` (to English):
multipart/form-data with `file`, `model` (any name: the served speech model answers), `prompt`,
`response_format` (json | text | verbose_json | srt | vtt), `temperature`, and for
transcriptions `language` and `timestamp_granularities[]` (segment, word). Errors in the OpenAI
shape.

The body is capped by `serve.max_audio_mb` (50 MB: 413 over it, before this router runs; see
http.BodyLimit, which spools these routes' bodies to disk instead of memory). The file is
decoded off the event loop (PyAV: wav, mp3, m4a/aac, ogg/opus, flac, webm; 400 naming the
format when it cannot be), then transcribed on the engine thread between generations
(serve/sidecars.py)."""

from __future__ import annotations

from fastapi import APIRouter, File, Form, Request, UploadFile

from mlxlab.audio.decode import format_hint
from mlxlab.errors import UserError
from mlxlab.serve import sidecars
from mlxlab.serve.audio import encode
from mlxlab.serve.audio.protocol import Hearing, hearing
from mlxlab.serve.http import APIError, protocol_route
from mlxlab.serve.openai.protocol import OpenAIError, error_shape

router = APIRouter(route_class=protocol_route(error_shape, OpenAIError))
ROUTES = ("/v1/audio/transcriptions", "/v1/audio/translations")
ANSWER = {200: {"description": "The transcript in the requested format", "content": encode.CONTENT}}


async def _run(request: Request, file: UploadFile, h: Hearing):
    speech = sidecars.speech(request, ROUTES[h.task == "translate"])
    cfg = request.app.state.cfg
    name = file.filename or "file"
    audio = await sidecars.decode_audio(file.file, format_hint(name), repr(name), cfg.max_audio_s)
    try:
        transcript = await sidecars.on_engine(request, lambda: _transcribe(speech, audio, h))
    except UserError as e:  # what the model cannot do (a translation by an English-only one)
        raise APIError(400, str(e)) from None
    return encode.response(transcript, h)


def _transcribe(speech, audio, h: Hearing):
    return speech.transcribe(
        audio.samples,
        language=h.language,
        task=h.task,
        prompt=h.prompt,
        temperature=h.temperature,
        word_timestamps=h.words,
    )


@router.post("/v1/audio/transcriptions", responses=ANSWER)
async def transcriptions(
    request: Request,
    file: UploadFile = File(..., description="The audio file: wav, mp3, m4a, ogg/opus, flac, webm"),
    model: str = Form(
        ..., description="Any name: the served speech model (serve.stt_model) answers"
    ),
    language: str | None = Form(None, description="ISO 639-1 code; detected when absent"),
    prompt: str | None = Form(None),
    response_format: str | None = Form("json"),
    temperature: float | None = Form(0.0),
    timestamp_granularities: list[str] | None = Form(None, alias="timestamp_granularities[]"),
):
    h = hearing(
        "transcribe", response_format, language, prompt, temperature, timestamp_granularities
    )
    return await _run(request, file, h)


@router.post("/v1/audio/translations", responses=ANSWER)
async def translations(
    request: Request,
    file: UploadFile = File(..., description="The audio file: wav, mp3, m4a, ogg/opus, flac, webm"),
    model: str = Form(
        ..., description="Any name: the served speech model (serve.stt_model) answers"
    ),
    prompt: str | None = Form(None),
    response_format: str | None = Form("json"),
    temperature: float | None = Form(0.0),
):
    h = hearing("translate", response_format, None, prompt, temperature, None)
    return await _run(request, file, h)
