"""The chunk task's data: user/assistant conversations with known topic boundaries, the prompt
format, and the windows a long conversation is read in.

A conversation is what an exported chat looks like: a title, a uuid, and alternating `user` /
`assistant` messages, each with its own uuid. The user's short questions steer it (ask about a
thing, follow up, change the subject, now and then come back to an earlier one, say thanks); the
assistant answers at length with real documentation text (mlxlab/data/chunk_topics.py: CPython's
reference topics, the standard library's module docs, NumPy's docstrings; markdown lists and
code). The gold answer has one chunk per stretch on one topic, labelled in the topic's own words
(its title or the summary its documentation opens with, no fixed head; `label`); with
`turn_topics` it opens with each user message's uuid prefix and topic, with `turn_quotes` with
each message's uuid prefix, a user message's opening words and its chunk's number (`turns`). Topics are
split between train / valid / test, so nothing in evaluation was seen in training. The number of
topics per conversation is skewed toward one or two (`topic_weights`), conversations run from 4
to `max_messages` messages (a share of training ones with `brief` answers: `train_brief_rate`),
and everything is deterministic for a seed.

Prompt (one user message, as the predecessor's chunk task): the instructions, then
`Conversation: <title> (uuid: <conversation uuid>)`, a blank line, and each message as
`[sender] (uuid: U)\\n<text>\\n`, joined with `\\n---\\n`; messages with empty text are skipped (and
are not anchors). A conversation longer than the budget is read in `windows` of consecutive
messages that overlap; training sees each window as its own example with the gold clipped to it,
evaluation merges the windows' answers (mlxlab/eval/chunk.py).
"""

from __future__ import annotations

import json
import math
import random
import re
import uuid
from collections import Counter
from functools import lru_cache
from pathlib import Path

from mlxlab.data.chunk_topics import Topic, load_topics
from mlxlab.errors import UserError
from mlxlab.tasks.chunk.config import ChunkDataConfig

INSTRUCTIONS = (
    "Split the conversation below into contiguous chunks, one per topic, covering every message "
    "in order. For each chunk give a short, specific label (2-12 words) that says what it is "
    "about, then the uuids of its first and last message. "
    'Answer with JSON only: {"chunks":[{"label":"...","start_message_uuid":"...",'
    '"end_message_uuid":"..."}]}'
)
# The answer's keys in the order the model writes them: the label first, so the topic is named
# before the model picks the message where it ends (JSON readers, and both scorers, ignore order).
KEYS = ("label", "start_message_uuid", "end_message_uuid")
# With ChunkDataConfig.turn_topics the answer opens with a "turns" list: each user message's
# uuid prefix (this many characters) and the topic it is on, before the chunks (`answer`); with
# ChunkDataConfig.turn_quotes, one entry per message (its prefix, a user message's opening words
# and the number of its chunk); with ChunkDataConfig.starts, with a "starts" list: each chunk's
# first message's uuid prefix.
TURN_CHARS = 8
QUOTE_CHARS = 80  # with ChunkDataConfig.turn_quotes: the most of a user message its entry quotes
STARTS_OPENING = '{"starts": ['  # how an answer with the starts list begins (`answer`)
TRUNCATED = "\n[...]"

# --- the prompt -------------------------------------------------------------------------------


def message_block(m: dict) -> str:
    return f"[{m['sender']}] (uuid: {m['uuid']})\n{m['text']}\n"


def shown(messages: list[dict]) -> list[dict]:
    """The messages a prompt shows (and the only valid anchors): those with non-empty text."""
    return [m for m in messages if isinstance(m.get("text"), str) and m["text"].strip()]


def conversation_uuid(case: dict):
    """The uuid the prompt gives the whole conversation (its `uuid`, else its `id`)."""
    return case.get("uuid") or case.get("id")


