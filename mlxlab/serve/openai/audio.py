"""Chat `input_audio` parts (`{"type": "input_audio", "input_audio": {"data": base64,
"format": "wav" | "mp3" | ...}}`) on a text model: each is decoded, transcribed by the served
speech model (serve.stt_model) on the engine thread, and replaced by a text part holding its
transcript, `[audio transcript: ...]`, before the prompt is rendered. The text model reads
what was said, not how (tone, speakers, sounds are lost): a deviation from an audio-native
model, stated in /v1/models. The response's usage adds `audio_seconds`, the seconds of audio
heard. Each part is at most serve.max_chat_audio_mb decoded (the handbook's 5 MB)."""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass

from fastapi import Request

from mlxlab.audio.decode import FORMATS, format_hint
from mlxlab.serve import sidecars
from mlxlab.serve.http import APIError
from mlxlab.serve.openai import encode
from mlxlab.serve.openai.protocol import ChatRequest


@dataclass
class Heard:
    parts: int = 0
    seconds: float = 0.0


def _parts(body: ChatRequest):
    for i, m in enumerate(body.messages):
        if isinstance(m.content, list):
            for j, part in enumerate(m.content):
                if isinstance(part, dict) and part.get("type") == "input_audio":
                    yield i, j, m, part


def _payload(part: dict, where: str, limit_mb: float) -> tuple[bytes, str]:
    spec = part.get("input_audio")
    if not isinstance(spec, dict) or not isinstance(spec.get("data"), str):
        raise APIError(
            400, f"{where}.input_audio needs {{data: base64, format}}", param=f"{where}.input_audio"
        )
    fmt = spec.get("format")
    if fmt is not None and (
        not isinstance(fmt, str) or format_hint(fmt, field=True) not in FORMATS
    ):
        raise APIError(
            400,
            f"{where}.input_audio.format: unsupported audio format {fmt!r}; use one of "
            f"{', '.join(FORMATS)}",
            param=f"{where}.input_audio.format",
            code="unsupported_audio_format",
        )
    data = spec["data"]
    if data.startswith("data:"):  # a data URL: data:audio/wav;base64,....
        data = data.partition(",")[2]
    if len(data) * 3 / 4 > limit_mb * 1e6 + 4:
        raise APIError(
            400,
            f"{where}.input_audio: over {limit_mb:g} MB of audio (serve.max_chat_audio_mb); "
            "send long recordings to /v1/audio/transcriptions",
            param=f"{where}.input_audio.data",
            code="audio_too_large",
        )
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise APIError(
            400, f"{where}.input_audio.data is not valid base64", param=f"{where}.input_audio.data"
        ) from None
    return raw, format_hint(fmt, field=True) if fmt else None


async def transcribe_parts(request: Request, body: ChatRequest) -> Heard | None:
    """Replace every input_audio part of `body` by its transcript; None when there is none."""
    found = list(_parts(body))
    if not found:
        return None
    cfg = request.app.state.cfg
    speech = sidecars.speech(request, "input_audio")
    heard = Heard()
    for i, j, message, part in found:
        where = f"messages[{i}].content[{j}]"
        if message.role != "user":
            raise APIError(400, f"{where}: input_audio goes in user messages", param=where)
        raw, fmt = _payload(part, where, cfg.max_chat_audio_mb)
        audio = await sidecars.decode_audio(raw, fmt, where, cfg.max_audio_s)
        transcript = await sidecars.on_engine(
            request, lambda a=audio: speech.transcribe(a.samples, language=cfg.stt_language)
        )
        text = f"[audio transcript: {transcript.text}]"
        text = ("\n" if j > 0 else "") + text + ("\n" if j < len(message.content) - 1 else "")
        message.content[j] = {"type": "text", "text": text}
        heard.parts += 1
        heard.seconds += audio.seconds
    return heard


def usage_extra(heard: Heard | None) -> dict:
    """What a response's usage adds for the audio it heard: {audio_seconds}, or nothing."""
    return {} if heard is None else {"audio_seconds": round(heard.seconds, 3)}


def with_usage(response: dict, heard: Heard | None) -> dict:
    if "usage" in response:
        response["usage"].update(usage_extra(heard))
    return response


class HeardChatStream(encode.ChatStream):
    """The chat stream whose usage chunk (stream_options.include_usage) adds audio_seconds."""

    def __init__(self, head: dict, include_usage: bool, heard: Heard):
        super().__init__(head, include_usage)
        self.heard = heard

    def _usage(self, ev) -> list[str]:
        if not self.include_usage:
            return []
        usage = {**encode.usage_of(ev), **usage_extra(self.heard)}
        return [encode.sse({**self.head, "choices": [], "usage": usage})]


def chat_stream(head: dict, include_usage: bool, heard: Heard | None) -> encode.ChatStream:
    if heard is None:
        return encode.ChatStream(head, include_usage)
    return HeardChatStream(head, include_usage, heard)
