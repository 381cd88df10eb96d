"""Score a chunk evaluation's saved answers again, without decoding: the saved window answers of
each case (`window_outputs`, `window_refused`) merged and scored by the current code.

    python scripts/chunk_rescore.py RESULTS_JSONL CASES [--train DIR] [--budget 1800]
        [--overlap 2] [--window-messages 4] [--shifts all-minilm-l6-v2] [--places]
    python scripts/chunk_rescore.py --committed [--write]

RESULTS_JSONL holds the per-case rows an evaluation wrote (`eval chunk out=`, a task run's
eval_tuned.jsonl); CASES the conversations it read (a JSON file of cases, or DIR:SPLIT of a
chunk dataset). The windows are planned again as the evaluation planned them (`plan_windows`
with the budget, overlap and message cap it used: `--window-messages 0` for an adapter of whole
conversations), so the saved answers line up with them. `--train DIR` (a dataset directory)
adds the memorized-label share; `--shifts MODEL` re-runs the topic-shift detector for a
shift-boundaries decode's rows (`--shifts saved`: the starts its windows' answers were held to). Prints the summary; `--places` also prints, place by place,
where a window's answer starts a chunk against where gold does (found, missed, false split) and
the windows whose answers stop short.

`--committed` re-scores the per-case answers committed under experiments/chunk_seg4 (the
chunk_seg4 dataset rebuilt in a temporary directory; gemma3-270m's tokenizer; the shift-boundaries
files' starts read back from their answers) and compares every figure with experiments/chunk_seg4/rescored.json,
the figures the code before the chunk package gave (b39fbdc): a refactor must not move them.
`--write` rewrites that file instead.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import mlxlab  # noqa: F401  (before mlx.core)

REPO = Path(__file__).resolve().parents[1]
EXP = REPO / "experiments" / "chunk_seg4"
COMMITTED = {  # file: (cases, budget, window messages (0: whole conversations), shifts)
    "test_eval.300.constrained.jsonl": ("test", 1800, 4, False),
    "cover_false_eval.constrained.jsonl": ("test", 1800, 4, False),
    "valid_eval.300.jsonl": ("valid", 1800, 4, False),
    "valid_eval.300.constrained.jsonl": ("valid", 1800, 4, False),
    "offdomain_long_eval.300.jsonl": ("offdomain_long_cases.json", 1800, 4, False),
    "offdomain_long_eval.300.constrained.jsonl": ("offdomain_long_cases.json", 1800, 4, False),
    "shifts_test_eval.jsonl": ("test", 1800, 0, True),
    "shifts_offdomain_eval.jsonl": (
        "offdomain_cases.json+offdomain_long_cases.json",
        1800,
        0,
        True,
    ),
}
# chunk_seg4's data settings (configs/exp/chunk_seg4.yaml)
SEG4_DATA = ["train_topic_weights=[0.3,0.3,0.2,0.1,0.1]", "window_chars=3600", "window_messages=4"]


def read_cases(source: str) -> list[dict]:
    from mlxlab.tasks.chunk.config import EvalSettings
    from mlxlab.tasks.chunk.dataset import read_split

    path, _, split = source.partition(":")
    return read_split(Path(path), EvalSettings(split=split or "test"))


def rescore(rows, cases, tokenizer, budget, overlap, cap, train_labels=None, shifts=""):
    """The rows `score_windows` gives for the saved answers, and the windows they were read in."""
    from mlxlab.tasks.chunk.evaluate import score_windows
    from mlxlab.tasks.chunk.windows import plan_windows

    cases = cases[: len(rows)]
    ids = [r["id"] for r in rows]
    if ids != [c.get("id") for c in cases]:
        sys.exit(f"the rows' ids are not the cases': {ids[:3]}... against the cases' own")
    windows = plan_windows(cases, tokenizer, budget, overlap, cap or None)
    texts, refused = [], []
    for i, row in enumerate(rows):
        outs = row.get("window_outputs") or [row["output"]]
        planned = [w for w in windows if w.case == i]
        if len(planned) != len(outs):
            sys.exit(f"{row['id']}: {len(planned)} windows planned, {len(outs)} answers saved")
        texts += outs
        refused += row.get("window_refused") or [[] for _ in outs]
    starts = None
    if shifts == "saved":  # the starts the windows were decoded under: their answers' own
        starts = saved_starts(cases, windows, texts)
    elif shifts:
        from mlxlab.tasks.chunk.shifts import chunk_starts

        starts = chunk_starts(cases, shifts)
    constrained = any("window_refused" in r for r in rows)
    new = score_windows(
        cases, windows, texts, train_labels, starts, refused if constrained else None
    )
    return new, windows


def saved_starts(cases, windows, texts) -> list[list[int]]:
    """A shift-boundaries decode's fixed chunk starts, read back from its windows' answers (the
    grammar held each window's chunks to them: `window_starts`): per case, every chunk start an
    answer puts after its window's first message (which every answer starts a chunk at), and
    message 0."""
    from mlxlab.tasks.chunk.prompt import conversation_uuid
    from mlxlab.tasks.chunk.windows import window_chunks

    out = [{0} for _ in cases]
    for w, text in zip(windows, texts, strict=True):
        chunks, _, _ = window_chunks(text, w.uuids, conversation_uuid(cases[w.case]))
        out[w.case] |= {s + w.first for s, _ in chunks if s > 0}
    return [sorted(s) for s in out]


def places(rows: list[dict], cases: list[dict], windows) -> dict:
    """Place by place (every message but a conversation's first, in the window that owns it):
    whether a window's answer starts a chunk there against whether gold does; and the windows
    whose answers stop short of their last message inside what they own."""
    from mlxlab.tasks.chunk.prompt import conversation_uuid, shown
    from mlxlab.tasks.chunk.windows import window_chunks, window_cuts

    counts = dict.fromkeys(
        ("found", "missed", "false split", "kept", "short, at a topic start", "short, elsewhere"), 0
    )
    for i, (case, row) in enumerate(zip(cases, rows, strict=False)):
        ws = [w for w in windows if w.case == i]
        outs = row.get("window_outputs") or [row["output"]]
        uuids = [m["uuid"] for m in shown(case["messages"])]
        gold = {uuids.index(c["start_message_uuid"]) for c in case.get("chunks") or []}
        cuts = window_cuts(ws, len(uuids))
        for k, (w, text) in enumerate(zip(ws, outs, strict=True)):
            starts, _, gap = window_chunks(text, w.uuids, conversation_uuid(case))
            split = {s + w.first for s, _ in starts}
            if gap is not None and cuts[k] < gap + w.first < cuts[k + 1]:
                short = "short, at a topic start" if gap + w.first in gold else "short, elsewhere"
                counts[short] += 1
            for m in range(max(cuts[k], 1), cuts[k + 1]):
                g, p = m in gold, m in split
                kind = ("found" if p else "missed") if g else ("false split" if p else "kept")
                counts[kind] += 1
                if g or p:
                    print(
                        f"{row['id']} message {m} (window {k}, its message {m - w.first}): {kind}"
                    )
    return counts


def figures(rows: list[dict]) -> dict:
    from mlxlab.tasks.chunk.metrics import summarize

    out = summarize(rows)
    out["outputs"] = [r["output"] for r in rows]
    return out


def committed(write: bool) -> None:
    from mlxlab.cli import compose
    from mlxlab.models.zoo import load
    from mlxlab.tasks.chunk.dataset import training_labels, write_dataset

    _, tokenizer = load("gemma3-270m", lazy=True)
    cfg = compose("data", SEG4_DATA)
    with tempfile.TemporaryDirectory() as tmp:
        data = write_dataset(Path(tmp) / "data", cfg.data())
        labels = training_labels(data)
        got = {}
        for name, (source, budget, cap, shifts) in COMMITTED.items():
            if source in ("test", "valid"):
                cases = read_cases(f"{data}:{source}")
            else:
                cases = [c for part in source.split("+") for c in read_cases(str(EXP / part))]
            rows = [json.loads(x) for x in (EXP / name).read_text().splitlines() if x.strip()]
            new, _ = rescore(
                rows, cases, tokenizer, budget, 2, cap, labels, "saved" if shifts else ""
            )
            got[name] = figures(new)
    path = EXP / "rescored.json"
    if write:
        path.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
        print(f"wrote {path}")
        return
    want = json.loads(path.read_text())
    bad = [  # every figure the file holds (a figure added since is not compared)
        f"{name}: {k} {want[name].get(k)!r} -> {got[name].get(k)!r}"
        for name in want
        for k in want[name]
        if want[name].get(k) != got.get(name, {}).get(k)
    ]
    for name, fig in got.items():
        short = {k: round(v, 4) for k, v in fig.items() if isinstance(v, float)}
        print(name, json.dumps(short))
    if bad:
        sys.exit("figures moved:\n" + "\n".join(b[:300] for b in bad))
    print(f"every figure of {len(got)} files as in {path.name}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", nargs="?")
    ap.add_argument("cases", nargs="?")
    ap.add_argument("--train", help="a dataset directory: the memorized-label share")
    ap.add_argument("--budget", type=int, default=1800)
    ap.add_argument("--overlap", type=int, default=2)
    ap.add_argument("--window-messages", type=int, default=4)
    ap.add_argument("--shifts", default="")
    ap.add_argument("--places", action="store_true")
    ap.add_argument("--model", default="gemma3-270m", help="whose tokenizer planned the windows")
    ap.add_argument("--committed", action="store_true")
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    if args.committed:
        return committed(args.write)
    if not (args.results and args.cases):
        ap.error("RESULTS_JSONL and CASES (or --committed)")
    from mlxlab.models.zoo import load
    from mlxlab.tasks.chunk.dataset import training_labels

    _, tokenizer = load(args.model, lazy=True)
    rows = [json.loads(x) for x in Path(args.results).read_text().splitlines() if x.strip()]
    cases = read_cases(args.cases)
    labels = training_labels(args.train) if args.train else None
    new, windows = rescore(
        rows, cases, tokenizer, args.budget, args.overlap, args.window_messages, labels, args.shifts
    )
    if args.places:
        print(json.dumps(places(rows, cases, windows)))
    fig = figures(new)
    print(json.dumps({k: round(v, 4) for k, v in fig.items() if isinstance(v, float)}))


if __name__ == "__main__":
    main()
