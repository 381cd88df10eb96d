"""How a `turn_quotes` adapter's answers use their turns list (experiments/chunk_seg4/turn-quotes.md).

    python scripts/chunk_turns_check.py RUN_DIR [RESULTS_JSONL]

RUN_DIR is a chunk-task run directory (its data/test.cases.json holds the gold); RESULTS_JSONL the
per-case rows an evaluation wrote (default RUN_DIR/eval_tuned.jsonl). For each conversation read
in one window: whether the answer parses, whether its turns list names the shown messages in
order, each user turn's decision (its chunk number moves on, or not) against gold, and whether
the chunks start where the turns' numbers change. An answer in the turn_topics layout (which
the answer grammar also allows) has no numbers and is counted apart. Prints per-case lines and the totals."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path


def at(starts: list[str], prefixes: list[str]) -> list[int]:
    """The message indices of `starts` (uuid prefixes) after the first."""
    return [prefixes.index(p) for p in starts[1:] if p in prefixes]


def main(run: Path, results: Path) -> None:
    cases = {c["id"]: c for c in json.loads((run / "data" / "test.cases.json").read_text())}
    rows = [json.loads(line) for line in results.read_text().splitlines() if line.strip()]
    decisions, single, parsed, topics, listed, follow, moved = Counter(), 0, 0, 0, 0, 0, 0
    for r in rows:
        if r["windows"] != 1:
            continue
        single += 1
        case = cases[r["id"]]
        msgs = [m for m in case["messages"] if isinstance(m.get("text"), str) and m["text"].strip()]
        index = {m["uuid"]: i for i, m in enumerate(msgs)}
        gold = [0] * len(msgs)
        for k, c in enumerate(case["chunks"]):
            for i in range(index[c["start_message_uuid"]], index[c["end_message_uuid"]] + 1):
                gold[i] = k
        try:
            answer = json.loads(r["output"])
            turns = answer["turns"]
        except (ValueError, KeyError, TypeError):
            print(r["id"], "does not parse:", r["output"][:120])
            continue
        parsed += 1
        if not all(isinstance(t, list) and t and isinstance(t[-1], int) for t in turns):
            topics += 1  # the turn_topics layout (the grammar allows both): no numbers to read
            print(r["id"], "turns in the turn_topics layout")
            continue
        prefixes = [m["uuid"][:8] for m in msgs]
        listed += [t[0] for t in turns] == prefixes
        number = {t[0]: t[-1] for t in turns}
        before = None
        for i, m in enumerate(msgs):
            k = number.get(prefixes[i])
            if k is None:
                continue
            if m.get("sender") != "assistant" and i > 0 and before is not None:
                decisions[(gold[i] != gold[i - 1], k != before)] += 1
            before = k
        turn_starts = [t[0] for j, t in enumerate(turns) if j == 0 or t[-1] != turns[j - 1][-1]]
        chunk_starts = [c["start_message_uuid"][:8] for c in answer.get("chunks", [])]
        if len(turn_starts) > 1:  # the numbers move on somewhere
            moved += 1
            follow += turn_starts == chunk_starts

        print(
            r["id"],
            "gold starts",
            [i for i in range(1, len(msgs)) if gold[i] != gold[i - 1]],
            "turn starts",
            at(turn_starts, prefixes),
            "chunk starts",
            at(chunk_starts, prefixes),
            "boundary F1",
            r["boundary_f1"],
        )
    print(
        f"one-window conversations {single}: {parsed} parse, {topics} of them in the turn_topics "
        f"layout; of the rest {listed} list the messages in order, and in {follow} of the "
        f"{moved} whose numbers move on the chunks start where they do"
    )
    tp, fn, fp = decisions[(True, True)], decisions[(True, False)], decisions[(False, True)]
    print(
        f"user turns: {sum(decisions.values())}; a shift said where one is {tp} of {tp + fn}, "
        f"where none is {fp} of {fp + decisions[(False, False)]}"
    )


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__.split("\n\n")[1].strip())
    run = Path(sys.argv[1])
    main(run, Path(sys.argv[2]) if len(sys.argv) == 3 else run / "eval_tuned.jsonl")
