"""The topic-shift detector (mlxlab/eval/shifts.py) and the decode that takes its boundaries
(`eval chunk shifts=MODEL`): exchanges, cuts from hand-made vectors, the fixed-boundaries
grammar, windows, the extra report row. The embedding model here is tiny-bert (random weights:
only the detector's algebra and plumbing are checked; what it finds with the real
all-minilm-l6-v2 is in experiments/chunk_seg4/topic-shifts.md)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mlxlab.errors import UserError
from mlxlab.tasks.chunk import (
    dataset,
    metrics,
    report,
    scoring,
    shifts,
)
from mlxlab.tasks.chunk import evaluate as ev
from mlxlab.tasks.chunk import grammar as ag
from mlxlab.tasks.chunk import prompt as pr
from mlxlab.tasks.chunk import windows as win
from mlxlab.tasks.chunk.config import ChunkDataConfig, EvalSettings
from tests.test_chunk_task import GOLD, U, _allows


def _msgs(senders: str) -> list[dict]:
    names = {"u": "user", "a": "assistant", "h": "human"}
    return [{"uuid": f"m{i}", "sender": names[s], "text": "x"} for i, s in enumerate(senders)]


def test_exchanges_group_a_question_with_its_answers():
    assert shifts.exchanges(_msgs("uaua")) == [[0, 1], [2, 3]]
    assert shifts.exchanges(_msgs("uaaua")) == [[0, 1, 2], [3, 4]]
    assert shifts.exchanges(_msgs("aauau")) == [[0, 1, 2, 3], [4]]  # a greeting joins the first
    assert shifts.exchanges(_msgs("uuah")) == [[0], [1, 2], [3]]  # "human" asks too
    assert shifts.exchanges(_msgs("aa")) == [[0, 1]]
    assert shifts.exchanges([]) == []


def _unit(angle: float) -> np.ndarray:
    return np.array([np.cos(angle), np.sin(angle)], np.float32)


def test_a_chunk_starts_where_an_exchange_drifts_from_the_one_before():
    """An exchange starts a chunk when its cosine with the one before is below the floor, or
    below both the cap and the conversation's median less the drop."""
    groups = shifts.exchanges(_msgs("uauauaua"))
    x, near, y = _unit(0.0), _unit(0.3), _unit(1.2)  # cos(x, near) .955, cos(near, y) .62
    # similarities: .955 (x -> near), .62 (near -> y), .36 (y -> x); median .62
    vectors = np.stack([x, x, near, near, y, y, x, x])
    rule = shifts.Rule(drop=0.15, cap=0.6, floor=0.3)
    assert shifts.starts_from_vectors(groups, vectors, rule) == [0, 6]  # .36 < min(.6, .47)
    assert shifts.starts_from_vectors(groups, vectors, shifts.Rule(2.0, 1.0, 0.65)) == [0, 4, 6]
    assert shifts.starts_from_vectors(groups, vectors, shifts.Rule(2.0, 1.0, 0.4)) == [0, 6]
    assert shifts.starts_from_vectors(groups, vectors, shifts.Rule(2.0, 1.0, -1.0)) == [0]
    assert shifts.starts_from_vectors(groups, vectors, shifts.Rule(0.0, 1.0, 1.0)) == [0, 2, 4, 6]
    # a topic change in a conversation of alike exchanges: the median moves the cut up to cap
    alike = np.stack([x, x, x, x, near, near, near, near])
    assert shifts.starts_from_vectors(groups, alike, shifts.Rule(0.02, 0.99, 0.3)) == [0, 4]
    assert shifts.starts_from_vectors(groups, alike, rule) == [0]  # .955 is above the cap
    assert shifts.starts_from_vectors([], np.zeros((0, 2)), rule) == []
    assert shifts.starts_from_vectors([[0, 1]], np.stack([x, y]), rule) == [0]
    # one exchange after the first: its similarity is the median, only the floor cuts
    two = shifts.exchanges(_msgs("uaua"))
    assert shifts.starts_from_vectors(two, np.stack([x, x, y, y]), rule) == [0]
    assert shifts.starts_from_vectors(two, np.stack([x, x, _unit(1.5), _unit(1.5)]), rule) == [0, 2]
    # an exchange is the mean of its messages: one far answer among near ones does not cut
    groups = shifts.exchanges(_msgs("uaaaua"))
    far = _unit(1.57)
    assert shifts.starts_from_vectors(groups, np.stack([x, x, x, far, x, x]), rule) == [0]
    assert "below 0.3, or below both 0.6 and the conversation's median less 0.15" in str(rule)


