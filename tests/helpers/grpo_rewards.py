"""Reward functions for the GRPO tests, named as a config names one (`module:function`)."""

from __future__ import annotations


def vowels(completions: list[str], records: list[dict]) -> list[float]:
    """The share of a completion's characters that are the record's `letter` (default "a"):
    varies between a tiny model's random completions, so groups have advantages."""
    out = []
    for text, record in zip(completions, records, strict=True):
        letter = record.get("letter", "a")
        out.append(text.count(letter) / max(len(text), 1))
    return out


def wrong_length(completions, records):
    return [0.0]


def not_finite(completions, records):
    return [float("nan")] * len(completions)


def raises(completions, records):
    raise RuntimeError("scorer broke")


def needs_letter(completions, records):
    return [1.0] * len(completions)


def _check(records):
    missing = [i for i, r in enumerate(records) if "letter" not in r]
    return f"record {missing[0] + 1} has no 'letter'" if missing else None


needs_letter.check = _check
