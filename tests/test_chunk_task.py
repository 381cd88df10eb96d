"""The chunk task's data builder and scorer (no model needed)."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest

from mlxlab.decode.offline import complete
from mlxlab.errors import UserError
from mlxlab.tasks.chunk import (
    dataset,
    docs_chats,
    metrics,
    probes,
    report,
    scoring,
)
from mlxlab.tasks.chunk import evaluate as ev
from mlxlab.tasks.chunk import grammar as ag
from mlxlab.tasks.chunk import prompt as pr
from mlxlab.tasks.chunk import windows as win
from mlxlab.tasks.chunk.config import ChunkDataConfig

U = [
    "aaaaaaaa-0000-4000-8000-000000000000",
    "bbbbbbbb-1111-4000-8000-000000000000",
    "cccccccc-2222-4000-8000-000000000000",
    "dddddddd-3333-4000-8000-000000000000",
]
GOLD = [
    {"start_message_uuid": U[0], "end_message_uuid": U[1], "label": "The assert statement"},
    {
        "start_message_uuid": U[2],
        "end_message_uuid": U[3],
        "label": "Augmented assignment statements",
    },
]


def test_builder_is_deterministic_and_keeps_topics_apart():
    from mlxlab.tasks.chunk.topics import load_topics

    cfg = ChunkDataConfig(seed=1, train=40, valid=5, test=10)
    a, b = docs_chats.build(cfg), docs_chats.build(cfg)
    assert a == b
    # and from one process to the next: no object addresses in the text (a signature's
    # `<object object at 0x...>` default once made every build differ)
    texts = [s.text for t in load_topics() for s in t.sections]
    assert not [t for t in texts if re.search(r" at 0x[0-9a-fA-F]{6,}", t)]
    topics = {split: {t for case in rows for t in case["topics"]} for split, rows in a.items()}
    assert not topics["train"] & topics["test"] and not topics["train"] & topics["valid"]
    labels = {
        split: {c["label"] for case in rows for c in case["chunks"]} for split, rows in a.items()
    }
    assert not labels["train"] & labels["test"]
    assert docs_chats.build(ChunkDataConfig(seed=2, train=5))["train"] != a["train"][:5]
    for case in a["train"]:
        senders = [m["sender"] for m in case["messages"]]
        assert senders[::2] == ["user"] * len(senders[::2])  # user and assistant take turns
        assert senders[1::2] == ["assistant"] * len(senders[1::2])
        assert 4 <= len(senders) <= cfg.max_messages
        uuids = [m["uuid"] for m in case["messages"]]
        index = {u: i for i, u in enumerate(uuids)}
        spans = [
            (index[c["start_message_uuid"]], index[c["end_message_uuid"]]) for c in case["chunks"]
        ]
        assert spans[0][0] == 0 and spans[-1][1] == len(uuids) - 1  # gold covers it in order
        assert all(s1 == e0 + 1 for (_, e0), (s1, _) in zip(spans, spans[1:], strict=False))
        assert all(2 <= len(c["label"].split()) <= docs_chats.LABEL_WORDS for c in case["chunks"])
    # the skew: most conversations are on one or two topics, some on more
    n_chunks = [len(c["chunks"]) for c in a["train"]]
    assert sum(n <= 2 for n in n_chunks) > len(n_chunks) / 2 and max(n_chunks) >= 3


def test_train_topic_weights_skew_the_training_split_only():
    base = ChunkDataConfig(seed=1, train=60, valid=5, test=30)
    multi = ChunkDataConfig(seed=1, train=60, valid=5, test=30, train_topic_weights=[0, 1])
    a, b = docs_chats.build(base), docs_chats.build(multi)
    assert a["test"] == b["test"] and a["valid"] == b["valid"]  # evaluation keeps the real skew
    assert all(len(c["chunks"]) >= 2 for c in b["train"])  # two topics (a return makes three)
    assert sum(len(c["chunks"]) == 1 for c in a["train"]) > 10
    with pytest.raises(UserError, match="train_topic_weights"):
        ChunkDataConfig(train_topic_weights=[-1, 2])


def test_gold_labels_are_short_phrases_from_the_topic():
    from mlxlab.tasks.chunk.topics import Topic, load_topics

    labels = [docs_chats.label(t) for t in load_topics()]
    assert len(set(labels)) == len(labels)  # one topic per name: labels tell topics apart
    for text in labels:
        words = text.split()
        assert 2 <= len(words) <= docs_chats.LABEL_WORDS <= 9, text
        assert words[-1].lower() not in docs_chats.TRAILING, text  # no phrase cut after "of", "the"
        assert text.count("(") == text.count(")"), text
        assert not text.lower().split(":")[-1].strip().startswith("this module"), text
        # in the topic's own words: no head naming the kind of topic to fill in off the domain
        assert not re.match(r"(Python \S+ module|NumPy \S+):", text), text
    by_name = {t.name: docs_chats.label(t) for t in load_topics()}
    assert by_name["numpy.var"] == "Compute the variance along the specified axis"
    assert by_name["the assert statement"] == "The assert statement"
    # aliases share their documentation: the name in parentheses tells them apart
    assert by_name["numpy.abs"].endswith(" (abs)") and by_name["numpy.absolute"].endswith(
        " (absolute)"
    )
    odd = Topic("m:x", "module", "x", "a) lists (and", ())
    assert (
        docs_chats.label(odd) == "A lists"
        and docs_chats.label(Topic("m:y", "module", "y", "", ())) == "Y (y)"
    )


def test_prompt_format_is_the_predecessors():
    case = {
        "id": "c1",
        "name": "Sorting help",
        "uuid": "conv-uuid",
        "messages": [
            {"uuid": U[0], "sender": "user", "text": "How do I sort?"},
            {"uuid": U[1], "sender": "assistant", "text": ""},
            {"uuid": U[2], "sender": "assistant", "text": "Use sorted()."},
        ],
    }
    text = pr.prompt(case)
    assert text == (
        f"{pr.INSTRUCTIONS}\n\nConversation: Sorting help (uuid: conv-uuid)\n\n"
        f"[user] (uuid: {U[0]})\nHow do I sort?\n\n---\n[assistant] (uuid: {U[2]})\nUse sorted().\n"
    )
    assert [m["uuid"] for m in pr.shown(case["messages"])] == [U[0], U[2]]
    ex = dataset.chat({**case, "chunks": GOLD[:1]})
    assert [m["role"] for m in ex["messages"]] == ["user", "assistant"]
    assert json.loads(ex["messages"][1]["content"]) == {"chunks": GOLD[:1]}


def test_windows_cover_in_order_within_budget_and_overlap():
    costs = [3, 5, 2, 8, 1, 1, 4, 20, 2]
    ws = win.windows(costs, budget=10, overlap=1)
    assert ws[0][0] == 0 and ws[-1][1] == len(costs) - 1
    for (a0, b0), (a1, b1) in zip(ws, ws[1:], strict=False):
        assert a0 < a1 and b1 > b0 and a1 in (b0, b0 + 1)  # forward, sharing at most one message
        if costs[b0] + costs[b0 + 1] <= 10:
            assert a1 == b0  # the shared message fits with the next one: it is shared
    for a, b in ws:
        assert sum(costs[a : b + 1]) <= 10 or a == b  # an over-long message is a window alone
    assert win.windows([1, 1, 1], budget=10, overlap=2) == [(0, 2)]
    assert win.windows([5, 5, 5], budget=5, overlap=3) == [(0, 0), (1, 1), (2, 2)]
    # a cap on messages per window (eval's WINDOW_MESSAGES) holds beside the token budget
    assert win.windows([1] * 7, budget=100, overlap=1, max_messages=3) == [(0, 2), (2, 4), (4, 6)]
    long = {"uuid": "x", "sender": "assistant", "text": "word " * 500}
    cut = win.fit(long, win.char_cost, 300)
    assert win.char_cost(cut) <= 300 and cut["text"].endswith(pr.TRUNCATED)


def test_training_examples_are_windows_with_clipped_gold():
    cfg = ChunkDataConfig(seed=3, train=30, valid=1, test=1, window_chars=2500)
    cases = docs_chats.build(cfg)["train"]
    long = max(cases, key=lambda c: len(pr.prompt(c)))
    examples = dataset.training_examples(long, cfg)
    assert len(examples) > 1
    seen = []
    for ex in examples:
        body = ex["messages"][0]["content"].split("\n\n", 2)[2]
        assert len(body) <= cfg.window_chars  # each block's cost counts its separator
        shown_ids = [m for m in re.findall(r"\(uuid: ([0-9a-f-]+)\)", body)]
        gold = json.loads(ex["messages"][1]["content"])["chunks"]
        assert gold[0]["start_message_uuid"] == shown_ids[0]  # clipped to the window
        assert gold[-1]["end_message_uuid"] == shown_ids[-1]
        assert all(c["label"] in {g["label"] for g in long["chunks"]} for c in gold)
        seen += shown_ids
    assert set(seen) == {m["uuid"] for m in long["messages"]}


def test_window_messages_makes_every_training_example_a_local_question():
    """window_messages=4, overlap 2: each example is two consecutive exchanges (the second new),
    its gold clipped to them; every boundary of the conversation is some example's own."""
    cfg = ChunkDataConfig(seed=3, train=30, valid=1, test=1, window_messages=4)
    cases = docs_chats.build(cfg)["train"]
    many = max(cases, key=lambda c: (len(c["chunks"]), len(pr.shown(c["messages"]))))
    uuids = [m["uuid"] for m in pr.shown(many["messages"])]
    wins = win.training_windows(many, cfg)
    assert len(wins) >= len(uuids) // 2 - 1 and all(len(msgs) <= 4 for msgs, _ in wins)
    starts = set()
    for (msgs, gold), nxt in zip(wins, wins[1:] + [None], strict=True):
        ids = [m["uuid"] for m in msgs]
        assert gold[0]["start_message_uuid"] == ids[0] and gold[-1]["end_message_uuid"] == ids[-1]
        if nxt is not None:
            assert [m["uuid"] for m in nxt[0]][:2] == ids[-2:]  # shares one exchange
        starts |= {uuids.index(c["start_message_uuid"]) for c in gold[1:]}
    gold_starts = {uuids.index(c["start_message_uuid"]) for c in many["chunks"][1:]}
    assert len(gold_starts) >= 2 and starts == gold_starts
    assert all(len(ex["messages"][0]["content"]) for ex in dataset.training_examples(many, cfg))
    from mlxlab.tasks.chunk.config import EvalSettings

    with pytest.raises(UserError, match="window_messages"):
        ChunkDataConfig(window_messages=2)  # no more than the overlap: windows cannot advance
    with pytest.raises(UserError, match="window_messages"):
        EvalSettings(window_messages=1, window_overlap=0)