def dataset_dir(train) -> Path:
    """The dataset directory a `data.train` names: itself when it is a directory, else the
    directory of the training file."""
    train = Path(train)
    return train if train.is_dir() else train.parent


def header(case: dict) -> str:
    return f"Conversation: {case.get('name') or ''} (uuid: {conversation_uuid(case)})"


def prompt(case: dict, messages: list[dict] | None = None) -> str:
    """The user message for `case` (or for one window of its messages)."""
    msgs = shown(case["messages"] if messages is None else messages)
    return f"{INSTRUCTIONS}\n\n{header(case)}\n\n" + "\n---\n".join(message_block(m) for m in msgs)


def windows(
    costs: list[int], budget: int, overlap: int, max_messages: int = 0
) -> list[tuple[int, int]]:
    """[(first, last)] message index ranges that cover all messages in order, each costing at most
    `budget` (a message over the budget alone is its own window; `fit` cuts its text) and, when
    `max_messages` is set, holding at most that many messages; each after the first reaches past
    the previous one's end and shares its last `overlap` messages (fewer where they would not fit
    with the next one)."""
    cap = max_messages or len(costs)
    out, start, n = [], 0, len(costs)
    while start < n:
        end, total = start, costs[start]
        while end + 1 < n and total + costs[end + 1] <= budget and end + 1 - start < cap:
            end += 1
            total += costs[end]
        out.append((start, end))
        if end == n - 1:
            break
        # the next window reaches past this one's end, sharing up to `overlap` messages
        start = max(end + 1 - overlap, start + 1)
        while start <= end and (sum(costs[start : end + 2]) > budget or end + 2 - start > cap):
            start += 1
    return out


def fit(message: dict, cost, budget: int) -> dict:
    """`message` with its text cut (marked `TRUNCATED`) until cost(message) <= budget."""
    if cost(message) <= budget:
        return message
    text = message["text"]
    lo, hi = 0, len(text)
    while lo < hi:  # the longest prefix that fits
        mid = (lo + hi + 1) // 2
        if cost({**message, "text": text[:mid] + TRUNCATED}) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return {**message, "text": text[:lo] + TRUNCATED}


def window_cases(
    case: dict, cost, budget: int, overlap: int, max_messages: int = 0
) -> list[tuple[int, int, list[dict]]]:
    """[(first, last, messages)] for the shown messages of `case`: the windows within `budget`
    (cost(message) = its block's share of the prompt) and `max_messages`, over-long messages cut
    to fit."""
    msgs = shown(case["messages"])
    costs = [cost(m) for m in msgs]
    return [
        (a, b, [fit(m, cost, budget) for m in msgs[a : b + 1]])
        for a, b in windows(costs, budget, overlap, max_messages)
    ]


def filled_windows(
    case: dict, cost, budget: int, overlap: int, max_messages: int
) -> list[tuple[int, int, list[dict]]]:
    """`window_cases` for windows of a few messages that always hold `max_messages` of them
    (the conversation's last may hold fewer), each after the first sharing `overlap` with the
    one before: where a window's messages do not fit `budget` together, the longest are cut
    (`fit`) to one common cost, the largest at which the window fits. On a chat that alternates
    from a user message, with `max_messages` and `overlap` even, a window then shows whole
    exchanges however long the answers, where `window_cases` would end it early, at a question
    without its answer. Where a window cannot fit even so (messages cut to nothing would still
    cost more than their share: a budget too small for `max_messages` messages), the case is
    planned by `window_cases`."""
    msgs = shown(case["messages"])
    costs = [cost(m) for m in msgs]
    out = []
    for a, b in windows([1] * len(msgs), max_messages, overlap, max_messages):
        part, own = msgs[a : b + 1], costs[a : b + 1]
        if sum(own) > budget:
            lo, hi = 0, max(own)  # the largest cap on one message's cost that fits them all
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if sum(min(c, mid) for c in own) <= budget:
                    lo = mid
                else:
                    hi = mid - 1
            part = [fit(m, cost, lo) for m in part]
            if any(cost(m) > lo for m, c in zip(part, own, strict=True) if c > lo):
                return window_cases(case, cost, budget, overlap, max_messages)
        out.append((a, b, part))
    return out


