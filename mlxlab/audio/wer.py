"""Word error rate: (substitutions + deletions + insertions) / reference words, after a light
normalization (case, punctuation, hyphens and apostrophes; numbers stay as written)."""

from __future__ import annotations

import re
import unicodedata


def words(text: str) -> list[str]:
    text = unicodedata.normalize("NFKC", text).lower().replace("-", " ")
    text = re.sub(r"[\u2019']", "", text)
    return re.findall(r"[^\W_]+", text)


def edit_distance(ref: list[str], hyp: list[str]) -> int:
    prev = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, start=1):
        cur = [i] + [0] * len(hyp)
        for j, h in enumerate(hyp, start=1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (r != h))
        prev = cur
    return prev[-1]


def wer(reference: str, hypothesis: str) -> float:
    ref, hyp = words(reference), words(hypothesis)
    if not ref:
        return 0.0 if not hyp else 1.0
    return edit_distance(ref, hyp) / len(ref)