def test_a_task_run_stops_before_anything_when_its_evaluation_windows_cannot_advance(tmp_path):
    """task.data.window_messages caps the evaluation's windows too (when eval.window_messages is
    0): one no larger than eval.window_overlap fails at data preparation, before a dataset is
    built, the base model evaluated or a step trained; so does a prebuilt dataset's cap."""
    from mlxlab.config import DataConfig
    from mlxlab.tasks.chunk.config import ChunkTaskConfig, EvalSettings
    from mlxlab.tasks.chunk.task import ChunkTask

    small = ChunkDataConfig(train=3, valid=1, test=1, window_messages=3)
    task = ChunkTask(ChunkTaskConfig(data=small, eval=EvalSettings(window_overlap=3)))
    with pytest.raises(
        UserError, match="window_messages must be more .* got 3 with window_overlap 3"
    ):
        task.prepare_data(DataConfig(), tmp_path / "run")
    assert not (tmp_path / "run" / "data").exists()
    built = dataset.write_dataset(tmp_path / "built", small)
    for train in (built, built / "train.jsonl"):  # a dataset directory or its training file
        with pytest.raises(UserError, match="got 3 with window_overlap 3 .*takes the dataset's"):
            task.prepare_data(DataConfig(train=str(train)), tmp_path / "run2")
    ok = ChunkTask(
        ChunkTaskConfig(data=small, eval=EvalSettings(window_overlap=3, window_messages=5))
    )
    assert ok.prepare_data(DataConfig(train=str(built)), tmp_path / "run3").train == str(built)
    fine = ChunkTask(ChunkTaskConfig(data=small))  # overlap 2: three messages move on by one
    assert fine.prepare_data(DataConfig(), tmp_path / "run4").train == str(tmp_path / "run4/data")


def test_gold_answer_scores_perfectly():
    s = scoring.score_case(json.dumps({"chunks": GOLD}), U, GOLD)
    assert (s.wellformed, s.boundary_f1, s.exact_match, s.repairs) == (100.0, 1.0, 1.0, 0)


@pytest.mark.parametrize("wrap", ["```json\n{}\n```", "Sure! Here it is: {} Hope that helps."])
def test_extraction_fallbacks(wrap):
    text = wrap.replace("{}", json.dumps({"chunks": GOLD}))
    s = scoring.score_case(text, U, GOLD)
    assert s.wellformed == 100.0 and s.extraction in ("fence", "braces")


def test_repairs_cost_anchor_points():
    chunks = [
        {
            "start_message_uuid": "aaaaaaaa-0000",
            "end_message_uuid": U[1],
            "label": "Assert statements",
        },
        {"start_message_uuid": U[2], "end_message_uuid": U[2], "label": "Augmented assignment"},
    ]
    s = scoring.score_case(json.dumps({"chunks": chunks}), U, GOLD)
    assert s.repairs == 2  # prefix match + trailing gap
    assert s.anchors == pytest.approx(1 - 2 / 4)
    assert s.wellformed == pytest.approx(100 * (0.30 + 0.35 * 0.5 + 0.15 + 0.20))
    assert s.boundary_f1 == 1.0 and s.exact_match == 1.0  # the covered gap restores the span


def test_inverted_and_unknown_uuids_are_repaired():
    chunks = [
        {"start_message_uuid": U[1], "end_message_uuid": U[0], "label": "Assert statements"},
        {"start_message_uuid": U[2], "end_message_uuid": "nope", "label": "Chunk 2"},
    ]
    s = scoring.score_case(json.dumps({"chunks": chunks}), U, GOLD)
    assert s.repairs == 2 and s.labels == 0.5 and s.exact_match == 1.0


def test_unrepairable_results_score_zero_anchors():
    overlap = [
        {"start_message_uuid": U[0], "end_message_uuid": U[2], "label": "Assert statements"},
        {"start_message_uuid": U[1], "end_message_uuid": U[3], "label": "Augmented assignment"},
    ]
    s = scoring.score_case(json.dumps({"chunks": overlap}), U, GOLD)
    assert s.anchors == 0.0 and s.boundary_f1 == 0.0
    assert scoring.score_case("no json here", U, GOLD).wellformed == 0.0
    assert scoring.score_case(json.dumps({"chunks": []}), U, GOLD).wellformed == pytest.approx(
        30.0 * 0
    )
    bad_schema = scoring.score_case(json.dumps({"chunks": [{"start_message_uuid": 3}]}), U, GOLD)
    assert bad_schema.schema == 0.0 and bad_schema.nonempty == 1.0


def test_generic_labels():
    assert not scoring.is_specific("Chunk 1") and not scoring.is_specific("Other topics")
    assert not scoring.is_specific("Assert") and scoring.is_specific("The assert statement")
    summary = metrics.summarize(
        [
            scoring.score_case(json.dumps({"chunks": GOLD}), U, GOLD).to_dict(),
            scoring.score_case("nothing", U, GOLD).to_dict(),
        ]
    )
    assert summary["cases"] == 2 and summary["wellformed"] == 50.0


def test_written_splits_feed_training_and_eval(tiny_dir, tmp_path):
    from mlx_lm.utils import load

    from mlxlab.config import DataConfig
    from mlxlab.data.datasets import load_split
    from mlxlab.tasks.chunk.config import EvalSettings

    out = dataset.write_dataset(tmp_path / "chunk", ChunkDataConfig(train=6, valid=2, test=3))
    names = sorted(p.name for p in out.iterdir())
    assert names == [
        "build.json",
        "test.cases.json",
        "test.jsonl",
        "train.cases.json",
        "train.jsonl",
        "valid.cases.json",
        "valid.jsonl",
    ]
    built = json.loads((out / "build.json").read_text())
    assert built["stats"]["train"]["cases"] == 6 and built["train"] == 6
    model, tokenizer = load(str(tiny_dir("gemma3")))
    split = load_split(out / "train.jsonl", tokenizer, DataConfig(max_seq_length=8192))
    assert len(split.examples) >= 6 and all(e.offset > 0 for e in split.examples)
    cases = dataset.read_split(out, EvalSettings())
    assert [c["id"] for c in cases] == ["test-0000", "test-0001", "test-0002"]
    # every case read in windows of at most 4 messages (the default), sharing an exchange
    results = ev.evaluate(model, tokenizer, cases, max_tokens=8, batch_size=2, budget=8192)
    assert len(results) == 3 and all(0.0 <= r["wellformed"] <= 100.0 for r in results)
    assert [r["case"] for r in results] == [0, 1, 2]
    n = [len(pr.shown(c["messages"])) for c in cases]
    assert [r["windows"] for r in results] == [len(win.windows([1] * k, 10**6, 2, 4)) for k in n]
    assert max(n) > 4 and max(r["windows"] for r in results) > 1
    one_by_one = ev.evaluate(model, tokenizer, cases, max_tokens=8, batch_size=1, budget=8192)
    assert [r["prompt_tokens"] for r in one_by_one] == [r["prompt_tokens"] for r in results]
    # no message cap: each case one prompt within the budget
    whole = ev.evaluate(model, tokenizer, cases, 8, 2, budget=8192, max_messages=None)
    assert all(r["windows"] == 1 for r in whole)
    labels = dataset.training_labels(out)
    assert labels and all(label == label.lower() for label in labels)


def _long_case(n_cases: int = 40) -> dict:
    """One synthetic conversation from many test conversations end to end (their gold chunks
    end to end too)."""
    cases = docs_chats.build(ChunkDataConfig(seed=5, train=1, valid=1, test=n_cases))["test"]
    return {
        "id": "long",
        "name": "a long one",
        "uuid": "0f0f0f0f-aaaa-4bbb-8ccc-123456789abc",
        "messages": [m for c in cases for m in c["messages"]],
        "chunks": [ch for c in cases for ch in c["chunks"]],
    }