def clip(chunks: list[dict], uuids: list[str], first: int, last: int) -> list[dict]:
    """The gold chunks restricted to messages first..last (indices into `uuids`)."""
    index = {u: i for i, u in enumerate(uuids)}
    out = []
    for c in chunks:
        s, e = index[c["start_message_uuid"]], index[c["end_message_uuid"]]
        if e < first or s > last:
            continue
        out.append(
            {
                "start_message_uuid": uuids[max(s, first)],
                "end_message_uuid": uuids[min(e, last)],
                **{k: c[k] for k in ("label", "topic") if k in c},
            }
        )
    return out


# --- conversations ----------------------------------------------------------------------------

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
TRAILING = {
    "a",
    "an",
    "and",
    "as",
    "at",
    "by",
    "for",
    "from",
    "in",
    "into",
    "of",
    "on",
    "or",
    "the",
    "to",
    "with",
    "over",
    "along",
    "its",
    "their",
    "is",
    "are",
    "that",
    "which",
    "than",
    "some",
    "more",
    "most",
    "all",
    "this",
    "these",
    "not",
    "be",
    "can",
    "given",
    "specified",
    "using",
    "two",
    "whose",
    "where",
    "when",
    "like",
    "efficiently",
}


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
    from mlxlab.data.chunk_topics import load_topics

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


# a sentence ends at a period after a word (not a list number such as "2." nor "e.g."), before
# the next sentence's capital, code or quote
SENTENCE_END = re.compile(r"(?<![\d.])(?<!\be\.g)(?<!\bi\.e)(?<!\betc)\.(?=\s+[A-Z`\"'*(])")


def brief(text: str, limit: int) -> str:
    """`text`'s opening within `limit` characters (plus a closing ``` where it cuts a code block
    open): whole paragraphs while they fit, else the first one cut after its last line or
    sentence end that fits; if that leaves under a quarter of `limit`, after its last word that
    fits (a hard cut at `limit` for one long word)."""
    paras = text.split("\n\n")
    out = paras[0]
    for p in paras[1:]:
        if len(out) + 2 + len(p) > limit:
            break
        out += "\n\n" + p
    if len(out) > limit:
        ends = [m.end() for m in SENTENCE_END.finditer(out) if m.end() <= limit]
        cut = max([out.rfind("\n", 0, limit + 1), *ends])
        if cut < limit // 4:
            cut = out.rfind(" ", 0, limit + 1)
            cut = cut if cut > 0 else limit
        out = out[:cut].rstrip()
    if out.count("```") % 2:
        out += "\n```"
    return out


def _answer(topic: Topic, sections, rng: random.Random, limit: int = 0) -> str:
    """Markdown: a preface, then each section (numpy's under its heading in bold); `limit` > 0:
    each section's text `brief`."""
    parts = []
    for s in sections:
        text = brief(s.text, limit) if limit > 0 else s.text
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
    topics: list[Topic],
    rng: random.Random,
    cfg: ChunkDataConfig,
    cid: str,
    weights=None,
    brief_rate: float = 0.0,
) -> dict:
    """One case: {id, name, uuid, messages: [{uuid, sender, text}], chunks (gold: start and end
    message uuids, label, and `topic`, the topic's name as a user says it), topics};
    `weights`: the odds of 1, 2, ... topics (default `cfg.topic_weights`); `brief_rate`: the
    chance that its answers are `brief` (`cfg.brief_chars` per section; no draw when 0, so a split
    built without it is the same)."""
    weights = weights or cfg.topic_weights
    limit = cfg.brief_chars if brief_rate > 0 and rng.random() < brief_rate else 0
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
            for sender, text in (("user", q), ("assistant", _answer(topic, secs, rng, limit))):
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
        rate = cfg.train_brief_rate if train else 0.0
        out[split] = [
            make_conversation(parts[split], rng, cfg, f"{split}-{i:04d}", weights, rate)
            for i in range(getattr(cfg, split))
        ]
    return out


