"""Conversations over documentation, with known topic boundaries: the chunk task's first data
source (`source: docs` in a build).

A conversation looks like an exported chat: a title, a uuid, alternating `user` / `assistant`
messages, each with its own uuid. The user's short questions steer it (ask about a thing,
follow up, change the subject, now and then come back to an earlier one, say thanks); the
assistant answers at length with real documentation text (topics.py: CPython's reference
topics, the standard library's module docs, NumPy's docstrings; markdown lists and code). The
gold answer has one chunk per stretch on one topic, labelled in the topic's own words (its
title or the summary its documentation opens with, no fixed head; `label`). Topics are split
between train / valid / test, so nothing in evaluation was seen in training; the number of
topics per conversation is skewed toward one or two (`topic_weights`), and everything is
deterministic for a seed.
"""

from __future__ import annotations

import math
import random
import re
import uuid
from collections import Counter
from functools import lru_cache

from mlxlab.tasks.chunk.config import ChunkDataConfig
from mlxlab.tasks.chunk.topics import Topic, load_topics

OPENERS = {
    "numpy": [
        "How do I use `{name}`?",
        "What does np.{short} do?",
        "Is there a NumPy function to {task}?",
        "Can you explain {name} with an example?",
        "quick q: how does np.{short} work",
        "I keep seeing `{short}` in numpy code. What is it for?",
        "I'm trying to {task} with numpy arrays. How?",
    ],
    "module": [
        "How do I use the `{name}` module?",
        "What is Python's {name} module for?",
        "Can you give me an overview of `{name}`?",
        "I need something for this: {task}. Does the standard library have it?",
        "explain the {name} module please",
        "When would I reach for `{name}`?",
    ],
    "ref": [
        "Can you explain {name} in Python?",
        "How does {name} work?",
        "I'm confused about {name}. Can you walk me through it?",
        "What are the rules for {name}?",
        "python question: {name}, how does it work?",
    ],
}

FOLLOW = {
    "Parameters": [
        "What parameters does it take?",
        "What are the arguments?",
        "which args does it accept?",
    ],
    "Returns": ["What does it return?", "And the return value?", "what comes back from it?"],
    "Examples": ["Can you show some examples?", "Example please?", "Could you show it in code?"],
    "Notes": ["Any caveats I should know about?", "Anything subtle about it?", "Any notes on it?"],
    "See Also": ["What related functions are there?", "What else is similar?"],
    "": [
        "Go on.",
        "What else should I know?",
        "Can you give more detail?",
        "And then?",
        "Interesting, tell me more.",
        "ok. continue",
        "What about edge cases?",
    ],
    "member": [
        "What about `{member}`?",
        "And how do I use {member}?",
        "Can you show me {member}?",
        "What does `{member}` do exactly?",
        "ok, and {short}?",
    ],
    "other": ["Tell me about the {heading} part.", "What about {heading}?"],
}

SWITCH = [
    "Thanks! Different question: ",
    "Switching topics. ",
    "Unrelated, but ",
    "ok, another thing. ",
    "Got it. Now something else: ",
    "Thanks. New question: ",
]

RETURN = ["Going back to {name}: ", "Back to {name} for a second. ", "One more on {name}. "]

PREFACE = ["", "", "Sure.\n\n", "Good question.\n\n", "Here is how it works.\n\n", "Yes.\n\n"]

THANKS = [
    ("thanks, that helps", "You're welcome! Let me know if anything else comes up."),
    ("Perfect, thank you!", "Glad it helped."),
    ("great, got it", "Happy to help. Good luck with it!"),
]

LABEL_WORDS = 9  # a gold label's most words: under the metric's 12 with room for a longer copy

TRAILING = frozenset(
    "a an and as at by for from in into of on or the to with over along its their is "
    "are that which than some more most all this these not be can given specified "
    "using two whose where when like efficiently".split()
)

# a module summary's opening that says nothing about the module ("This module provides access to")
BOILERPLATE = re.compile(
    r"^(?:(?:this|the functions in this|importing this) module\s+"
    r"(?:provides|contains|implements|defines|performs|supports|tries to|allows?|enables)\s+"
    r"(?:(?:access|an interface) to\s+)?(?:(?:some|various)\s+)?(?:more\s+)?)",
    re.IGNORECASE,
)


