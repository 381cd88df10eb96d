"""OpenAI's audio form fields (`POST /v1/audio/transcriptions`, `/v1/audio/translations`:
multipart/form-data) checked into one `Hearing`; errors in the OpenAI shape (openai/protocol)."""

from __future__ import annotations

from dataclasses import dataclass

from mlxlab.audio.formats import RESPONSE_FORMATS
from mlxlab.audio.speech import language_code
from mlxlab.errors import UserError
from mlxlab.serve.http import APIError

GRANULARITIES = ("segment", "word")


@dataclass
class Hearing:
    """One transcription or translation request, its fields checked."""

    task: str  # transcribe | translate
    response_format: str
    language: str | None  # an ISO 639-1 code, None: detected
    prompt: str | None
    temperature: float
    words: bool  # word timestamps (verbose_json with timestamp_granularities[]=word)
    segments: bool  # segments in verbose_json


def hearing(
    task: str,
    response_format: str | None,
    language: str | None,
    prompt: str | None,
    temperature: float | None,
    granularities: list[str] | None,
) -> Hearing:
    fmt = (response_format or "json").strip()
    if fmt not in RESPONSE_FORMATS:
        raise APIError(
            400,
            f"response_format must be one of {', '.join(RESPONSE_FORMATS)}, got {fmt!r}",
            param="response_format",
        )
    t = 0.0 if temperature is None else float(temperature)
    if not 0.0 <= t <= 1.0:  # OpenAI's range for audio
        raise APIError(400, f"temperature must be in [0, 1], got {t:g}", param="temperature")
    try:
        code = language_code(language)
    except UserError as e:
        raise APIError(400, str(e), param="language") from None
    grains = [g.strip() for g in granularities or [] if g.strip()]
    for g in grains:
        if g not in GRANULARITIES:
            raise APIError(
                400,
                f"timestamp_granularities[] takes {' and '.join(GRANULARITIES)}, got {g!r}",
                param="timestamp_granularities[]",
            )
    if grains and fmt != "verbose_json":
        raise APIError(
            400,
            "timestamp_granularities[] needs response_format=verbose_json",
            param="timestamp_granularities[]",
        )
    return Hearing(
        task=task,
        response_format=fmt,
        language=code,
        prompt=prompt or None,
        temperature=t,
        words="word" in grains,
        segments=not grains or "segment" in grains,
    )