def test_filled_windows_show_whole_exchanges_whatever_the_answers_length(tiny_dir):
    """plan_windows with a message cap fills its windows: every window of a conversation with
    answers too long for two exchanges still holds two (user, assistant, user, assistant), the
    longest messages cut to one length so the prompt fits; `window_cases` (training's planner)
    with the same budget ends windows at a question without its answer."""
    from mlx_lm.utils import load

    _, tokenizer = load(str(tiny_dir("gemma3")))
    answer = "A long answer about something. " * 80
    messages = [
        {"uuid": f"{i:08x}-0000-4000-8000-000000000000", "sender": s, "text": t}
        for i, (s, t) in enumerate(
            (("user", f"question {k}?"), ("assistant", f"{k}: {answer}"))[j]
            for k in range(5)
            for j in range(2)
        )
    ]
    case = {"id": "c", "name": "long answers", "messages": messages}
    budget = 1200

    def cost(m: dict) -> int:
        return len(tokenizer.encode(pr.message_block(m) + "\n---\n", add_special_tokens=False))

    cut = win.window_cases(case, cost, budget - 200, 2, 4)
    assert any(len(msgs) < 4 and b < len(messages) - 1 for _, b, msgs in cut)
    filled = win.plan_windows([case], tokenizer, budget, 2, 4)
    assert [(w.first, w.last) for w in filled] == [(0, 3), (2, 5), (4, 7), (6, 9)]
    assert all(len(w.prompt) <= budget for w in filled)
    assert all(w.users == w.uuids[::2] for w in filled)
    text = tokenizer.decode(filled[1].prompt)
    assert text.count(pr.TRUNCATED.strip()) == 2 and "question 1?" in text
    assert "question 2?" in text
    # both answers cut to one cost, the largest that fits: their kept text is as long
    kept = [len(a.split(pr.TRUNCATED.strip())[0]) for a in text.split("1: ")[1:]]
    kept += [len(a.split(pr.TRUNCATED.strip())[0]) for a in text.split("2: ")[1:]]
    assert len(kept) == 2 and abs(kept[0] - kept[1]) <= 8
    assert all(len(w.prompt) > budget - 40 for w in filled)
    short = {**case, "messages": [{**m, "text": m["text"][:200]} for m in messages]}
    whole = [(w.first, w.last) for w in win.plan_windows([short], tokenizer, budget, 2, 4)]
    assert whole == [(0, 3), (2, 5), (4, 7), (6, 9)]  # nothing cut where all fits


def test_filled_windows_cover_every_message_and_fall_back_when_nothing_fits():
    """win.filled_windows by characters: windows of max_messages sharing `overlap`, the last
    shorter on an odd count; a conversation of max_messages or fewer over the budget is one cut
    window; a budget too small for max_messages messages cut to nothing plans as window_cases."""
    msgs = [
        {"uuid": f"u{i}", "sender": ("user", "assistant")[i % 2], "text": ("x" * 400, "q?")[i % 2]}
        for i in range(9)
    ]
    case = {"id": "c", "messages": msgs}
    out = win.filled_windows(case, win.char_cost, 900, 2, 4)
    assert [(a, b) for a, b, _ in out] == [(0, 3), (2, 5), (4, 7), (6, 8)]
    assert all(sum(win.char_cost(m) for m in part) <= 900 for _, _, part in out)
    assert [m["uuid"] for m in out[1][2]] == ["u2", "u3", "u4", "u5"]
    assert out[1][2][1]["text"] == "q?" and pr.TRUNCATED in out[1][2][0]["text"]
    four = {"id": "c", "messages": msgs[:4]}
    ((a, b, part),) = win.filled_windows(four, win.char_cost, 900, 2, 4)
    assert (a, b) == (0, 3) and sum(win.char_cost(m) for m in part) <= 900
    assert win.filled_windows(case, win.char_cost, 120, 2, 4) == win.window_cases(
        case, win.char_cost, 120, 2, 4
    )


def test_a_40k_token_conversation_is_read_in_windows_and_merged_back(tiny_dir):
    """plan_windows keeps every prompt within the budget: windows of `window_messages` messages,
    filled (the longest cut to fit), or without a message cap as long as the budget allows;
    answers that are each window's gold merge back into exactly the whole conversation's gold;
    a window whose answer cannot be read decides nothing: the chunk before runs on over what it
    owns."""
    from mlx_lm.utils import load

    _, tokenizer = load(str(tiny_dir("gemma3")))
    case = _long_case()
    uuids = [m["uuid"] for m in pr.shown(case["messages"])]
    total = len(tokenizer.apply_chat_template([{"role": "user", "content": pr.prompt(case)}]))
    assert total >= 40_000
    budget = 4096
    long = win.plan_windows([case], tokenizer, budget, 2, None)
    assert len(long) >= total // budget and all(len(w.prompt) <= budget for w in long)
    assert long[0].first == 0 and long[-1].last == len(uuids) - 1
    windows = win.plan_windows([case], tokenizer, budget, 2, 4)
    assert len(windows) > len(long) and all(len(w.uuids) == 4 for w in windows[:-1])
    assert all(len(w.prompt) <= budget for w in windows)
    assert windows[0].first == 0 and windows[-1].last == len(uuids) - 1
    assert all(b.first == a.last - 1 for a, b in zip(windows, windows[1:], strict=False))
    senders = {m["uuid"]: m["sender"] for m in case["messages"]}
    assert all(w.users == [u for u in w.uuids if senders[u] == "user"] for w in windows)
    short = {**case, "messages": case["messages"][:12]}
    assert [len(w.uuids) for w in win.plan_windows([short], tokenizer, budget, 2, 8)] == [8, 6]
    perfect = [
        json.dumps({"chunks": win.clip(case["chunks"], uuids, w.first, w.last)}) for w in windows
    ]
    starts, labels, failed = win.merge_local(windows, perfect, len(uuids), case["uuid"])
    index = {u: i for i, u in enumerate(uuids)}
    gold_starts = [index[c["start_message_uuid"]] for c in case["chunks"]]
    assert failed == 0 and starts == gold_starts
    assert [labels[s] for s in starts] == [c["label"] for c in case["chunks"]]
    # a window that answers nothing readable decides nothing; its neighbours' decisions stand
    k = next(k for k, w in enumerate(windows) if any(w.first < s <= w.last for s in gold_starts))
    cuts = win.window_cuts(windows, len(uuids))
    broken = [*perfect[:k], "I cannot do that", *perfect[k + 1 :]]
    starts, labels, failed = win.merge_local(windows, broken, len(uuids), case["uuid"])
    assert failed == 1
    assert starts == [s for s in gold_starts if not cuts[k] <= s < cuts[k + 1] or s == 0]
    assert win.merge_local(windows, ["no"] * len(windows), len(uuids), None)[:2] == (
        [0],
        {0: None},
    )


def _window(first: int, last: int, uuids: list[str]):
    return win.Window(0, first, last, uuids[first : last + 1], [])


def test_merge_local_reads_each_window_s_own_decision():
    """Windows of two exchanges sharing one (0-3, 2-5, 4-7, 6-9; they own 0-2, 3-4, 5-6, 7-9): an
    answer that ends its chunk at the window's second message, inside what the window owns,
    starts a chunk at its third, named by the next window; an explicit chunk start inside what a
    window owns is one; a failed window decides nothing."""
    uuids = [f"{i:08d}-0000-4000-8000-000000000000" for i in range(10)]
    ws = [_window(a, a + 3, uuids) for a in (0, 2, 4, 6)]

    def answer(*chunks):
        return json.dumps(
            {"chunks": [{"label": x, "start_message_uuid": uuids[a], "end_message_uuid": uuids[b]}
                        for a, b, x in chunks]}
        )  # fmt: skip

    texts = [
        answer((0, 3, "Sorting")),
        answer((2, 3, "Sorting")),  # stops at its second message: a topic starts at message 4
        answer((4, 7, "Regular expressions")),
        answer((6, 9, "Regular expressions")),
    ]
    assert win.window_chunks(texts[1], uuids[2:6], None)[2] == 2
    assert win.window_chunks(texts[0], uuids[0:4], None)[2] is None
    starts, labels, failed = win.merge_local(ws, texts, 10, None)
    assert (starts, labels, failed) == ([0, 4], {0: "Sorting", 4: "Regular expressions"}, 0)
    # the window that stopped decides, not the labels: the next one's label only names the chunk
    same = [*texts[:2], answer((4, 7, "sorting")), answer((6, 9, "Sorting"))]
    starts, labels, _ = win.merge_local(ws, same, 10, None)
    assert (starts, labels[4]) == ([0, 4], "sorting")
    # a failed window leaves the name to the next one; the last window's gap (message 9) has no
    # window after it to name it and is dropped
    late = [*texts[:2], "no answer", answer((6, 8, "Regular expressions"))]
    starts, labels, failed = win.merge_local(ws, late, 10, None)
    assert (starts, labels[4], failed) == ([0, 4], "Regular expressions", 1)
    # a failed window starts nothing
    broken = [answer((0, 3, "Sorting")), answer((2, 5, "Sorting")), "{", answer((6, 9, "Tuples"))]
    assert win.merge_local(ws, broken, 10, None)[:3:2] == ([0], 1)
    # a window that knows its users starts a chunk at a user message only (even ones: users),
    # by a short answer or by a chunk of its own
    users = [win.Window(0, w.first, w.last, w.uuids, [], w.uuids[::2]) for w in ws]
    assert win.merge_local(users, texts, 10, None)[0] == [0, 4]
    early = [answer((0, 0, "Sorting")), answer((2, 3, "Tuples")), *texts[2:]]  # stops at msg 0
    assert win.merge_local(users, early, 10, None)[0] == [0, 4]
    starts, labels, _ = win.merge_local(ws, early, 10, None)
    assert (starts, labels[1]) == ([0, 1, 4], "Tuples")
    odd = [answer((0, 0, "Sorting"), (1, 3, "Tuples")), *texts[1:]]  # a chunk at message 1
    assert win.merge_local(users, odd, 10, None)[0] == [0, 4]
    assert win.merge_local(ws, odd, 10, None)[0] == [0, 1, 4]
    # an explicit start inside what the window owns; one with no string label named after it
    second = [*texts[:2], answer((4, 5, "Regex"), (6, 7, None)), answer((6, 9, "JSON"))]
    starts, labels, _ = win.merge_local(ws, second, 10, None)
    assert (starts, labels[6]) == ([0, 4, 6], "JSON")
    # a start at the window's first message is not a decision (every answer starts there), nor
    # is one outside what the window owns (message 2 belongs to window 0)
    outside = [texts[0], answer((2, 2, "Tuples"), (3, 5, "Tuples")), *texts[2:]]
    assert win.merge_local(ws, outside, 10, None)[0] == [0, 3]
    # a mangled end anchor is not a topic's end
    mangled = json.dumps(
        {"chunks": [{"label": "Sorting", "start_message_uuid": uuids[2], "end_message_uuid": "zz"}]}
    )
    assert win.window_chunks(mangled, uuids[2:6], None)[2] is None
    assert win.merge_local(ws, [texts[0], mangled, *texts[2:]], 10, None)[0] == [0]
    # a window whose only resolving anchor is an end has failed: its gap decides nothing either
    endonly = json.dumps(
        {"chunks": [{"label": "Sorting", "start_message_uuid": "zz", "end_message_uuid": uuids[3]}]}
    )
    assert win.merge_local(ws, [texts[0], endonly, *texts[2:]], 10, None)[::2] == (
        [0],
        1,
    )
    # an explicit start that nothing after it names is dropped, not left unnamed
    last = answer((6, 7, "Regular expressions"), (8, 9, None))
    assert win.merge_local(ws, [*texts[:3], last], 10, None)[0] == [0, 4]