def chat(
    case: dict,
    messages: list[dict] | None = None,
    chunks: list[dict] | None = None,
    boundary_weight: float = 1.0,
    layout: ChunkDataConfig | None = None,
):
    """A chat-format training example: the prompt (for a window: its messages) and the gold
    in `layout`'s answer layout (`gold_answer`); with `boundary_weight` != 1, its `loss_weights`
    (`boundary_spans`)."""
    gold = case["chunks"] if chunks is None else chunks
    msgs = case["messages"] if messages is None else messages
    text = gold_answer(msgs, gold, layout)
    record = {
        "messages": [
            {"role": "user", "content": prompt(case, messages)},
            {"role": "assistant", "content": text},
        ]
    }
    if boundary_weight != 1:
        record["loss_weights"] = [[a, b, boundary_weight] for a, b in boundary_spans(text, gold)]
    return record


DECISION_CHARS = 4  # a uuid's first characters: enough to tell a window's messages apart


def boundary_places(text: str, chunks: list[dict]) -> list[tuple[int, int, str]]:
    """(first, end, kind) character spans of `text` (`answer(chunks)`, with or without turns or
    starts) that place the chunks, in order: with starts, each starts item's first
    `DECISION_CHARS` ("starts: the first item" / "a later item") and the character after it
    ("starts: the list goes on" / "it ends"); then per chunk the first `DECISION_CHARS` of its
    start and end uuids ("chunk start: the first" / "a later one", "chunk end: another follows" /
    "the last") and the character after its object ("chunks: the list goes on" / "it ends")."""
    out, at, last = [], 0, len(chunks) - 1

    def uuid_at(at: int, value: str, kind: str) -> None:
        out.append((at + 1, at + 1 + min(DECISION_CHARS, len(value) - 2), kind))

    if text.startswith(STARTS_OPENING):
        at = len(STARTS_OPENING)
        for k, c in enumerate(chunks):
            value = json.dumps(c["start_message_uuid"][:TURN_CHARS])
            at = text.index(value, at)
            uuid_at(at, value, "starts: the first item" if k == 0 else "starts: a later item")
            at += len(value)
            out.append((at, at + 1, "starts: it ends" if k == last else "starts: the list goes on"))
    for k, c in enumerate(chunks):
        for key in ("start_message_uuid", "end_message_uuid"):
            value = json.dumps(c[key])
            at = text.index(f'"{key}": {value}', at) + len(f'"{key}": ')
            if key == "start_message_uuid":
                kind = "chunk start: the first" if k == 0 else "chunk start: a later one"
            else:
                kind = "chunk end: the last" if k == last else "chunk end: another follows"
            uuid_at(at, value, kind)
            at += len(value)
        at = text.index("}", at) + 1
        out.append((at, at + 1, "chunks: it ends" if k == last else "chunks: the list goes on"))
    return [(a, b, kind) for a, b, kind in out if b > a]


def boundary_spans(text: str, chunks: list[dict]) -> list[tuple[int, int]]:
    """The character spans of `boundary_places` (what `boundary_weight` weights)."""
    return [(a, b) for a, b, _ in boundary_places(text, chunks)]


def char_cost(m: dict) -> int:
    return len(message_block(m)) + 5


def training_windows(case: dict, cfg: ChunkDataConfig) -> list[tuple[list[dict], list[dict]]]:
    """[(messages, gold)] of one case: the whole conversation when it fits `window_chars` (and
    `window_messages`), else
    each window of its shown messages (at most `window_messages` of them, when set) with the gold
    clipped to it."""
    uuids = [m["uuid"] for m in shown(case["messages"])]
    return [
        (msgs, clip(case["chunks"], uuids, a, b))
        for a, b, msgs in window_cases(
            case, char_cost, cfg.window_chars, cfg.window_overlap, cfg.window_messages
        )
    ]


