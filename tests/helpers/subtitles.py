"""Strict SRT and WebVTT parsers for tests: (start s, end s, text) cues, or AssertionError."""

from __future__ import annotations

import re

SRT_TIME = r"(\d{2}):(\d{2}):(\d{2}),(\d{3})"
VTT_TIME = r"(\d{2}):(\d{2}):(\d{2})\.(\d{3})"


def _seconds(h, m, s, ms) -> float:
    return int(h) * 3600 + int(m) * 60 + int(s) + int(ms) / 1000


def parse_srt(text: str) -> list[tuple[float, float, str]]:
    blocks = [b for b in text.strip("\n").split("\n\n") if b]
    cues = []
    for i, block in enumerate(blocks, start=1):
        lines = block.split("\n")
        assert lines[0] == str(i), f"cue {i} is numbered {lines[0]!r}"
        m = re.fullmatch(f"{SRT_TIME} --> {SRT_TIME}", lines[1])
        assert m, f"cue {i}: bad timing line {lines[1]!r}"
        start, end = _seconds(*m.groups()[:4]), _seconds(*m.groups()[4:])
        assert 0 <= start <= end, (start, end)
        assert len(lines) > 2 and all(lines[2:]), f"cue {i} has no text"
        cues.append((start, end, " ".join(lines[2:])))
    assert text.endswith("\n")
    return cues


def parse_vtt(text: str) -> list[tuple[float, float, str]]:
    assert text.startswith("WEBVTT\n\n"), text[:20]
    cues = []
    for block in [b for b in text[len("WEBVTT\n\n") :].strip("\n").split("\n\n") if b]:
        lines = block.split("\n")
        m = re.fullmatch(f"{VTT_TIME} --> {VTT_TIME}", lines[0])
        assert m, f"bad timing line {lines[0]!r}"
        start, end = _seconds(*m.groups()[:4]), _seconds(*m.groups()[4:])
        assert 0 <= start <= end
        assert len(lines) > 1 and all(lines[1:])
        cues.append((start, end, " ".join(lines[1:])))
    return cues