def _phrase(text: str, limit: int) -> list[str]:
    """`text`'s first `limit` words, cut before a parenthesis they leave open (a closing one
    without its opening dropped) and after a word that can end a phrase (not "of", "the", ...;
    2 words kept where there are 2), the first capitalized."""
    out: list[str] = []
    opened: list[int] = []  # where each parenthesis still open was
    for ch in " ".join(text.split()[:limit]):
        if ch == ")" and not opened:
            continue  # "a) ..." in a list's item
        if ch == "(":
            opened.append(len(out))
        elif ch == ")":
            opened.pop()
        out.append(ch)
    text = "".join(out[: opened[0]] if opened else out)
    words = text.split()
    while len(words) > 2 and words[-1].lower().strip(",;:-") in TRAILING:
        words.pop()
    if words:
        words[-1] = words[-1].rstrip(",;:-")
        words[0] = words[0][:1].upper() + words[0][1:]
    return words


def _own_words(topic: Topic) -> str:
    """What a topic's documentation calls it: a reference topic's title, else the one-line summary
    its documentation opens with (a module's without "This module provides ...", links dropped)."""
    if topic.kind == "ref":
        return topic.name
    summary = BOILERPLATE.sub("", topic.summary) if topic.kind == "module" else topic.summary
    return re.sub(r"<https?://[^>]*>", "", summary)


@lru_cache(maxsize=1)
def _shared_phrases() -> frozenset[str]:
    """The label phrases two or more topics would get (NumPy's aliases, np.zeros and np.ones)."""
    counts = Counter(" ".join(_phrase(_own_words(t), LABEL_WORDS)) for t in load_topics())
    return frozenset(p for p, n in counts.items() if n > 1)


def label(topic: Topic) -> str:
    """The gold label, 2 to `LABEL_WORDS` words, in the chunk's own words (`_own_words`: "The
    assert statement", "Compute the variance along the specified axis"), cut as `_phrase` cuts.
    No fixed head names the kind of topic: labels headed "Python X module:" taught the model a
    template that it filled with invented module names off the training domain
    (experiments/chunk_seg4/labels-with-heads.md). Where topics would share a phrase, or a
    phrase is under 2 words, the name follows in parentheses: "Calculate the absolute value
    element-wise (abs)"."""
    words = _phrase(_own_words(topic), LABEL_WORDS)
    if len(words) < 2 or " ".join(words) in _shared_phrases():
        name = topic.name.rsplit(".", 1)[-1]
        words = [*_phrase(" ".join(words) or name, LABEL_WORDS - 1), f"({name})"]
    return " ".join(words)


def title(topic: Topic, rng: random.Random) -> str:
    """A conversation title like an exported chat's (sometimes empty)."""
    if rng.random() < 0.1:
        return ""
    short = topic.name.split(".")[-1] if topic.kind == "numpy" else topic.name
    options = [
        f"{short} question",
        f"Help with {short}",
        " ".join(topic.summary.split()[:6]),
        f"Using {short}",
    ]
    return rng.choice(options)


def _task(topic: Topic) -> str:
    s = topic.summary
    return s[0].lower() + s[1:] if s else topic.name


def _question(topic: Topic, section, rng: random.Random, opener: bool) -> str:
    short = topic.name.rsplit(".", 1)[-1]
    if opener:
        return rng.choice(OPENERS[topic.kind]).format(
            name=topic.name, short=short, task=_task(topic)
        )
    subject = section.subject
    if topic.kind == "module" and subject:
        member = subject
        return rng.choice(FOLLOW["member"]).format(member=member, short=member.rsplit(".", 1)[-1])
    if subject in FOLLOW:
        return rng.choice(FOLLOW[subject])
    return rng.choice(FOLLOW["other"]).format(heading=subject.lower())


def _answer(topic: Topic, sections, rng: random.Random) -> str:
    """Markdown: a preface, then each section (numpy's under its heading in bold)."""
    parts = []
    for s in sections:
        text = s.text
        heading = topic.kind == "numpy" and s.subject in FOLLOW
        parts.append(f"**{s.subject}**\n\n{text}" if heading else text)
    return rng.choice(PREFACE) + "\n\n".join(parts)


