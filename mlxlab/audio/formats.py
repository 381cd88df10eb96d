"""A Transcript in OpenAI's response formats: json, text, verbose_json, srt, vtt (pure)."""

from __future__ import annotations

import math

from mlxlab.audio.speech import Transcript

RESPONSE_FORMATS = ("json", "text", "verbose_json", "srt", "vtt")
MEDIA_TYPES = {
    "json": "application/json",
    "verbose_json": "application/json",
    "text": "text/plain; charset=utf-8",
    "srt": "application/x-subrip; charset=utf-8",
    "vtt": "text/vtt; charset=utf-8",
}


def usage(t: Transcript) -> dict:
    """OpenAI's usage for audio billed by duration (whole seconds, rounded up)."""
    return {"type": "duration", "seconds": math.ceil(t.duration)}


def as_json(t: Transcript) -> dict:
    return {"text": t.text, "usage": usage(t)}


def as_verbose_json(t: Transcript, words: bool = False, segments: bool = True) -> dict:
    body = {
        "task": t.task,
        "language": t.language_name,
        "duration": t.duration,
        "text": t.text,
    }
    if segments:
        body["segments"] = [
            {
                "id": s.id,
                "seek": 0,
                "start": s.start,
                "end": s.end,
                "text": s.text,
                "tokens": s.tokens,
                "temperature": s.temperature,
                "avg_logprob": s.avg_logprob,
                "compression_ratio": s.compression_ratio,
                "no_speech_prob": s.no_speech_prob,
            }
            for s in t.segments
        ]
    if words:
        body["words"] = [
            {"word": w["word"].strip(), "start": w["start"], "end": w["end"]} for w in t.words
        ]
    body["usage"] = usage(t)
    return body


def _clock(seconds: float, sep: str) -> str:
    ms = max(0, round(seconds * 1000))
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{sep}{ms:03d}"


def _cues(t: Transcript) -> list[tuple[float, float, str]]:
    cues = [(s.start, max(s.end, s.start), s.text.strip()) for s in t.segments if s.text.strip()]
    if not cues and t.text:
        cues = [(0.0, t.duration, t.text)]
    # A cue's text never holds the cue separator's blank line.
    return [(a, b, " ".join(text.split())) for a, b, text in cues]


def as_srt(t: Transcript) -> str:
    return "".join(
        f"{i}\n{_clock(a, ',')} --> {_clock(b, ',')}\n{text}\n\n"
        for i, (a, b, text) in enumerate(_cues(t), start=1)
    )


def as_vtt(t: Transcript) -> str:
    return "WEBVTT\n\n" + "".join(
        f"{_clock(a, '.')} --> {_clock(b, '.')}\n{text}\n\n" for a, b, text in _cues(t)
    )


def render(t: Transcript, fmt: str, words: bool = False, segments: bool = True) -> dict | str:
    """The body for `fmt`: a dict for json and verbose_json, text otherwise."""
    if fmt == "json":
        return as_json(t)
    if fmt == "verbose_json":
        return as_verbose_json(t, words=words, segments=segments)
    if fmt == "srt":
        return as_srt(t)
    if fmt == "vtt":
        return as_vtt(t)
    if fmt == "text":
        return t.text + "\n"
    raise ValueError(f"response_format must be one of {', '.join(RESPONSE_FORMATS)}")