def test_chunk_starts_with_an_embedding_model(tiny_dir):
    tiny_dir("bert")
    cases = [
        {"messages": _msgs("uaua")},
        {"messages": [{"uuid": "e", "sender": "user", "text": "  "}]},  # nothing shown
        {"messages": [{"uuid": "h", "sender": "user", "text": ""}, *_msgs("ua")]},
    ]
    for m, text in zip(cases[0]["messages"], ["cats", "cats purr", "tax law", "tax"], strict=True):
        m["text"] = text
    never, always = shifts.Rule(2.0, -1.0, -1.0), shifts.Rule(0.0, 1.0, 1.0)
    assert shifts.chunk_starts(cases, "tiny-bert", never) == [[0], [], [0]]
    assert shifts.chunk_starts(cases, "tiny-bert", always) == [[0, 2], [], [0]]
    with pytest.raises(UserError, match="not an embedding model"):
        shifts.chunk_starts(cases, "tiny-gemma3")


def test_the_fixed_boundaries_grammar_allows_those_chunks_only(tiny_dir):
    from mlx_lm import load

    from mlxlab import grammar as G

    tokenizer = load(str(tiny_dir("gemma3")))[1]
    two = G.lark(ag.answer_grammar(U, fixed=[0, 2]), "fixed at 0, 2")
    relabelled = [{**GOLD[0], "label": "Anything the model says"}, GOLD[1]]
    for chunks in (GOLD, relabelled):
        assert _allows(two, tokenizer, pr.answer(chunks))
    one = [{"label": "One topic throughout", "start_message_uuid": U[0], "end_message_uuid": U[3]}]
    moved = [{**GOLD[0], "end_message_uuid": U[2]}, {**GOLD[1], "start_message_uuid": U[3]}]
    for chunks in (one, moved, [GOLD[0]], [{**GOLD[0], "label": "Assert"}, GOLD[1]]):
        assert not _allows(two, tokenizer, pr.answer(chunks)), chunks
    whole = G.lark(ag.answer_grammar(U, fixed=[0]), "one chunk")
    assert _allows(whole, tokenizer, pr.answer(one))
    assert not _allows(whole, tokenizer, pr.answer(GOLD))
    for bad in ([1], [0, 0, 2], [0, 4], [2, 0]):
        with pytest.raises(AssertionError):
            ag.answer_grammar(U, fixed=bad)


def test_a_windowed_case_s_fixed_starts_are_named_by_the_windows_that_own_them():
    """fixed_labels: each fixed start called as the window that owns it calls its chunk there;
    where that window cannot be read, as the nearest window that covers it and answered; None
    where none did."""
    uuids = [f"{i:08d}-0000-4000-8000-000000000000" for i in range(10)]
    ws = [win.Window(0, a, a + 3, uuids[a : a + 4], []) for a in (0, 2, 4, 6)]

    def answer(*chunks):
        return json.dumps(
            {"chunks": [{"label": x, "start_message_uuid": uuids[a], "end_message_uuid": uuids[b]}
                        for a, b, x in chunks]}
        )  # fmt: skip

    texts = [
        answer((0, 2, "Sorting lists"), (3, 3, "Tuples, early")),
        answer((2, 2, "Sorting lists"), (3, 5, "Tuples and sets")),
        answer((4, 5, "Tuples and sets"), (6, 7, "Regexes")),
        answer((6, 7, "Regular expressions"), (8, 9, "JSON")),
    ]
    starts = [0, 3, 6, 8]  # cuts: window 0 owns 0-2, 1 owns 3-4, 2 owns 5-6, 3 owns 7-9
    assert win.fixed_labels(ws, texts, starts, None) == {
        0: "Sorting lists",
        3: "Tuples and sets",  # window 1's, not window 0's
        6: "Regexes",
        8: "JSON",
    }
    broken = [texts[0], "no", *texts[2:]]  # window 1 cannot be read: its neighbour's chunk
    assert win.fixed_labels(ws, broken, starts, None)[3] == "Tuples, early"
    assert win.fixed_labels(ws, ["no"] * 4, starts, None) == dict.fromkeys(starts)


