"""Draw natural ShareGPT conversations for hand annotation (the chunk task's natural sets).

    python scripts/chunk_candidates.py OUT_DIR [--count 240] [--per-file 30] [--seed 0]
        [--min-messages 6] [--exclude ANNOTATIONS.json ...]

From the conversations the chunk data reads (`sharegpt.load_conversations`: cleaned, re-joined,
filtered, deduplicated), of the training split only (never dev, valid, test or an annotated one),
it draws `count` by message count, in bins that follow the issue's real exports (4-74 messages,
median ~12): a quarter of 6-9 messages, 40% of 10-19, a quarter of 20-39, a tenth of 40-74
(`--min-messages` drops the bins below it and shares the count among the rest; longer
conversations change subject more often), skipping the ids of `--exclude` files. It
writes OUT_DIR/candidates.json ({id: {parts, messages}}: what an annotation file holds besides
the chunks) and OUT_DIR/batch_NN.md, the texts to read, each message under its index (assistant
messages shortened to their opening and closing lines: enough to see the subject). The texts stay
local: ShareGPT carries no licence, so only ids, indices and labels are ever committed
(mlxlab/tasks/chunk/annotations/).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from mlxlab.tasks.chunk.sharegpt import load_conversations

BINS = ((6, 9, 0.25), (10, 19, 0.40), (20, 39, 0.25), (40, 74, 0.10))


def shorten(text: str, sender: str) -> str:
    if sender == "user":
        return text if len(text) <= 1500 else text[:1200] + "\n[...]\n" + text[-250:]
    return text if len(text) <= 700 else text[:500] + "\n[...]\n" + text[-150:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--count", type=int, default=240)
    ap.add_argument("--per-file", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min-messages", type=int, default=6)
    ap.add_argument("--exclude", type=Path, nargs="*", default=[])
    args = ap.parse_args()
    repo = Path(__file__).resolve().parents[1]
    if args.out.resolve().is_relative_to(repo):
        raise SystemExit(f"{args.out}: outside the repository, please (the texts carry no licence)")
    skip = set()
    for path in args.exclude:
        skip |= set(json.loads(path.read_text())["conversations"])
    convs = [c for c in load_conversations() if c.split == "train" and c.id not in skip]
    rng = random.Random(f"chunk-candidates:{args.seed}")
    bins = [(max(lo, args.min_messages), hi, w) for lo, hi, w in BINS if hi >= args.min_messages]
    total = sum(w for _, _, w in bins)
    chosen = []
    for lo, hi, share in bins:
        pool = sorted((c for c in convs if lo <= len(c.messages) <= hi), key=lambda c: c.id)
        want = round(args.count * share / total)
        picked = rng.sample(pool, min(len(pool), want))
        chosen += picked
        print(f"{lo}-{hi} messages: {len(picked)} of {want} wanted ({len(pool)} there)")
    rng.shuffle(chosen)
    args.out.mkdir(parents=True, exist_ok=True)
    index = {c.id: {"parts": list(c.parts), "messages": len(c.messages)} for c in chosen}
    (args.out / "candidates.json").write_text(json.dumps(index, indent=1) + "\n")
    for k in range(0, len(chosen), args.per_file):
        lines = []
        for c in chosen[k : k + args.per_file]:
            lines.append(f"\n\n######## CONVERSATION {c.id} ({len(c.messages)} messages)\n")
            for i, m in enumerate(c.messages):
                lines.append(f"\n=== [{i}] {m.sender}\n{shorten(m.text, m.sender)}\n")
        (args.out / f"batch_{k // args.per_file:02d}.md").write_text("".join(lines))
    print(f"{len(chosen)} conversations of {len(convs)} in the training split -> {args.out}")


if __name__ == "__main__":
    main()