def test_a_window_the_grammar_overruled_decides_nothing_in_the_merge():
    """score_windows with `refused` (per window, the steps where the grammar refused the model's
    top token): such a window is merged as one whose answer could not be read, its answer kept
    in the row with the steps (`window_refused`); without `refused` (the plain decode) it is read
    as written."""
    uuids = [f"{i:08d}-0000-4000-8000-000000000000" for i in range(10)]
    case = {
        "id": "c",
        "messages": [
            {"uuid": u, "sender": "user" if i % 2 == 0 else "assistant", "text": f"m{i}"}
            for i, u in enumerate(uuids)
        ],
        "chunks": [
            {"label": "Sorting lists", "start_message_uuid": uuids[0], "end_message_uuid": uuids[9]}
        ],
    }
    ws = [_window(a, a + 3, uuids) for a in (0, 2, 4, 6)]

    def answer(a, b, label="Sorting lists"):
        return json.dumps(
            {"chunks": [{"label": label, "start_message_uuid": uuids[a],
                         "end_message_uuid": uuids[b]}]}
        )  # fmt: skip

    # window 1 stops at its second message: read, a topic starts at message 4 (a false split)
    texts = [answer(0, 3), answer(2, 3), answer(4, 7), answer(6, 9)]
    refused = [[], [17], [], []]
    read = ev.score_windows([case], ws, texts)[0]
    assert len(json.loads(read["output"])["chunks"]) == 2 and read["boundary_f1"] < 1
    assert "window_refused" not in read and "window_unread" not in read
    held = ev.score_windows([case], ws, texts, refused=refused)[0]
    assert len(json.loads(held["output"])["chunks"]) == 1 and held["boundary_f1"] == 1.0
    assert held["window_outputs"] == texts and held["window_failures"] == 1
    assert held["window_unread"] == 1 and held["window_refused"] == refused
    summary = metrics.summarize([held])
    counts = (summary["overruled_windows"], summary["unread_windows"], summary["windows"])
    assert counts == (1, 1, 4)
    assert "overruled the model in 1 of 4 windows, 1 merged as unread" in report.overruled_note(
        summary
    )
    # the windows the grammar did not overrule have nothing to read: all are read as written
    lost = ev.score_windows([case], ws, ["no", *texts[1:]], refused=[[], [1], [2], [3]])
    assert lost[0]["window_unread"] == 0 and lost[0]["output"] == read["output"]
    # the shift-boundaries pass (fixed chunk starts) is never merged as unread
    fixed = ev.score_windows([case], ws, texts, None, [[0]], refused)[0]
    assert fixed["window_unread"] == 0
    # one window: its answer is the case's, overruled or not
    one = ev.score_windows([case], [_window(0, 9, uuids)], [answer(0, 9)], refused=[[3]])[0]
    assert one["output"] == answer(0, 9) and "window_refused" not in one


def test_a_watching_constraint_records_where_the_grammar_overruled_the_model(gemma_tokenizer):
    """grammar.constrain(watch=True): `refused` lists the steps whose highest logit was a token
    the grammar refuses (the token written there is the grammar's choice), none once the answer
    is complete; without watch nothing is recorded."""
    import mlx.core as mx

    from mlxlab import grammar as G

    tok = gemma_tokenizer
    width = len(tok._tokenizer)
    answer = '{"chunks": []}'
    ids = tok.encode(answer, add_special_tokens=False)
    g = G.lark(ag.answer_grammar([]), "empty answer")
    stray = tok.encode(" zebra", add_special_tokens=False)[0]
    for watch in (True, False):
        c = G.constrain(g, tok, width, watch=watch)
        context = [2]  # the prompt's last token
        for step, want in enumerate([*ids, stray]):  # the model's favourite at each step
            logits = mx.zeros((1, width)).at[0, want].add(5.0)
            if step == 1:
                logits = logits.at[0, stray].add(9.0)  # here it prefers a token the grammar refuses
            out = c(mx.array([context]), logits)
            chosen = int(mx.argmax(out, axis=-1).item())
            assert chosen == (ids[step] if step < len(ids) else chosen)
            context.append(chosen)
        assert c.refused() == ([1] if watch else [])
        assert c.matcher.is_stopped() or c.matcher.is_accepting()


def test_evaluate_reads_a_long_conversation_in_windows(tiny_dir):
    """End to end on the tiny model: a conversation over the budget is decoded window by window
    under the answer schema, and the merged answer is one contiguous cover of it. The random
    model's answers are the grammar's (it overrules the model in every window), so with no
    window of its own to read they are merged as written; re-scored from the row alone."""
    from mlx_lm.utils import load

    model, tokenizer = load(str(tiny_dir("gemma3")))
    case = _long_case(3)
    rows = ev.evaluate(
        model,
        tokenizer,
        [case],
        max_tokens=2000,
        batch_size=4,
        constrained=True,
        budget=1024,
    )
    row = rows[0]
    assert row["windows"] > 2 and len(row["window_outputs"]) == row["windows"]
    assert row["window_failures"] == 0  # every window's answer has a chunk start that resolves
    v = scoring.validate(json.loads(row["output"])["chunks"], [m["uuid"] for m in case["messages"]])
    assert v.spans is not None and v.repairs == 0  # contiguous, from first to last message
    assert row["anchors"] == 1.0 and row["schema"] == 1.0
    refused = row["window_refused"]
    assert len(refused) == row["windows"] and all(refused) and row["window_unread"] == 0
    windows = win.plan_windows([case], tokenizer, 1024, 2, 4)
    again = ev.score_windows([case], windows, row["window_outputs"], refused=refused)[0]
    assert again["output"] == row["output"]
    # every window overruled: none is the model's alone, so they are merged as written
    texts = row["window_outputs"]
    held = ev.score_windows([case], windows, texts, refused=refused)[0]
    assert held["output"] == row["output"] and held["window_unread"] == 0
    # one that is not: the overruled ones are merged as unread
    spared = [[], *refused[1:]]
    held = ev.score_windows([case], windows, texts, refused=spared)[0]
    assert held["window_unread"] == held["windows"] - 1 == held["window_failures"]


def test_user_cases_without_gold_score_ref_and_strict_only(tiny_dir, tmp_path):
    from mlx_lm.utils import load

    from mlxlab.errors import UserError
    from mlxlab.tasks.chunk.config import EvalSettings

    mine = [
        {
            "id": "chat-1",
            "name": "My chat",
            "messages": [
                {"uuid": U[0], "sender": "user", "text": "hi, how do I parse JSON?"},
                {"uuid": U[1], "sender": "assistant", "text": "Use json.loads."},
            ],
        }
    ]
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(mine))
    cases = dataset.read_split(path, EvalSettings())
    model, tokenizer = load(str(tiny_dir("gemma3")))
    row = ev.evaluate(model, tokenizer, cases, max_tokens=4, batch_size=1)[0]
    assert row["boundary_f1"] is None and row["exact_match"] is None and row["label_f1"] is None
    summary = metrics.summarize([row])
    assert "ref" in summary and "boundary_f1" not in summary
    assert "| x | 1 |" in metrics.table({"x": summary}) and "| - |" in metrics.table({"x": summary})
    for bad, message in [
        ("[]", "non-empty JSON list"),
        ('[{"messages": [{"text": "hi"}]}]', "message 0 has no uuid"),
        ('[{"messages": [{"uuid": "a", "text": ""}]}]', "no message has text"),
        ("{oops", "not JSON"),
        (
            '[{"messages": [{"uuid": "a", "text": "x"}], "chunks": [{"start_message_uuid": "b"}]}]',
            "gold",
        ),
    ]:
        path.write_text(bad)
        with pytest.raises(UserError, match=message):
            dataset.read_split(path, EvalSettings())


