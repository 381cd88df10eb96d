"""The topic-shift detector's boundary F1 per rule, on the gold chunks of chunk cases.

    python -m mlxlab data chunk out=/tmp/v80 valid=80 'train_topic_weights=[0.3,0.3,0.2,0.1,0.1]' window_chars=3600
    python scripts/shift_rule.py /tmp/v80:valid experiments/chunk_seg4/offdomain_cases.json experiments/chunk_seg4/offdomain_long_cases.json
    python scripts/shift_rule.py /tmp/v80:test --at 0.15 0.6 0.3

Each source is a JSON file of cases with gold or DIR:SPLIT of a chunk dataset. No language model:
each case's messages are embedded once (mlxlab/tasks/chunk/shifts.py), then every rule (drop, cap,
floor: `Rule`) cuts the same vectors; the grid also has the fixed thresholds (drop 2: the median
plays no part, cap = floor = T). Prints, per rule, the mean boundary F1 per source (the chunk
report's metric: a one-chunk answer to a one-topic case scores 1) and the chunks per case, then
the rule with the best mean F1 over the sources. Choose on validation builds and realistic chats,
never on the test split. `--at DROP CAP FLOOR` prints that rule only.
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import numpy as np


def load(source: str) -> list[dict]:
    from mlxlab.tasks.chunk.config import EvalSettings
    from mlxlab.tasks.chunk.dataset import read_split

    path, _, split = source.partition(":")
    return read_split(Path(path), EvalSettings(split=split or "test"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("sources", nargs="+", help="JSON files of cases with gold, or DIR:SPLIT")
    ap.add_argument("--model", default="all-minilm-l6-v2")
    ap.add_argument("--at", type=float, nargs=3, default=None, metavar=("DROP", "CAP", "FLOOR"))
    ap.add_argument(
        "--similarities",
        action="store_true",
        help="also print each source's exchange similarities within a gold chunk and at a gold start",
    )
    args = ap.parse_args()

    from mlxlab.embed.model import Embedder
    from mlxlab.tasks.chunk.prompt import shown
    from mlxlab.tasks.chunk.scoring import boundary_f1, case_gold_spans, spans_of
    from mlxlab.tasks.chunk.shifts import (
        Rule,
        exchanges,
        message_vectors,
        similarities,
        starts_from_vectors,
    )

    embedder = Embedder(args.model)
    sources = {}
    for source in args.sources:
        rows = []
        for case in load(source):
            msgs, gold = shown(case["messages"]), case_gold_spans(case)
            if not msgs or gold is None:
                continue
            vectors = message_vectors(embedder, msgs)
            rows.append((exchanges(msgs), vectors, gold, len(msgs)))
        name = Path(source).name
        sources[name] = rows
        print(
            f"{name}: {len(rows)} cases with gold, {sum(len(r[2]) > 1 for r in rows)} several-topic"
        )
    if args.similarities:
        print(
            "\n| source | within a topic: 5th / 50th percentile | at a topic change: 50th / 95th |"
        )
        print("|---|---|---|")
        for name, rows in sources.items():
            within, shift = [], []
            for groups, vectors, gold, _ in rows:
                starts = {a for a, _ in gold}
                for j, s in enumerate(similarities(groups, vectors)):
                    (shift if groups[j + 1][0] in starts else within).append(s)
            w = np.percentile(within, [5, 50]) if within else [np.nan] * 2
            t = np.percentile(shift, [50, 95]) if shift else [np.nan] * 2
            print(f"| {name} | {w[0]:.2f} / {w[1]:.2f} | {t[0]:.2f} / {t[1]:.2f} |")
    if args.at:
        rules = [Rule(*args.at)]
    else:
        grid = np.round(np.arange(0.35, 0.651, 0.05), 3)
        rules = [Rule(2.0, float(t), float(t)) for t in grid]  # fixed thresholds
        drops, caps, floors = (0.1, 0.15, 0.2, 0.25), (0.5, 0.6, 0.7), (0.2, 0.3)
        rules += [Rule(*x) for x in itertools.product(drops, caps, floors)]
    print(
        "\n| drop | cap | floor | "
        + " | ".join(f"{s} F1 | chunks" for s in sources)
        + " | mean F1 |"
    )
    print("|---|---|---|" + "---|---|" * len(sources) + "---|")
    best = None
    for rule in rules:
        cells, means = [], []
        for rows in sources.values():
            f1s, chunks = [], []
            for groups, vectors, gold, n in rows:
                starts = starts_from_vectors(groups, vectors, rule)
                f1s.append(boundary_f1(gold, spans_of(starts, n)))
                chunks.append(len(starts))
            means.append(float(np.mean(f1s)))
            cells.append(f"{means[-1]:.3f} | {np.mean(chunks):.2f}")
        mean = float(np.mean(means))
        if best is None or mean > best[1]:
            best = (rule, mean)
        print(
            f"| {rule.drop:g} | {rule.cap:g} | {rule.floor:g} | "
            + " | ".join(cells)
            + f" | {mean:.3f} |"
        )
    print(f"\nbest mean F1 {best[1]:.3f}: {best[0]!r}")


if __name__ == "__main__":
    main()