def training_examples(case: dict, cfg: ChunkDataConfig, weighted: bool = False) -> list[dict]:
    """The chat examples of one case (`training_windows`: evaluation reads the same windows,
    except that it fills windows capped by `window_messages`, `filled_windows`);
    `weighted`: with `cfg.boundary_weight` on the tokens that place its chunks."""
    weight = cfg.boundary_weight if weighted else 1.0
    return [chat(case, msgs, gold, weight, cfg) for msgs, gold in training_windows(case, cfg)]


def moved_boundary(gold: list[dict], uuids: list[str], rng: random.Random) -> list[dict] | None:
    """`gold` (chunks over `uuids`, in order) with one boundary between two chunks moved by one
    message, earlier or later, keeping every chunk non-empty; None for a one-chunk gold."""
    index = {u: i for i, u in enumerate(uuids)}
    spans = [[index[c["start_message_uuid"]], index[c["end_message_uuid"]]] for c in gold]
    options = []
    for k in range(1, len(spans)):
        if spans[k - 1][1] > spans[k - 1][0]:  # the earlier chunk can give its last message
            options.append((k, -1))
        if spans[k][1] > spans[k][0]:  # the later chunk can give its first message
            options.append((k, +1))
    if not options:
        return None
    k, step = rng.choice(options)
    spans[k - 1][1] += step
    spans[k][0] += step
    return [
        {**c, "start_message_uuid": uuids[s], "end_message_uuid": uuids[e]}
        for c, (s, e) in zip(gold, spans, strict=True)
    ]


def asks(m: dict) -> bool:
    """Whether a message is a user turn the answer's `turns` list names: any sender but the
    assistant (exports call the user `user` or `human`)."""
    return m.get("sender") != "assistant"


def quote(text: str) -> str:
    """The opening of a message as a `turn_quotes` answer quotes it: its text with whitespace
    runs as one space, cut at a word end to at most `QUOTE_CHARS` characters as JSON counts them
    (a character past U+FFFF is two: json.dumps writes it as a surrogate pair, and the answer
    grammar's quote is that long at most)."""

    def units(s: str) -> int:
        return len(s.encode("utf-16-le")) // 2

    flat = " ".join(text.split())
    if units(flat) <= QUOTE_CHARS:
        return flat
    room = flat[: QUOTE_CHARS + 1]
    while units(room) > QUOTE_CHARS + 1:
        room = room[:-1]
    cut = room.rsplit(" ", 1)[0]  # at a word end, when the room holds one
    return cut if cut != room and units(cut) <= QUOTE_CHARS else room[:-1]


def turns(messages: list[dict], chunks: list[dict], quotes: bool = False) -> list[list]:
    """[[uuid prefix, topic], ...]: each shown user message of `messages` in order, its uuid's
    first `TURN_CHARS` characters and the topic of the gold chunk that holds it (the chunk's
    `topic`, what a user calls it: "numpy.argsort", "json"; else its label). The answer writes
    these before its chunks, so the model names each question's topic where it reads it, and a
    chunk starts where the name changes. With `quotes` (ChunkDataConfig.turn_quotes) an entry
    per shown message instead, of every sender: a user message's `[uuid prefix, quote, k]`
    (`quote`: its opening words), any other's `[uuid prefix, k]`, k the number (from 1) of the
    gold chunk that holds it."""
    msgs = shown(messages)
    index = {m["uuid"]: i for i, m in enumerate(msgs)}
    spans = [
        (index[c["start_message_uuid"]], index[c["end_message_uuid"]], c.get("topic") or c["label"])
        for c in chunks
    ]
    out = []
    for i, m in enumerate(msgs):
        if not (quotes or asks(m)):
            continue
        k = next((k for k, (s, e, _) in enumerate(spans) if s <= i <= e), None)
        if k is None:
            raise UserError(f"message {m['uuid']} is in no gold chunk: turns need a cover")
        prefix = m["uuid"][:TURN_CHARS]
        if not quotes:
            out.append([prefix, spans[k][2]])
        else:
            out.append([prefix, quote(m["text"]), k + 1] if asks(m) else [prefix, k + 1])
    return out