def test_an_adapter_from_a_task_run_sets_the_window_budget(tiny_dir, tmp_path):
    from mlx_lm.utils import load

    from mlxlab.tasks.chunk.cli import task_run, trained_window

    _, tokenizer = load(str(tiny_dir("gemma3")))
    run = tmp_path / "run"
    (run / "adapter").mkdir(parents=True)
    assert task_run(run / "adapter") is None  # no config.yaml: not a task run
    (run / "config.yaml").write_text("task:\n  name: chunk\n  eval:\n    max_prompt_tokens: 1800\n")
    assert task_run(run / "adapter") == run and trained_window(run, tokenizer) == 1800
    (run / "checkpoints" / "step_0000002").mkdir(parents=True)
    assert task_run(run / "checkpoints" / "step_0000002") == run  # a checkpoint's run too
    # unset: the longest training prompt of the run's own dataset
    dataset.write_dataset(run / "data", ChunkDataConfig(train=4, valid=1, test=1))
    (run / "config.yaml").write_text("task:\n  name: chunk\n")
    longest = max(
        len(
            tokenizer.apply_chat_template(
                json.loads(x)["messages"][:-1], add_generation_prompt=True
            )
        )
        for x in (run / "data" / "train.jsonl").read_text().splitlines()
    )
    assert (
        trained_window(run, tokenizer)
        == longest
        == dataset.training_window(run / "data", tokenizer)
    )
    elsewhere = dataset.write_dataset(tmp_path / "mine", ChunkDataConfig(train=3, valid=1, test=1))
    (run / "config.yaml").write_text(f"task:\n  name: chunk\ndata:\n  train: {elsewhere}\n")
    from mlxlab.tasks.chunk.cli import run_data

    assert run_data(run) == elsewhere  # the run's own data.train wins over <run>/data
    assert dataset.built_window_messages(elsewhere) == 4  # the default
    local = dataset.write_dataset(
        tmp_path / "local", ChunkDataConfig(train=3, valid=1, test=1, window_messages=6)
    )
    assert dataset.built_window_messages(local) == 6  # what eval chunk reads such an adapter in
    (run / "config.yaml").write_text("model: x\n")  # a plain training run
    assert task_run(run / "adapter") is None


def test_eval_decodes_as_long_as_the_adapters_run_did(tmp_path):
    """max_tokens unset (0) in `eval chunk`: the run's task.eval.max_tokens, else 256; a task
    run's own settings may not be 0."""
    from mlxlab.errors import UserError
    from mlxlab.tasks.chunk.cli import max_tokens_for
    from mlxlab.tasks.chunk.config import ChunkEvalConfig, EvalSettings

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("task:\n  name: chunk\n  eval:\n    max_tokens: 512\n")
    assert max_tokens_for(ChunkEvalConfig(), run) == 512
    assert max_tokens_for(ChunkEvalConfig(max_tokens=64), run) == 64  # what the user sets wins
    assert max_tokens_for(ChunkEvalConfig(), None) == 256 == EvalSettings.max_tokens
    (run / "config.yaml").write_text("task:\n  name: chunk\n")
    assert max_tokens_for(ChunkEvalConfig(), run) == 256
    with pytest.raises(UserError, match="max_tokens"):
        EvalSettings(max_tokens=0)
    with pytest.raises(UserError, match="max_tokens"):
        ChunkEvalConfig(max_tokens=-1)


def test_claude_exports_are_read_as_cases(tmp_path):
    from mlxlab.tasks.chunk.config import EvalSettings

    export = [
        {
            "uuid": "conv-1",
            "name": "Parsing JSON",
            "chat_messages": [
                {"uuid": U[0], "sender": "human", "text": "how do I parse JSON?"},
                {"uuid": U[1], "sender": "assistant", "text": "json.loads"},
            ],
        }
    ]
    path = tmp_path / "conversations.json"
    path.write_text(json.dumps(export))
    (case,) = dataset.read_split(path, EvalSettings())
    assert case["id"] == "conv-1" and "(uuid: conv-1)" in pr.prompt(case)
    assert "[human] (uuid: " in pr.prompt(case)


def test_label_relevance_and_memorized_labels():
    assert scoring.token_f1(
        "NumPy argsort: sorting indices", "NumPy argsort: indices that sort"
    ) == pytest.approx(2 * (3 / 4) * (3 / 5) / (3 / 4 + 3 / 5))
    assert scoring.token_f1("", "x y") == 0.0
    answer = json.dumps({"chunks": GOLD})
    assert scoring.score_case(answer, U, GOLD).label_f1 == 1.0
    swapped = [{**GOLD[0], "label": "Python chat"}, GOLD[1]]
    assert scoring.score_case(json.dumps({"chunks": swapped}), U, GOLD).label_f1 == 0.5


def test_label_similarity_by_meaning(tiny_dir):
    """label_sim: the cosine of the matched labels' sentence vectors (tiny-bert here: random
    weights, so only its algebra is checked: a label against itself is 1, a gold chunk no
    predicted chunk covers counts 0, a case without gold gets none)."""
    import numpy as np

    from mlxlab.embed.model import Embedder

    tiny_dir("bert")
    same = scoring.score_case(json.dumps({"chunks": GOLD}), U, GOLD).to_dict()
    assert same["label_pairs"] == [[g["label"]] * 2 for g in GOLD]
    other = [{**GOLD[0], "label": "Python chat"}, GOLD[1]]
    moved = scoring.score_case(json.dumps({"chunks": other}), U, GOLD).to_dict()
    one = [GOLD[1]]  # covers the second gold chunk only
    partial = scoring.score_case(json.dumps({"chunks": one}), U, GOLD).to_dict()
    assert partial["label_pairs"][0] == [None, GOLD[0]["label"]]
    no_gold = scoring.score_case(json.dumps({"chunks": GOLD}), U, None).to_dict()
    rows = [same, moved, partial, no_gold]
    metrics.label_similarity(rows, "tiny-bert")
    e = Embedder("tiny-bert")
    v = e.embed(e.tokenize(["Python chat", GOLD[0]["label"]])).astype(np.float64)
    cos = float(v[0] @ v[1] / np.linalg.norm(v[0]) / np.linalg.norm(v[1]))
    assert same["label_sim"] == pytest.approx(1.0)
    assert moved["label_sim"] == pytest.approx((cos + 1) / 2) and cos < 0.999
    assert partial["label_sim"] == pytest.approx(0.5)
    assert "label_sim" not in no_gold
    assert metrics.summarize(rows)["label_sim"] == pytest.approx((1 + (cos + 1) / 2 + 0.5) / 3)
    assert "| label similarity |" in metrics.table({"m": metrics.summarize(rows)})


@pytest.mark.slow  # CLI subprocesses
def test_data_and_eval_commands(tiny_dir, tmp_path):
    from tests.helpers.cli import run_cli

    tiny_dir("gemma3")
    out = tmp_path / "chunk"
    r = run_cli("data", "chunk", f"out={out}", "train=5", "valid=2", "test=3")
    assert r.returncode == 0, r.stderr
    assert "train: 5 conversations" in r.stdout and (out / "test.cases.json").is_file()
    assert "source docs: train 5, valid 2, test 3" in r.stdout
    assert "| gold chunks per conversation | train | valid | test |" in r.stdout
    assert json.loads((out / "build.json").read_text())["train"] == 5
    again = run_cli("data", "chunk", f"out={out}")
    assert (
        again.returncode == 1 and "force=true" in again.stderr and "Traceback" not in again.stderr
    )
    bad = run_cli("data", "chunk", f"out={tmp_path / 'x'}", "topic_weights=[-1,2]")
    assert bad.returncode == 1 and "topic_weights" in bad.stderr
    res = tmp_path / "res.jsonl"
    ev_run = run_cli(
        "eval",
        "chunk",
        "model=tiny-gemma3",
        f"data={out}",
        "max_tokens=6",
        "batch_size=2",
        f"out={res}",
    )
    assert ev_run.returncode == 0, ev_run.stderr
    assert "| tiny-gemma3 | 3 |" in ev_run.stdout
    rows = [json.loads(x) for x in res.read_text().splitlines()]
    assert len(rows) == 3 and {"wellformed", "boundary_f1", "exact_match", "output"} <= set(rows[0])
    missing = run_cli("eval", "chunk", "model=tiny-gemma3", f"data={tmp_path}")
    assert missing.returncode == 1 and "no test.cases.json" in missing.stderr
    # out= a directory: the default name inside it; an unwritable one fails before any decode
    into = run_cli(
        "eval", "chunk", "model=tiny-gemma3", f"data={out}", "max_tokens=2", f"out={out}"
    )
    assert into.returncode == 0, into.stderr
    assert len((out / "eval_chunk_test.jsonl").read_text().splitlines()) == 3
    under_file = run_cli("eval", "chunk", f"data={out}", f"out={res}/x.jsonl")
    assert under_file.returncode == 1 and "cannot create directory" in under_file.stderr
    assert "Traceback" not in under_file.stderr and "prompts" not in under_file.stderr