def test_a_wrong_embedding_model_stops_a_task_run_before_training():
    from mlxlab.tasks.chunk.config import ChunkTaskConfig
    from mlxlab.tasks.chunk.task import ChunkTask

    task = ChunkTask(ChunkTaskConfig(eval=EvalSettings(shifts="tiny-gemma3"), eval_base=False))
    with pytest.raises(UserError, match="not an embedding model"):
        task.before_lora(None)  # the hook that runs before the first step
    with pytest.raises(UserError, match="unknown model"):
        shifts.check_model("no-such-model")


def test_window_starts_are_the_cases_inside_the_window():
    w = win.Window(case=0, first=5, last=9, uuids=[], prompt=[])
    assert win.window_starts(w, [0, 3, 5, 7, 10]) == [0, 2]  # 5 is the window's own first
    assert win.window_starts(w, [0]) == [0]


def _tiny(tiny_dir, tmp_path, n: int):
    from mlx_lm.utils import load

    cfg = ChunkDataConfig(
        train=2, valid=1, test=n, median_pairs=3, max_message_chars=200, topic_weights=[0, 1]
    )
    out = dataset.write_dataset(tmp_path / "chunk", cfg)
    model, tokenizer = load(str(tiny_dir("gemma3")))
    return model, tokenizer, dataset.read_split(out, EvalSettings())


def test_a_decode_with_fixed_starts_puts_chunks_exactly_there(tiny_dir, tmp_path):
    """Each window's answer has the chunks its fixed starts give (the model writes labels only),
    whole conversations and windowed ones; merged, the conversation's chunks start there and
    nowhere else."""
    model, tokenizer, records = _tiny(tiny_dir, tmp_path, 2)
    counts = [len(pr.shown(r["messages"])) for r in records]
    fixed = [[0, 2, n - 1] if n > 3 else [0] for n in counts]
    for cap in (None, 4):  # one prompt each; then windows of two exchanges
        rows = ev.evaluate(
            model, tokenizer, records, 4096, 2, budget=8192, fixed_starts=fixed, max_messages=cap
        )
        for row, record, want in zip(rows, records, fixed, strict=True):
            uuids = [m["uuid"] for m in pr.shown(record["messages"])]
            outputs = row.get("window_outputs", [row["output"]])
            windows = [
                w
                for w in win.plan_windows(records, tokenizer, 8192, 2, cap)
                if w.case == row["case"]
            ]
            for w, text in zip(windows, outputs, strict=True):  # each window: its fixed chunks
                got = json.loads(text)["chunks"]
                assert [w.uuids.index(c["start_message_uuid"]) for c in got] == win.window_starts(
                    w, want
                )
                assert got[-1]["end_message_uuid"] == w.uuids[-1]
                assert all(2 <= len(c["label"].split(" ")) <= 12 for c in got)
            got = json.loads(row["output"])["chunks"]
            starts = [uuids.index(c["start_message_uuid"]) for c in got]
            assert starts == want and row["ref"] == 100.0  # not also at the windows' edges
        if cap:
            assert any(r["windows"] > 1 for r in rows)  # the windowed path ran