def answer(chunks: list[dict], turns: list[list] | None = None, starts: bool = False) -> str:
    """The answer's JSON text, keys in `KEYS` order (what training teaches the model to write);
    with `turns`, opened by `{"turns": [...]` (`turns`); with `starts`, by
    `{"starts": [uuid prefix, ...]` (each chunk's first message, `TURN_CHARS` characters). Both
    scorers read only "chunks"."""
    body = {"chunks": [{k: c[k] for k in KEYS} for c in chunks]}
    if starts:
        body = {"starts": [c["start_message_uuid"][:TURN_CHARS] for c in chunks], **body}
    return json.dumps(body if turns is None else {"turns": turns, **body})


def gold_answer(
    messages: list[dict], chunks: list[dict], layout: ChunkDataConfig | None = None
) -> str:
    """The answer to `chunks` over `messages` as data built with `layout` writes it (None: the
    chunks alone): opened by their `turns` with `turn_topics` or `turn_quotes`, by their `starts`
    with `starts`."""
    topics = bool(layout and layout.turn_topics)
    quotes = bool(layout and layout.turn_quotes)
    opened = turns(messages, chunks, quotes) if topics or quotes else None
    return answer(chunks, opened, bool(layout and layout.starts))


BINS = {
    "messages": (4, 10, 20, 40, 76, 10**9),
    "chunks": (1, 2, 3, 4, 6, 100),
    "length": (0, 1000, 2000, 4000, 8000, 16000, 32000, 10**9),
}


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


