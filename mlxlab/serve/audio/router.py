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
from mlxlab.audio.formats import RESPONSE_FORMATS
from mlxlab.errors import UserError
from mlxlab.serve import sidecars
from mlxlab.serve.audio import encode
from mlxlab.serve.audio.protocol import GRANULARITIES, Hearing, hearing
from mlxlab.serve.http import APIError, protocol_route
from mlxlab.serve.openai.protocol import OpenAIError, error_shape

router = APIRouter(route_class=protocol_route(error_shape, OpenAIError))
ROUTES = ("/v1/audio/transcriptions", "/v1/audio/translations")
ANSWER = {200: {"description": "The transcript in the requested format", "content": encode.CONTENT}}


def example_wav(seconds: float = 0.1) -> str:
    """A WAV file whose every byte is below 0x80 (8 kHz, 8-bit unsigned PCM, a quiet sawtooth),
    so that it is a JSON string as it is: the OpenAPI schema's example request, which a client
    generating requests from the schema (a fuzzer) can send and have transcribed, where any
    bytes it would make up are not audio."""
    import struct

    rate = 8000
    data = bytes(0x30 + (i % 32) for i in range(int(rate * seconds)))
    fmt = struct.pack("<HHIIHH", 1, 1, rate, rate, 1, 8)  # PCM, mono, rate, bytes/s, align, bits
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt
    body += b"data" + struct.pack("<I", len(data)) + data
    wav = b"RIFF" + struct.pack("<I", len(body)) + body
    assert max(wav) < 0x80
    return wav.decode("ascii")


def _example(**fields) -> dict:
    return {
        "requestBody": {
            "content": {
                "multipart/form-data": {
                    "example": {"file": example_wav(), "model": "whisper-1", **fields}
                }
            }
        }
    }


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


# The form fields as the OpenAPI schema states them: what `protocol.hearing` accepts (its checks
# keep their messages). A form field cannot be null, so none is nullable; an empty one is absent.
FILE = File(..., description="The audio file: wav, mp3, m4a, ogg/opus, flac, webm")
MODEL = Form(
    ...,
    min_length=1,  # FastAPI reads an empty form field as a missing one
    description="Any name: the served speech model (serve.stt_model) answers",
)


def _field(default, description: str | None = None, languages: bool = False, alias=None, **schema):
    """A form field whose OpenAPI schema is `schema` (not FastAPI's nullable anyOf); with
    `languages`, an enum of the codes Whisper knows (mlx-audio's list, read at schema time)."""

    def state(s: dict) -> None:
        s.pop("anyOf", None)
        s.update(schema)
        if languages:
            from mlx_audio.stt.models.whisper.tokenizer import LANGUAGES

            s["enum"] = sorted(LANGUAGES)

    return Form(default, alias=alias, description=description, json_schema_extra=state)


def _prompt():
    return _field(None, type="string")


def _format():
    return _field("json", type="string", enum=list(RESPONSE_FORMATS))


def _temperature():
    return _field(0.0, type="number", minimum=0.0, maximum=1.0)


@router.post("/v1/audio/transcriptions", responses=ANSWER, openapi_extra=_example(language="en"))
async def transcriptions(
    request: Request,
    file: UploadFile = FILE,
    model: str = MODEL,
    language: str | None = _field(
        None, "ISO 639-1 code; detected when absent", languages=True, type="string"
    ),
    prompt: str | None = _prompt(),
    response_format: str | None = _format(),
    temperature: float | None = _temperature(),
    timestamp_granularities: list[str] | None = _field(
        None,
        "segment and/or word; needs response_format=verbose_json",
        alias="timestamp_granularities[]",
        type="array",
        items={"enum": list(GRANULARITIES)},
    ),
):
    h = hearing(
        "transcribe", response_format, language, prompt, temperature, timestamp_granularities
    )
    return await _run(request, file, h)


@router.post("/v1/audio/translations", responses=ANSWER, openapi_extra=_example())
async def translations(
    request: Request,
    file: UploadFile = FILE,
    model: str = MODEL,
    prompt: str | None = _prompt(),
    response_format: str | None = _format(),
    temperature: float | None = _temperature(),
):
    h = hearing("translate", response_format, None, prompt, temperature, None)
    return await _run(request, file, h)