@pytest.mark.slow  # end to end: data, base eval, training, tuned eval, report
def test_task_run_trains_evaluates_and_reports(tiny_dir, tmp_path):
    from mlxlab.cli import compose
    from mlxlab.lora import io as lora_io
    from mlxlab.train import cli

    tiny_dir("gemma3")
    tiny_dir("bert")
    report = tmp_path / "exp" / "README.md"
    cfg = compose(
        "train",
        [
            "model=tiny-gemma3",
            "task.name=chunk",
            "task.data.train=6",
            "task.data.valid=2",
            "task.data.test=3",
            "task.eval.max_tokens=6",
            "task.eval.constrained=true",
            "task.eval.shifts=tiny-bert",
            "task.eval_splits=[valid]",
            "data.max_seq_length=8192",  # the tiny tokenizer takes ~1.4 characters a token
            "iters=2",
            "batch_size=2",
            "val_every=0",
            "wandb=disabled",
            f"out_dir={tmp_path / 'run'}",
            f"task.report={report}",
        ],
    )
    summary = cli.run(cfg)
    run_dir = tmp_path / "run"
    assert set(summary["eval"]) == {"base", "tuned", "base, valid", "tuned, valid"}
    assert summary["eval"]["tuned"]["cases"] == 3 and summary["eval"]["tuned, valid"]["cases"] == 2
    assert (run_dir / "eval_tuned_valid.jsonl").is_file()
    for name in ("eval_base.jsonl", "eval_tuned.jsonl", "README.md", "data/train.jsonl"):
        assert (run_dir / name).is_file(), name
    text = report.read_text()
    assert (
        "| base | 3 |" in text
        and "| tuned | 3 |" in text
        and "peak memory" in text
        and "wall time" in text
    )
    assert "| base, constrained | 3 |" in text and "| tuned, constrained | 3 |" in text
    assert "| tuned, valid | 2 |" in text and "| tuned, valid, constrained | 2 |" in text
    assert (run_dir / "eval_tuned.constrained.jsonl").is_file()
    assert "| base, shift boundaries | 3 |" in text and "| tuned, shift boundaries | 3 |" in text
    assert text.count("the topic-shift detector alone (tiny-bert") == 2  # one per split
    assert "- base, tuned: the topic-shift detector alone (tiny-bert" in text
    assert "rows marked shift boundaries: tiny-bert sentence vectors" in text
    assert (run_dir / "eval_tuned.shifts.jsonl").is_file()
    # A run directory stands for its final adapter, never a checkpoint.
    assert lora_io.resolve_dir(run_dir) == run_dir / "adapter"
    (run_dir / "adapter" / "adapter_config.json").unlink()
    (run_dir / "checkpoints").mkdir(exist_ok=True)
    with pytest.raises(Exception, match="without a final adapter"):
        lora_io.resolve_dir(run_dir)


def _allows(grammar, tokenizer, text: str) -> bool:
    """Whether `grammar` allows `text` as a whole answer (its tokens, then end of sequence)."""
    from mlxlab import grammar as G

    c = G.constrain(grammar, tokenizer, len(tokenizer._tokenizer))
    for t in tokenizer.encode(text, add_special_tokens=False):
        if not c.allowed()[t] or not c.matcher.consume_token(t):
            return False
    return bool(c.allowed()[min(tokenizer.eos_token_ids)])


@pytest.fixture(scope="module")
def gemma_tokenizer(tiny_dir):
    from mlx_lm import load

    return load(str(tiny_dir("gemma3")))[1]


def test_a_label_word_is_what_str_split_reads_as_one():
    """grammar.py LABEL_WORD's characters, raw, are exactly those that are not a quote,
    backslash, control character or whitespace; escaped as json.dumps writes them, those and the
    quote and backslash: the scorers count a label's words with str.split, so a label the grammar
    allows has the words they count (the basic plane here; json.dumps writes others as two
    escapes, which the grammar allows)."""
    import re

    word = re.compile(ag.LABEL_WORD)
    for c in range(0x10000):
        ch = chr(c)
        if 0xD800 <= c < 0xE000:
            continue
        ok = not ch.isspace() and c > 0x20 and not 0x7F <= c <= 0xA0
        escaped = json.dumps(ch)[1:-1]
        assert bool(word.fullmatch(escaped)) == ok, hex(c)
        if ch not in '"\\':
            assert bool(word.fullmatch(ch)) == ok, hex(c)


def test_answer_grammar_allows_covers_of_the_conversation_only(gemma_tokenizer):
    """The constrained decode's grammar: the gold answer, any cover in order, and any such
    answer closed early are allowed; a gap, an overlap, a short or generic-length label, a
    foreign uuid or another layout are not."""
    from mlxlab import grammar as G

    grammar = G.lark(ag.answer_grammar(U), "answer")
    ok = [
        GOLD,
        [{"label": "One topic throughout", "start_message_uuid": U[0], "end_message_uuid": U[3]}],
        [
            {"label": f"Topic number {i}", "start_message_uuid": u, "end_message_uuid": u}
            for i, u in enumerate(U)
        ],
        [{**GOLD[0], "label": "Two words"}, {**GOLD[1], "label": " ".join(["word"] * 12)}],
        # json.dumps escapes what the training answers escape: a dash, quotes
        [{**GOLD[0], "label": 'Mapping Types \u2014 "dict"'}, GOLD[1]],
    ]
    for chunks in ok:
        assert _allows(grammar, gemma_tokenizer, pr.answer(chunks)), chunks
    a, b = GOLD
    assert _allows(grammar, gemma_tokenizer, pr.answer([a]))  # closes early: a trailing gap
    bad = [
        [a, {**b, "start_message_uuid": U[3]}],  # a gap
        [a, {**b, "start_message_uuid": U[1]}],  # an overlap
        [{**a, "start_message_uuid": U[1]}, b],  # not from the first message
        [a, {**b, "end_message_uuid": "eeeeeeee-4444-4000-8000-000000000000"}],
        [{**a, "label": "Assert"}, b],  # one word
        [{**a, "label": " ".join(["word"] * 13)}, b],  # 13 words
        [{**a, "label": "The  assert"}, b],  # two spaces
        # whitespace the scorers split words at, escaped or not: 13 words to them
        [{**a, "label": " ".join(["word"] * 11) + "\rmore"}, b],
        [{**a, "label": " ".join(["word"] * 11) + "\u00a0more"}, b],
        [{**a, "label": " ".join(["word"] * 11) + "\u3000more"}, b],
    ]
    for chunks in bad:
        assert not _allows(grammar, gemma_tokenizer, pr.answer(chunks)), chunks

    def unescaped(chunks):  # pr.answer as a model may write it: characters raw, not escaped
        return json.dumps(json.loads(pr.answer(chunks)), ensure_ascii=False)

    assert not _allows(grammar, gemma_tokenizer, unescaped(bad[-1]))
    assert _allows(grammar, gemma_tokenizer, unescaped([{**a, "label": "Caf\u00e9 au lait"}, b]))
    assert not _allows(grammar, gemma_tokenizer, json.dumps({"chunks": GOLD}))  # keys reordered
    assert not _allows(grammar, gemma_tokenizer, json.dumps({"chunks": GOLD}, indent=1))
    odd = ['say "hi"', "back\\slash", "caf\u00e9 \u65e5\u672c"]  # uuids from anyone's JSON
    chunks = [{"label": "Odd uuids here", "start_message_uuid": odd[0], "end_message_uuid": odd[2]}]
    assert _allows(G.lark(ag.answer_grammar(odd), "odd uuids"), gemma_tokenizer, pr.answer(chunks))
    many = [f"m{i:04d}" for i in range(win.WINDOW_MESSAGES)]  # the largest window's grammar
    whole = [{"label": "All of it", "start_message_uuid": many[0], "end_message_uuid": many[-1]}]
    big = G.lark(ag.answer_grammar(many), "the most messages a window holds")
    assert _allows(big, gemma_tokenizer, pr.answer(whole))
    empty = G.lark(ag.answer_grammar([]), "no messages")
    assert _allows(empty, gemma_tokenizer, '{"chunks": []}')
    assert ev.constrained_path(Path("x/eval_base.jsonl")).name == "eval_base.constrained.jsonl"


class _Oracle:
    """A stand-in LM for counting tests: its hidden state at each position is the position, and
    its head puts the argmax on the input's next token there (`wrong`: on token 0 instead)."""

    model_type = "oracle"  # no layer runner: hidden_states calls .model

    def __init__(self, wrong: bool = False):
        import mlx.core as mx

        self.wrong, self.training, self.inputs = wrong, False, None
        oracle = self

        class Embed:
            def as_linear(self, h):
                pos = h[:, 0].astype(mx.int32).tolist()
                nxt = [0 if oracle.wrong else oracle.inputs[p + 1] for p in pos]
                vocab = mx.arange(300_000)[None, :]
                return (vocab == mx.array(nxt)[:, None]).astype(mx.float32)

        class Body:
            embed_tokens = Embed()

            def __call__(self, inputs):
                oracle.inputs = inputs[0].tolist()
                return mx.arange(inputs.shape[1]).reshape(1, -1, 1).astype(mx.float32)

        self.model = Body()

    def __contains__(self, key):
        return False

    def eval(self):
        self.training = False

    def train(self, mode: bool = True):
        self.training = mode