def stats(cases: list[dict], length=None, unit: str = "chars") -> dict:
    """Histograms of a split: messages, gold chunks and length (`length(case)`, default the
    prompt's characters) per conversation, with medians."""
    length = length or (lambda c: len(prompt(c)))
    lens = sorted(length(c) for c in cases)
    msgs = sorted(len(shown(c["messages"])) for c in cases)
    return {
        "cases": len(cases),
        "unit": unit,
        "median_length": lens[len(lens) // 2] if lens else 0,
        "max_length": lens[-1] if lens else 0,
        "median_messages": msgs[len(msgs) // 2] if msgs else 0,
        "single_chunk_share": sum(len(c["chunks"]) == 1 for c in cases) / max(len(cases), 1),
        "messages": histogram(msgs, BINS["messages"]),
        "chunks": histogram([len(c["chunks"]) for c in cases], BINS["chunks"]),
        "length": histogram(lens, BINS["length"]),
    }


def stats_markdown(per_split: dict[str, dict]) -> str:
    """The histograms as markdown tables, one column per split."""
    splits = list(per_split)
    unit = next(iter(per_split.values()))["unit"] if per_split else "chars"
    lines = []
    for key, title_ in (
        ("chunks", "gold chunks per conversation"),
        ("messages", "messages per conversation"),
        ("length", f"prompt length ({unit})"),
    ):
        lines += [f"| {title_} | " + " | ".join(splits) + " |", "|---" * (len(splits) + 1) + "|"]
        names = [name for name, _ in per_split[splits[0]][key]]
        for j, name in enumerate(names):
            lines.append(
                f"| {name} | " + " | ".join(str(per_split[s][key][j][1]) for s in splits) + " |"
            )
        lines.append("")
    lines.append(
        "| | "
        + " | ".join(splits)
        + " |\n|---"
        + "|---" * len(splits)
        + "|\n| median length | "
        + " | ".join(str(per_split[s]["median_length"]) for s in splits)
        + " |\n| longest | "
        + " | ".join(str(per_split[s]["max_length"]) for s in splits)
        + " |\n| single-chunk share | "
        + " | ".join(f"{per_split[s]['single_chunk_share']:.2f}" for s in splits)
        + " |"
    )
    return "\n".join(lines)


def _numpy_version() -> str | None:
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


def write_dataset(out_dir, cfg: ChunkDataConfig | None = None) -> Path:
    """Write, atomically, under `out_dir`: <split>.cases.json (whole conversations with gold, what
    `eval chunk` reads), <split>.jsonl (chat format, what `train` reads; long conversations as
    windows) and build.json (the settings, the topic keys per split, the histograms)."""
    import platform
    from dataclasses import asdict

    from mlxlab.fsutil import atomic_dir

    cfg = cfg or ChunkDataConfig()

    def write(tmp: Path) -> None:
        data = build(cfg)
        per_split = {}
        for split, cases in data.items():
            (tmp / f"{split}.cases.json").write_text(json.dumps(cases, indent=1) + "\n")
            with (tmp / f"{split}.jsonl").open("w") as f:
                for case in cases:
                    for ex in training_examples(case, cfg, split == "train"):
                        f.write(json.dumps(ex) + "\n")
            per_split[split] = stats(cases)
        (tmp / "build.json").write_text(
            json.dumps(
                {
                    "task": "chunk",
                    **asdict(cfg),
                    "python": platform.python_version(),
                    "numpy": _numpy_version(),
                    "topics": topics_digest(),
                    "stats": per_split,
                },
                indent=1,
            )
            + "\n"
        )

    return atomic_dir(Path(out_dir), write)


def read_cases(path) -> list[dict]:
    """Cases from a JSON file `[{id, name, messages: [{uuid, sender, text}], chunks?}]` (or a
    dataset directory's test.cases.json), checked with `file: case N: what` errors."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read {path}: {e}") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not JSON ({e.msg} at line {e.lineno})") from None
    if isinstance(data, dict) and isinstance(data.get("cases"), list):
        data = data["cases"]
    if not isinstance(data, list) or not data:
        raise UserError(f"{path}: expected a non-empty JSON list of cases")
    for i, case in enumerate(data):
        where = f"{path}: case {i}"
        if not isinstance(case, dict):
            raise UserError(f"{where}: not an object")
        if "messages" not in case and isinstance(case.get("chat_messages"), list):
            case["messages"] = case["chat_messages"]  # a claude.ai export's conversation
        msgs = case.get("messages")
        if not isinstance(msgs, list):
            raise UserError(f"{where}: no messages list")
        for j, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("uuid"), str) or not m["uuid"]:
                raise UserError(f"{where}: message {j} has no uuid string")
            if not isinstance(m.get("sender", ""), str) or not isinstance(m.get("text", ""), str):
                raise UserError(f"{where}: message {j}: sender and text must be strings")
            m.setdefault("sender", "user")
            m.setdefault("text", "")
        if not shown(msgs):
            raise UserError(f"{where}: no message has text")
        uuids = [m["uuid"] for m in shown(msgs)]
        if len(set(uuids)) != len(uuids):
            raise UserError(f"{where}: duplicate message uuids")
        case.setdefault("id", case.get("uuid") or str(i))
        gold = case.get("chunks")
        if gold is not None:
            ok = isinstance(gold, list) and all(
                isinstance(c, dict)
                and c.get("start_message_uuid") in uuids
                and c.get("end_message_uuid") in uuids
                and isinstance(c.get("label"), str)
                for c in gold
            )
            if not ok:
                raise UserError(
                    f"{where}: gold chunks must be objects with start_message_uuid and "
                    "end_message_uuid (uuids of its shown messages) and a label string"
                )
    return data
