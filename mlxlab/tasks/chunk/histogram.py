"""Counts of values in bins, the dataset's and the joins' statistics share it."""

from __future__ import annotations

from collections import Counter


def histogram(values, edges) -> list[tuple[str, int]]:
    """[(bin, count)] of `values` over `edges` (bins [a, b))."""
    counts = Counter()
    for v in values:
        for a, b in zip(edges, edges[1:], strict=False):
            if a <= v < b:
                counts[(a, b)] += 1
                break
    out = []
    for a, b in zip(edges, edges[1:], strict=False):
        name = f"{a}" if b == a + 1 else (f">= {a}" if b >= 10**8 else f"{a}-{b - 1}")
        out.append((name, counts[(a, b)]))
    return out
