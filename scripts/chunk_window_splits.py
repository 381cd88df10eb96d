"""Where a windowed evaluation's answers split, place by place
(experiments/chunk_seg4/local-windows.md).

    python scripts/chunk_window_splits.py RUN_DIR [RESULTS_JSONL [CASES_JSON]]

RUN_DIR is a chunk-task run directory (its data/test.cases.json holds the gold, its config.yaml
the window settings); RESULTS_JSONL the per-case rows an evaluation wrote (default
RUN_DIR/eval_tuned.jsonl), CASES_JSON the conversations it read (default the run's test split).
It plans the windows again as the evaluation did (`plan_windows`, the run's max_prompt_tokens,
window_overlap and window_messages) and, for every message a window owns
as `merge_windows` assigns them (but a conversation's first), whether a chunk of that window's
own answer starts there, against whether a gold chunk does. Prints the places where either
happens and the counts: true shifts found, missed, splits where no topic starts, and the rest;
and the windows whose answers stop short of their last message inside what they own
(`window_chunks`' gap), right before a gold topic start or elsewhere.
Then it merges and scores the saved window answers again with the current code
(`score_windows`, no decoding), with and without `local` (`merge_local`), and prints those summaries
beside the one the rows hold, so a change to `merge_windows` can be measured on a run's
answers; a constrained decode's windows that the grammar overruled (`window_refused`) are merged
as unread unless the run set `read_overruled`. The place-by-place counts read every answer as
written."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from mlxlab.eval.cli import run_data, trained_window

import mlxlab  # noqa: F401  (before mlx.core)
from mlxlab.data import chunk as data
from mlxlab.eval import chunk as ev
from mlxlab.models.zoo import load


def main(run: Path, results: Path, cases_path: Path) -> None:
    import yaml

    saved = yaml.safe_load((run / "config.yaml").read_text())
    ev_cfg = saved["task"]["eval"]
    cases = json.loads(cases_path.read_text())
    rows = [json.loads(line) for line in results.read_text().splitlines() if line.strip()]
    _, tokenizer = load(saved["model"], lazy=True)
    budget = ev_cfg.get("max_prompt_tokens") or trained_window(run, tokenizer)
    data_dir = run_data(run) or run / "data"
    cap = ev_cfg.get("window_messages") or ev.built_window_messages(data_dir)
    plans = [
        ev.plan_windows(
            cases,
            tokenizer,
            budget,
            ev_cfg.get("window_overlap", 2),
            cap or ev.WINDOW_MESSAGES,
            fill,
        )
        for fill in ([True, False] if cap else [False])
    ]

    def planned(i: int, row: dict) -> list:  # the plan that gave the saved answers (a run
        for plan in plans:  # evaluated before windows were filled was planned without it)
            ws = [w for w in plan if w.case == i]
            if sum(len(w.prompt) for w in ws) == row.get("prompt_tokens"):
                return ws
        return [w for w in plans[0] if w.case == i]

    windows = [w for i, row in enumerate(rows) for w in planned(i, row)]
    counts = {"found": 0, "missed": 0, "false split": 0, "kept": 0}
    counts |= {"short, at a topic start": 0, "short, elsewhere": 0}
    for i, (case, row) in enumerate(zip(cases, rows, strict=True)):
        ws = [w for w in windows if w.case == i]
        outs = row.get("window_outputs") or [row["output"]]
        assert len(ws) == len(outs), f"{row['id']}: {len(ws)} windows planned, {len(outs)} answers"
        uuids = [m["uuid"] for m in data.shown(case["messages"])]
        gold = {uuids.index(c["start_message_uuid"]) for c in case["chunks"]}
        cuts = ev.window_cuts(ws, len(uuids))
        for k, (w, text) in enumerate(zip(ws, outs, strict=True)):
            starts, _, gap = ev.window_chunks(text, w.uuids, data.conversation_uuid(case))
            split = {s + w.first for s, _ in starts}
            if gap is not None and cuts[k] < gap + w.first < cuts[k + 1]:  # a short answer
                counts[
                    "short, at a topic start" if gap + w.first in gold else "short, elsewhere"
                ] += 1
            for m in range(max(cuts[k], 1), cuts[k + 1]):
                g, p = m in gold, m in split
                kind = ("found" if p else "missed") if g else ("false split" if p else "kept")
                counts[kind] += 1
                if g or p:
                    print(
                        f"{row['id']} message {m} (window {k}, its message {m - w.first}): {kind}"
                    )
    print(json.dumps(counts))
    texts = [t for row in rows for t in row.get("window_outputs") or [row["output"]]]
    assert len(texts) == len(windows)
    refused = None  # a constrained decode's: where the grammar overruled each window
    if any("window_refused" in row for row in rows):
        refused = [
            x
            for i, row in enumerate(rows)
            for x in row.get("window_refused") or [[]] * len(planned(i, row))
        ]
    overruled = bool(ev_cfg.get("read_overruled"))
    labels = ev.training_labels(data_dir)
    keys = ("ref", "wellformed", "boundary_f1", "boundary_f1_multi", "exact_match", "label_f1")
    for name, summary in (
        ("saved", ev.summarize(rows)),
        (
            "merged again",
            ev.summarize(
                ev.score_windows(cases, windows, texts, labels, None, False, refused, overruled)
            ),
        ),
        (
            "merged again, local",
            ev.summarize(
                ev.score_windows(cases, windows, texts, labels, None, True, refused, overruled)
            ),
        ),
    ):
        print(name, json.dumps({k: round(summary[k], 3) for k in keys if k in summary}))


if __name__ == "__main__":
    run_dir = Path(sys.argv[1])
    main(
        run_dir,
        Path(sys.argv[2]) if len(sys.argv) > 2 else run_dir / "eval_tuned.jsonl",
        Path(sys.argv[3]) if len(sys.argv) > 3 else run_dir / "data" / "test.cases.json",
    )