def test_decision_accuracy_counts_each_place(tiny_dir, tmp_path):
    """Teacher-forced decision accuracy: every place `boundary_places` finds is counted once under
    its kind, one- and several-chunk answers apart; a model that always predicts the next token
    gets every place right, one that never does none; the real tiny model's counts match the
    argmax of its own full logits; the model is left in the mode it came in."""
    import mlx.core as mx
    from mlx_lm.utils import load

    from mlxlab.tasks.chunk import cli
    from mlxlab.tasks.chunk.config import ChunkEvalConfig

    model, tokenizer = load(str(tiny_dir("gemma3")))
    cfg = ChunkDataConfig(
        train=2,
        valid=1,
        test=6,
        median_pairs=2,
        topic_weights=[0.5, 0.5],
        max_message_chars=80,
    )
    out = dataset.write_dataset(tmp_path / "d", cfg)
    examples = [json.loads(x) for x in (out / "test.jsonl").read_text().splitlines()]
    totals: dict = {g: {} for g in probes.GROUPS}
    for ex in examples:
        text = ex["messages"][1]["content"]
        chunks = json.loads(text)["chunks"]
        group = totals[probes.GROUPS[len(chunks) > 1]]
        for _, _, kind in probes.boundary_places(text, chunks):
            group[kind] = group.get(kind, 0) + 1
        group[probes.ALL_RIGHT] = group.get(probes.ALL_RIGHT, 0) + 1
    assert totals["several chunks"]["chunk end: another follows"] > 0 and totals["one chunk"]
    for wrong in (False, True):
        oracle = _Oracle(wrong)
        oracle.train()
        got = probes.decision_accuracy(oracle, tokenizer, examples)
        assert oracle.training  # put back as it was
        assert got == {
            g: {k: [0 if wrong else n, n] for k, n in kinds.items()} for g, kinds in totals.items()
        }
    # the real model: right exactly where its full logits' argmax is the gold token (the token
    # found by decoding prefixes, not by offsets)
    result = probes.decision_accuracy(model, tokenizer, examples)
    expect: dict = {g: {} for g in probes.GROUPS}
    for ex in examples:
        text = ex["messages"][1]["content"]
        chunks = json.loads(text)["chunks"]
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": ex["messages"][0]["content"]}],
            add_generation_prompt=True,
            return_dict=False,
        )
        ids = tokenizer.encode(text, add_special_tokens=False)
        pred = mx.argmax(model(mx.array([prompt + ids]))[0], axis=-1).tolist()
        ends = [len(tokenizer.decode(ids[: i + 1])) for i in range(len(ids))]
        group, right = expect[probes.GROUPS[len(chunks) > 1]], []
        for first, _, kind in probes.boundary_places(text, chunks):
            i = next(k for k, end in enumerate(ends) if end > first)
            right.append(pred[len(prompt) + i - 1] == ids[i])
            tally = group.setdefault(kind, [0, 0])
            tally[0] += right[-1]
            tally[1] += 1
        tally = group.setdefault(probes.ALL_RIGHT, [0, 0])
        tally[0] += all(right)
        tally[1] += 1
    assert result == expect
    assert {k: v[1] for k, v in result["several chunks"].items()} == totals["several chunks"]
    assert "| several chunks | chunk end: another follows |" in probes.decisions_table(result)
    # an answer with no chunk is counted apart
    empty = {
        "messages": [examples[0]["messages"][0], {"role": "assistant", "content": '{"chunks": []}'}]
    }
    assert probes.decision_accuracy(model, tokenizer, [empty])["skipped"] == {"no chunks": [0, 1]}
    # the command: counts to `out`, `cases` examples; anything else is a one-line error
    cmd = ChunkEvalConfig(decisions=True, data=str(out), out=str(tmp_path / "c.json"), cases=2)
    cmd.model = str(tiny_dir("gemma3"))
    counted = cli.evaluate(cmd)
    assert json.loads((tmp_path / "c.json").read_text()) == counted
    assert (
        sum(v.get(probes.ALL_RIGHT, [0, 0])[1] for k, v in counted.items() if k in probes.GROUPS)
        == 2
    )
    with pytest.raises(UserError, match="reads a dataset directory"):
        cli.evaluate(ChunkEvalConfig(decisions=True, data=str(tmp_path)))
    bad = tmp_path / "bad"
    bad.mkdir()
    for line in (
        '{"messages": []}',
        '{"messages": [{"content": "x"}, {"content": "{\\"chunks\\": \\"no\\"}"}]}',
        json.dumps({"messages": [{"content": "x"}, {"content": json.dumps({"chunks": [{}]})}]}),
        json.dumps(
            {
                "messages": [
                    {"content": "x"},
                    {"content": json.dumps({"chunks": GOLD}, separators=(",", ":"))},
                ]
            }
        ),
    ):
        (bad / "test.jsonl").write_text(line + "\n")
        with pytest.raises(UserError, match="test.jsonl:1: not a chunk-task example"):
            cli.evaluate(ChunkEvalConfig(decisions=True, data=str(bad)))
    (bad / "test.jsonl").write_text("\n")
    with pytest.raises(UserError, match="no examples"):
        cli.evaluate(ChunkEvalConfig(decisions=True, data=str(bad)))


def _tiny_chunk_cases(tiny_dir, tmp_path, n: int):
    """n short test conversations (one or two topics, two pairs) and the tiny Gemma 3."""
    from mlx_lm.utils import load

    from mlxlab.tasks.chunk.config import EvalSettings

    cfg = ChunkDataConfig(train=2, valid=1, test=n, median_pairs=1, max_message_chars=200)
    out = dataset.write_dataset(tmp_path / "chunk", cfg)
    model, tokenizer = load(str(tiny_dir("gemma3")))
    return model, tokenizer, dataset.read_split(out, EvalSettings())


@pytest.mark.parametrize("batch_size", [2, 1])
def test_constrained_eval_parses_and_uses_only_the_conversations_uuids(
    tiny_dir, tmp_path, batch_size
):
    """A random tiny model writes garbage unconstrained; under the answer grammar every output is
    a cover of this conversation's messages, on the batched and the one-by-one path."""
    model, tokenizer, records = _tiny_chunk_cases(tiny_dir, tmp_path, batch_size)
    free = ev.evaluate(model, tokenizer, records, max_tokens=48, batch_size=batch_size, budget=8192)
    assert all(r["extraction"] == "none" and r["schema"] == 0.0 for r in free)
    held = ev.evaluate(
        model,
        tokenizer,
        records,
        max_tokens=1024,
        batch_size=batch_size,
        constrained=True,
        budget=8192,
    )
    for row, record in zip(held, records, strict=True):
        uuids = [m["uuid"] for m in pr.shown(record["messages"])]
        answer = json.loads(row["output"])  # the whole text, no extraction needed
        assert row["extraction"] == "raw" and list(answer) == ["chunks"] and row["schema"] == 1.0
        assert 1 <= len(answer["chunks"]) <= len(uuids)
        at = 0  # the chunks cover the messages in order
        for chunk in answer["chunks"]:
            assert tuple(chunk) == pr.KEYS  # the label first, as the instructions show
            assert chunk["start_message_uuid"] == uuids[at]
            at = uuids.index(chunk["end_message_uuid"], at) + 1
            assert 2 <= len(chunk["label"].split(" ")) <= 12
        if at == len(uuids):  # closed at the end: nothing to repair
            assert row["ref"] == 100.0 and row["wellformed"] == 100.0 and row["repairs"] == 0
        else:  # early: the scorers cover the trailing gap, at a repair's cost
            assert row["ref"] >= 82.5 and row["notes"] == ["trailing gap covered"]


def test_constrained_eval_keeps_order_and_may_stop_early(tiny_dir, tmp_path):
    """The constrained decode: contiguous chunks from the first message, closed wherever the
    model closes them (the scorers repair a trailing gap)."""
    from mlxlab.tasks.chunk.config import EvalSettings

    model, tokenizer, records = _tiny_chunk_cases(tiny_dir, tmp_path, 2)
    settings = EvalSettings(max_tokens=1024, batch_size=2, constrained=True)
    settings.max_prompt_tokens = 8192
    ev.evaluate_model(model, tokenizer, records, settings, tmp_path / "r.jsonl", "tiny")
    rows = [json.loads(x) for x in (tmp_path / "r.constrained.jsonl").read_text().splitlines()]
    stopped_early = 0
    for row, record in zip(rows, records, strict=True):
        uuids = [m["uuid"] for m in pr.shown(record["messages"])]
        at = 0
        for chunk in json.loads(row["output"])["chunks"]:
            assert chunk["start_message_uuid"] == uuids[at]
            at = uuids.index(chunk["end_message_uuid"], at) + 1
        assert row["ref"] >= 82.5 and ("trailing gap covered" in row["notes"]) == (at < len(uuids))
        stopped_early += at < len(uuids)
    assert stopped_early  # the random model closes early somewhere


@pytest.mark.parametrize("batch_size", [2, 1])
def test_a_watched_step_counts_once_its_token_is_written(tiny_dir, tmp_path, batch_size):
    """mlx-lm's loops ask the processors for one step past a sequence cut at max_tokens; a
    watching constraint counts only the steps whose token was written (the random model, under
    the answer grammar, is overruled at nearly every one)."""
    from mlxlab import grammar

    model, tokenizer, records = _tiny_chunk_cases(tiny_dir, tmp_path, 2)
    windows = win.plan_windows(records, tokenizer, 8192, 2, 4)
    width = ev.n_vocab(model, tokenizer)
    grammars = [grammar.lark(ag.answer_grammar(w.uuids), "answer") for w in windows]
    made = {}

    def constrained(i):
        made[i] = grammar.constrain(grammars[i], tokenizer, width, watch=True)
        return [made[i]]

    prompts = [w.prompt for w in windows]
    complete(model, tokenizer, prompts, 6, batch_size, None, constrained)
    assert len(made) == len(windows)
    for c in made.values():  # no answer closes within 6 tokens: each was cut at 6
        refused = c.refused()
        assert refused and max(refused) < 6 and len(c._refused) == 6