def test_eval_with_shifts_reports_a_row_and_the_detector(tiny_dir, tmp_path):
    """evaluate_model with `shifts`: one more decode, its per-case file, its row in the table,
    the detector's own F1 (against gold, no model) and its time in the evaluation's."""
    from mlxlab.tasks.chunk.report import eval_seconds

    tiny_dir("bert")
    model, tokenizer, records = _tiny(tiny_dir, tmp_path, 2)
    settings = EvalSettings(
        max_tokens=400, batch_size=2, shifts="tiny-bert", shift_cap=-1, shift_floor=-1
    )
    out = tmp_path / "eval.jsonl"
    summary = ev.evaluate_model(model, tokenizer, records, settings, out, "tiny")
    s = summary["shifts"]
    assert s["results"] == str(tmp_path / "eval.shifts.jsonl") and s["cases"] == 2
    rows = [json.loads(x) for x in (tmp_path / "eval.shifts.jsonl").open()]
    assert all(len(json.loads(r["output"])["chunks"]) == 1 for r in rows)  # nothing is below -1
    d = s["detector"]
    assert d["model"] == "tiny-bert" and d["chunks_per_case"] == 1.0
    assert d["rule"] == {"drop": 0.15, "cap": -1.0, "floor": -1.0}
    one_chunk = [scoring.boundary_f1(scoring.case_gold_spans(r), [(0, 1)]) for r in records]
    assert d["boundary_f1"] == pytest.approx(sum(one_chunk) / 2)
    assert "| tiny, shift boundaries | 2 |" in metrics.table({"tiny": summary})
    assert "detector alone (tiny-bert, cosine below -1, or" in report.detector_note(summary)
    assert eval_seconds(summary) == pytest.approx(summary["seconds"] + s["seconds"])
    line = report.decoding_line(EvalSettings(shifts="all-minilm-l6-v2"))
    assert "all-minilm-l6-v2 sentence vectors" in line
    assert "shift" not in report.decoding_line(EvalSettings()) and report.detector_note({}) == ""
    wrong = EvalSettings(max_tokens=400, shifts="tiny-gemma3")  # fails before any decode
    with pytest.raises(UserError, match="not an embedding model"):
        ev.evaluate_model(model, tokenizer, records, wrong, tmp_path / "wrong.jsonl", "tiny")
    assert not (tmp_path / "wrong.jsonl").exists()
    for key, bad in (("cap", 1.5), ("floor", -2.0), ("drop", -0.1), ("drop", float("nan"))):
        with pytest.raises(UserError, match=f"shift_{key} must be a number in"):
            EvalSettings(**{f"shift_{key}": bad})


def test_boundary_f1_and_spans():
    assert scoring.spans_of([0, 2], 4) == [(0, 1), (2, 3)]
    assert scoring.spans_of([0], 1) == [(0, 0)]
    assert scoring.boundary_f1([(0, 3)], [(0, 3)]) == 1.0
    assert scoring.boundary_f1([(0, 3)], []) == 0.0
    assert scoring.boundary_f1([(0, 1), (2, 3)], [(0, 3)]) == 0.0
    assert scoring.boundary_f1([(0, 1), (2, 3)], [(0, 0), (1, 1), (2, 3)]) == pytest.approx(2 / 3)
    case = {"messages": [{"uuid": u, "sender": "user", "text": "t"} for u in U], "chunks": GOLD}
    assert scoring.case_gold_spans(case) == [(0, 1), (2, 3)]
    assert scoring.case_gold_spans({"messages": []}) is None
    # gold given out of order: sorted by place, the chunks with their spans
    ordered, spans = scoring.gold_order(GOLD[::-1], U)
    assert ordered == GOLD and spans == [(0, 1), (2, 3)]
    assert scoring.score_case(json.dumps({"chunks": GOLD}), U, GOLD[::-1]).label_pairs == [
        [g["label"], g["label"]] for g in GOLD
    ]