def _pairs_count(rng: random.Random, cfg: ChunkDataConfig) -> int:
    """User/assistant pairs in one conversation: log-normal around `median_pairs`, within
    2 .. max_messages / 2."""
    n = round(math.exp(rng.gauss(math.log(cfg.median_pairs), 0.75)))
    return max(2, min(cfg.max_messages // 2, n))


def _mid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def make_conversation(
    topics: list[Topic], rng: random.Random, cfg: ChunkDataConfig, cid: str, weights=None
) -> dict:
    """One case: {id, name, uuid, messages: [{uuid, sender, text}], chunks (gold: start and end
    message uuids, label, and `topic`, the topic's name as a user says it), topics};
    `weights`: the odds of 1, 2, ... topics (default `cfg.topic_weights`)."""
    weights = weights or cfg.topic_weights
    k = rng.choices(range(1, len(weights) + 1), weights=weights)[0]
    k = min(k, cfg.max_messages // 2)  # a topic takes at least one user/assistant pair
    kinds = sorted({t.kind for t in topics})
    chosen = []
    while len(chosen) < min(k, len(topics)):
        kind = rng.choice(kinds)
        pool = [t for t in topics if t.kind == kind and t not in chosen]
        if pool:
            chosen.append(rng.choice(pool))
    pairs = max(_pairs_count(rng, cfg), len(chosen))
    # pairs per topic: at least one each, the rest spread at random, capped by what it can say
    share = [1] * len(chosen)
    for _ in range(pairs - len(chosen)):
        share[rng.randrange(len(chosen))] += 1
    cursor = [0] * len(chosen)  # next section of each topic
    plan = []  # (topic index, pairs) stretches in conversation order
    for i, n in enumerate(share):
        if len(chosen) > 1 and i > 0 and n >= 2 and rng.random() < cfg.return_rate:
            first = rng.randint(1, n - 1)
            plan.append((i, first))
            back = rng.randrange(i)
            plan.append((back, n - first))  # come back to an earlier topic for the rest
        else:
            plan.append((i, n))
    messages, chunks = [], []
    for at, (i, n) in enumerate(plan):
        topic = chosen[i]
        ids = []
        for p in range(n):
            if cursor[i] >= len(topic.sections):
                break
            opener = cursor[i] == 0
            take = rng.choice((1, 2, 2, 3))
            secs = topic.sections[cursor[i] : cursor[i] + take]
            q = _question(topic, secs[0], rng, opener)
            if p == 0 and at > 0:
                if not opener:
                    q = rng.choice(RETURN).format(name=topic.name) + q
                elif rng.random() >= cfg.subtle_rate:
                    q = rng.choice(SWITCH) + q
            cursor[i] += take
            for sender, text in (("user", q), ("assistant", _answer(topic, secs, rng))):
                mid = _mid(rng)
                messages.append(
                    {"uuid": mid, "sender": sender, "text": text[: cfg.max_message_chars]}
                )
                ids.append(mid)
        if ids:
            chunks.append(
                {
                    "start_message_uuid": ids[0],
                    "end_message_uuid": ids[-1],
                    "label": label(topic),
                    "topic": topic.name,
                }
            )
    if len(messages) < 4:  # a one-pair conversation: add a short exchange on the same topic
        for sender, text in zip(("user", "assistant"), rng.choice(THANKS), strict=True):
            messages.append({"uuid": _mid(rng), "sender": sender, "text": text})
        chunks[-1]["end_message_uuid"] = messages[-1]["uuid"]
    elif rng.random() < cfg.thanks_rate and len(messages) + 2 <= cfg.max_messages:
        for sender, text in zip(("user", "assistant"), rng.choice(THANKS), strict=True):
            messages.append({"uuid": _mid(rng), "sender": sender, "text": text})
        chunks[-1]["end_message_uuid"] = messages[-1]["uuid"]
    return {
        "id": cid,
        "name": title(chosen[0], rng),
        "uuid": _mid(rng),
        "messages": messages,
        "chunks": chunks,
        "topics": [t.key for t in chosen],
    }


def split_topics(topics, seed: int, fractions=(0.7, 0.1)) -> dict[str, list[Topic]]:
    """Topics shuffled once for `seed` and cut into train / valid / test (disjoint)."""
    order = list(topics)
    random.Random(seed).shuffle(order)
    n_train = int(len(order) * fractions[0])
    n_valid = int(len(order) * fractions[1])
    return {
        "train": order[:n_train],
        "valid": order[n_train : n_train + n_valid],
        "test": order[n_train + n_valid :],
    }


def build(cfg: ChunkDataConfig | None = None) -> dict[str, list[dict]]:
    """{split: [case, ...]} (cases as `make_conversation` returns them)."""
    cfg = cfg or ChunkDataConfig()
    parts = split_topics(load_topics(), cfg.seed)
    out = {}
    for split in ("train", "valid", "test"):
        rng = random.Random(f"{cfg.seed}-{split}")
        train = split == "train"
        weights = cfg.train_topic_weights if train else None
        out[split] = [
            make_conversation(parts[split], rng, cfg, f"{split}-{i:04d}", weights)
            for i in range(getattr(cfg, split))
        ]
    return out


def numpy_version() -> str | None:
    try:
        import numpy

        return numpy.__version__
    except ImportError:
        return None


def topics_digest() -> dict:
    """How many topics there are and a hash of their keys: the split (and so which topics are
    unseen) depends on the Python and NumPy the dataset is built with."""
    import hashlib

    keys = [t.key for t in load_topics()]
    return {"count": len(keys), "sha256": hashlib.sha256("\n".join(keys).encode()).hexdigest()}