@pytest.mark.parametrize("batch_size", [2, 1])
def test_decodes_after_the_first_reuse_the_prompt_kv(tiny_dir, tmp_path, batch_size):
    """complete with a prompt cache: each prompt is prefilled once; a second decode of the
    same prompts (here under the answer grammar) starts from the stored KV, and both decodes
    give the texts they give without the store."""
    from mlxlab import grammar
    from mlxlab.decode.prompt_cache import PromptCache

    model, tokenizer, records = _tiny_chunk_cases(tiny_dir, tmp_path, 3)
    windows = win.plan_windows(records, tokenizer, 8192, 2, 4)
    prompts = [w.prompt for w in windows]
    width = ev.n_vocab(model, tokenizer)
    grammars = [grammar.lark(ag.answer_grammar(w.uuids), "answer") for w in windows]

    def constrained(i):
        return [grammar.constrain(grammars[i], tokenizer, width)]

    plain = complete(model, tokenizer, prompts, 12, batch_size)
    held = complete(model, tokenizer, prompts, 12, batch_size, processors=constrained)
    kv = PromptCache(1 << 30)
    assert complete(model, tokenizer, prompts, 12, batch_size, cache=kv) == plain
    first = kv.stats()
    assert first["hits"] == 0 and first["entries"] == len(prompts) and first["bytes"] > 0
    again = complete(model, tokenizer, prompts, 12, batch_size, processors=constrained, cache=kv)
    assert again == held
    second = kv.stats()
    assert second["hits"] == len(prompts) and second["entries"] == len(prompts)
    assert second["reused_tokens"] == sum(len(p) - 1 for p in prompts)
    # a store too small for all: the prompts that fit stay (nothing is evicted for the next
    # one, which the next decode would need first) and are reused by every later decode
    first_bytes = first["bytes"] // len(prompts)
    small = PromptCache(first_bytes * 3 // 2)
    assert complete(model, tokenizer, prompts, 12, batch_size, cache=small) == plain
    kept = small.stats()
    assert kept["entries"] == 1
    for _ in range(2):
        assert complete(model, tokenizer, prompts, 12, batch_size, cache=small) == plain
    shortest = min(len(p) for p in prompts)
    assert small.stats()["entries"] == 1
    assert small.stats()["reused_tokens"] - kept["reused_tokens"] >= 2 * (shortest - 1)


def test_an_evaluation_with_two_decodes_prefills_each_prompt_once(tiny_dir, tmp_path, caplog):
    from mlxlab.tasks.chunk.config import EvalSettings

    model, tokenizer, records = _tiny_chunk_cases(tiny_dir, tmp_path, 2)
    settings = EvalSettings(max_tokens=4, batch_size=2, constrained=True)
    with caplog.at_level(logging.INFO, logger="mlxlab.tasks.chunk.evaluate"):
        summary = ev.evaluate_model(
            model, tokenizer, records, settings, tmp_path / "r.jsonl", "tiny"
        )
    assert summary["peak_mem_gb"] > 0  # the held KV included
    assert "prompt tokens not prefilled again" in caplog.text
    n = len(win.plan_windows(records, tokenizer, settings.max_prompt_tokens or 8192, 2, 4))
    assert f"{n} prompts held in" in caplog.text and n > 2
    caplog.clear()
    with caplog.at_level(
        logging.INFO, logger="mlxlab.tasks.chunk.evaluate"
    ):  # one decode: nothing kept
        ev.evaluate_model(
            model, tokenizer, records, EvalSettings(max_tokens=4), tmp_path / "p.jsonl", "tiny"
        )
    assert "prompt KV" not in caplog.text


def test_constrained_eval_is_reported_next_to_the_unconstrained_one(tiny_dir, tmp_path):
    from mlxlab.tasks.chunk.config import EvalSettings

    model, tokenizer, records = _tiny_chunk_cases(tiny_dir, tmp_path, 2)
    settings = EvalSettings(max_tokens=8, batch_size=2, constrained=True, max_prompt_tokens=8192)
    summary = ev.evaluate_model(model, tokenizer, records, settings, tmp_path / "res.jsonl", "tiny")
    held = tmp_path / "res.constrained.jsonl"
    assert summary["constrained"]["results"] == str(held) and summary["results"] == str(
        tmp_path / "res.jsonl"
    )
    assert len(held.read_text().splitlines()) == 2 and summary["constrained"]["cases"] == 2
    head = '{"chunks": [{"label": "'
    for line in held.read_text().splitlines():  # 8 tokens: the schema's opening, or part of it
        output = json.loads(line)["output"]
        assert output and (head.startswith(output) or output.startswith(head)), output
    text = metrics.table({"tiny": summary})
    assert "| tiny | 2 |" in text and "| tiny, constrained | 2 | " in text
    assert text.index("| tiny | 2 |") < text.index("| tiny, constrained |")
    plain = ev.evaluate_model(
        model, tokenizer, records, EvalSettings(max_tokens=2), tmp_path / "plain.jsonl", "tiny"
    )
    assert "constrained" not in plain


def test_multi_topic_f1_leaves_out_one_topic_cases():
    one = {"boundary_f1": 1.0, "gold_chunks": 1, "wellformed": 100.0}
    two = {"boundary_f1": 0.5, "gold_chunks": 2, "wellformed": 100.0}
    three = {"boundary_f1": 0.0, "gold_chunks": 3, "wellformed": 100.0}
    s = metrics.summarize([one, two, three])
    assert s["boundary_f1"] == pytest.approx(0.5) and s["boundary_f1_multi"] == 0.25
    assert s["multi_cases"] == 2 and "boundary_f1_multi" not in metrics.summarize([one])
    assert "| F1 multi-topic |" in metrics.table(
        {"m": {**s, "schema": 1, "anchors": 1, "labels": 1}}
    )


def test_chunks_per_case_against_the_gold_and_over_and_under_splits():
    rows = [
        {"chunks": 3, "gold_chunks": 1, "wellformed": 100.0, "boundary_f1": 0.0},  # over
        {"chunks": 1, "gold_chunks": 4, "wellformed": 100.0, "boundary_f1": 0.0},  # under
        {"chunks": 2, "gold_chunks": 2, "wellformed": 100.0, "boundary_f1": 1.0},
        {"chunks": 0, "gold_chunks": 2, "wellformed": 0.0, "boundary_f1": 0.0},  # none: under
        {"chunks": 2, "wellformed": 100.0},  # no gold: not counted
    ]
    s = metrics.summarize(rows)
    assert (s["chunks_per_case"], s["gold_chunks_per_case"]) == (1.5, 2.25)
    assert (s["over_split"], s["under_split"]) == (1, 2)
    text = metrics.table({"m": {**s, "schema": 1, "anchors": 1, "labels": 1}})
    assert "| 1.50 / 2.25 | 1 / 2 |" in text
    assert "over_split" not in metrics.summarize([rows[-1]])


def test_an_evaluations_time_counts_its_constrained_decode():
    from mlxlab.tasks.chunk.report import (
        eval_seconds,
        memory_line,
        pass_times,
        training_minutes,
        wall_line,
    )

    assert eval_seconds({"seconds": 476.3, "constrained": {"seconds": 536.7}}) == 1013.0
    assert eval_seconds({"seconds": 60.0}) == 60.0

    both = {"seconds": 611.4, "constrained": {"seconds": 682.2}, "shifts": {"seconds": 684.0}}
    assert pass_times(both) == " (10.2 plain, 11.4 constrained, 11.4 shift boundaries)"
    assert pass_times({"seconds": 60.0}) == ""
    evals = {"base": {"seconds": 60.0}, "tuned": both}
    line = wall_line({"seconds": 120.0}, evals, 3000.0)
    assert line == (
        "- wall time: 50.0 min in all; training 2.0 min, base evaluation 1.0 min, tuned "
        "evaluation 33.0 min (10.2 plain, 11.4 constrained, 11.4 shift boundaries)"
    )
    resumed = wall_line({"seconds": 120.0, "start_step": 60}, evals, 3000.0)
    assert resumed.startswith(line + ". Resumed at step 60: ") and resumed.count("(") == 1
    # a summary with the whole run's figures (train/checkpoint.py RunTotals), and one whose are unknown
    whole = {"seconds": 1960.0, "start_step": 16, "resumed_from_step": 16, "resumed_seconds": 0.0}
    assert wall_line(whole, {}, 60.0) == (
        "- wall time: 1.0 min in all; training 32.7 min in all attempts, 0.0 min of it after "
        "resuming at step 16. Resumed at step 16: the total is this attempt's, evaluations read "
        "back from the run their own attempt's"
    )
    unknown = {**whole, "seconds": None, "peak_mem_gb": None}
    assert "training n/a in all attempts" in wall_line(unknown, {}, 60.0)
    assert memory_line(unknown, {"tuned": {"peak_mem_gb": 2.4}}) == (
        "- peak memory: training n/a, tuned evaluation 2.40 GB"
    )
    assert memory_line({"peak_mem_gb": 5.84}, {}) == "- peak memory: training 5.84 GB"
    assert training_minutes({"seconds": 0.007, "start_step": 16}) == (
        "0.0 min of this attempt, resumed at step 16"
    )


def test_the_splits_to_evaluate_are_checked_before_training(tmp_path):
    """eval_splits: held-out splits, each once; dev and export need data.dev (or, in a prebuilt
    dataset, their files): refused at prepare_data, not after the training run."""
    from mlxlab.tasks.chunk.config import ChunkTaskConfig
    from mlxlab.tasks.chunk.task import ChunkTask

    for bad in (["test"], ["train"], ["dev", "dev"]):
        with pytest.raises(UserError, match="each once"):
            ChunkTaskConfig(eval_splits=bad)
    with pytest.raises(UserError, match="needs task.data.dev=true"):
        ChunkTask(ChunkTaskConfig(eval_splits=["dev"])).check_splits(None)
    ChunkTask(ChunkTaskConfig(eval_splits=["dev"], data=ChunkDataConfig(dev=True))).check_splits(
        None
    )
    (tmp_path / "test.cases.json").write_text("[]")
    task = ChunkTask(ChunkTaskConfig(eval_splits=["export"]))
    with pytest.raises(UserError, match="no export split in .*data chunk dev=true"):
        task.check_splits(tmp_path)
    (tmp_path / "export.cases.json").write_text("[]")
    task.check_splits(tmp_path)
