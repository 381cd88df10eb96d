"""Joined conversations: segments (segments.py) of different ShareGPT conversations put together
where the subject changes, so every topic boundary is known exactly; and the hand-annotated
natural conversations rebuilt from the same source."""

from __future__ import annotations

import collections
import math
import random
from dataclasses import dataclass

import numpy as np

from mlxlab.errors import UserError
from mlxlab.tasks.chunk.histogram import histogram
from mlxlab.tasks.chunk.prompt import TRUNCATED
from mlxlab.tasks.chunk.segments import EMBED_MODEL, Segment, fresh_start, sample_sources, segments
from mlxlab.tasks.chunk.sharegpt import Conversation, load_conversations, new_uuid

JOIN_THRESHOLD = 0.25  # segments joined in one conversation: their means' cosine below this
MAX_MESSAGE_CHARS = 4000  # a longer assistant message is cut here, marked TRUNCATED (0.3%)
CHUNK_WEIGHTS = {2: 0.34, 3: 0.26, 4: 0.16, 5: 0.10, 6: 0.07, 7: 0.04, 8: 0.03}
SINGLE_SHARE = 1 / 3
SINGLE_MIN_EXCHANGES = 4  # one-topic conversations: whole segments of 8+ messages
RETURN_RATE = 0.25  # of conversations with 3+ chunks: one subject comes back
MEDIAN_MESSAGES, SIGMA_MESSAGES = 14, 0.7  # the target; short segments make it ~12
EXCHANGES_PER_CHUNK = 8  # a long target gets at least one chunk per this many exchanges
MIN_MESSAGES, MAX_CASE_MESSAGES = 4, 74


def cut_text(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """`text` cut to about `limit` characters at a line or word end, marked `TRUNCATED`."""
    if len(text) <= limit:
        return text
    head = text[:limit]
    at = max(head.rfind("\n"), head.rfind(" "))
    if at > limit * 0.8:
        head = head[:at]
    return head.rstrip() + TRUNCATED


@dataclass
class Stretch:
    seg: Segment
    start: int  # exchanges [start, stop) of the segment
    stop: int

    def mean(self) -> np.ndarray:
        return self.seg.mean(self.start, self.stop)


class _Picker:
    """Random segment choice for one build: fewest uses first, sources and subjects apart."""

    def __init__(self, segs: list[Segment], rng: random.Random, join_threshold: float):
        self.segs, self.rng, self.join = segs, rng, join_threshold
        self.uses: collections.Counter = collections.Counter()
        self.long = [i for i, s in enumerate(segs) if s.exchanges >= SINGLE_MIN_EXCHANGES]
        cum, total = [], 0.0
        for i in self.long:
            total += min(segs[i].exchanges, MAX_CASE_MESSAGES // 2)
            cum.append(total)
        self.long_cum = cum

    def differs(self, vec: np.ndarray, taken: list[np.ndarray]) -> bool:
        return all(float(vec @ t) < self.join for t in taken)

    def pick(self, need: int, sources: set, taken: list[np.ndarray], single=False, split=False):
        """(segment index, exchanges to take) or None: `need` exchanges from a segment of a new
        source whose subject differs from `taken`; unused if possible, and not much longer than
        `need` (need + 2 exchanges at most; under `SINGLE_MIN_EXCHANGES` while `need` is) unless
        no such segment is left. `single`: the whole of one of `SINGLE_MIN_EXCHANGES`+
        exchanges, drawn with odds by its length; `split`: one with a fresh user message after
        its first exchange (`split_points`)."""
        # segments of SINGLE_MIN_EXCHANGES+ are kept for one-topic chats and long shares
        cap = need + 2 if need >= SINGLE_MIN_EXCHANGES else SINGLE_MIN_EXCHANGES - 1
        tiers = (
            (0, need, cap),
            (0, 1, cap),
            (0, 1, None),
            (1, need, cap),
            (1, 1, None),
            (10**9, 1, None),
        )
        for max_uses, min_len, max_len in tiers:
            if single:
                min_len, max_len = SINGLE_MIN_EXCHANGES, None
            elif split:
                min_len, max_len = max(min_len, 2), None
            for _ in range(300):
                if single:
                    i = self.rng.choices(self.long, cum_weights=self.long_cum)[0]
                else:
                    i = self.rng.randrange(len(self.segs))
                s = self.segs[i]
                if self.uses[i] > max_uses or s.source in sources or s.exchanges < min_len:
                    continue
                if max_len is not None and s.exchanges > max_len:
                    continue
                if split and not split_points(s):
                    continue
                take = s.exchanges if single else min(need, s.exchanges)
                if split:
                    take = s.exchanges
                if self.differs(s.mean(0, take), taken):
                    return i, take
        return None


def split_points(seg: Segment) -> list[int]:
    """Exchanges after the first whose user message can resume the subject after a break
    (`fresh_start`)."""
    return [k for k in range(1, seg.exchanges) if fresh_start(seg.messages[2 * k].text)]


def _plan(
    picker: _Picker, rng: random.Random, single_share: float, return_rate: float, max_chunks: int
) -> list[Stretch]:
    target = int(round(MEDIAN_MESSAGES * math.exp(rng.gauss(0, SIGMA_MESSAGES))))
    exchanges = max(MIN_MESSAGES, min(MAX_CASE_MESSAGES, target)) // 2
    if rng.random() < single_share:
        got = picker.pick(exchanges, set(), [], single=True)
        if got:
            i, take = got
            picker.uses[i] += 1
            return [Stretch(picker.segs[i], 0, min(take, MAX_CASE_MESSAGES // 2))]
    ks = [k for k in CHUNK_WEIGHTS if k <= max_chunks]
    k = rng.choices(ks, weights=[CHUNK_WEIGHTS[x] for x in ks])[0]
    k = max(k, min(max_chunks, math.ceil(exchanges / EXCHANGES_PER_CHUNK)))
    k = min(k, max(2, exchanges))
    alloc = [1] * k
    for _ in range(max(0, exchanges - k)):
        alloc[rng.randrange(k)] += 1
    ret = None
    if k >= 3 and rng.random() < return_rate:
        p1 = rng.randrange(k - 2)
        ret = (p1, rng.randrange(p1 + 2, k))
    stretches: list[Stretch | None] = [None] * k
    sources: set = set()
    taken: list[np.ndarray] = []
    if ret:
        p1, p2 = ret
        got = picker.pick(alloc[p1] + alloc[p2], sources, taken, split=True)
        if got:
            i, _ = got
            seg = picker.segs[i]
            pts = split_points(seg)
            s = min(pts, key=lambda x: (abs(x - alloc[p1]), x))
            stop = min(seg.exchanges, s + alloc[p2])
            stretches[p1], stretches[p2] = Stretch(seg, 0, s), Stretch(seg, s, stop)
            picker.uses[i] += 1
            sources.add(seg.source)
            taken.append(seg.mean(0, stop))
    carry = 0  # exchanges a short segment could not give pass on to the next chunk
    for p in range(k):
        if stretches[p] is not None:
            continue
        got = picker.pick(alloc[p] + carry, sources, taken)
        if got is None:
            continue
        i, take = got
        carry = alloc[p] + carry - take
        seg = picker.segs[i]
        stretches[p] = Stretch(seg, 0, take)
        picker.uses[i] += 1
        sources.add(seg.source)
        taken.append(seg.mean(0, take))
    out = [s for s in stretches if s is not None]
    while sum(s.stop - s.start for s in out) > MAX_CASE_MESSAGES // 2:  # a late split point
        longest = max(out, key=lambda s: s.stop - s.start)
        longest.stop -= 1
    # a stretch that lost its neighbour (no segment found) must not touch its own return
    merged: list[Stretch] = []
    for s in out:
        if merged and merged[-1].seg is s.seg and merged[-1].stop == s.start:
            merged[-1] = Stretch(s.seg, merged[-1].start, s.stop)
        else:
            merged.append(s)
    return merged


def _case(stretches: list[Stretch], rng: random.Random, cid: str, max_chars: int) -> dict:
    conv_uuid = new_uuid(rng)
    messages, chunks = [], []
    for st in stretches:
        first = len(messages)
        for m in st.seg.messages[2 * st.start : 2 * st.stop]:
            text = cut_text(m.text, max_chars) if m.sender == "assistant" else m.text
            messages.append({"uuid": new_uuid(rng), "sender": m.sender, "text": text})
        chunks.append(
            {
                "start_message_uuid": messages[first]["uuid"],
                "end_message_uuid": messages[-1]["uuid"],
                "label": st.seg.label,
                "source": st.seg.source,
            }
        )
    return {
        "id": cid,
        "name": chunks[0]["label"],
        "uuid": conv_uuid,
        "messages": messages,
        "chunks": chunks,
    }


def build_from_segments(
    segs: list[Segment],
    split: str,
    n: int,
    seed: int = 0,
    *,
    join_threshold: float = JOIN_THRESHOLD,
    single_share: float = SINGLE_SHARE,
    return_rate: float = RETURN_RATE,
    max_chunks: int = 8,
    max_chars: int = MAX_MESSAGE_CHARS,
) -> list[dict]:
    """`n` joined conversations of `split` from `segs` (only that split's are used): a share
    `single_share` one segment long (a whole segment of `SINGLE_MIN_EXCHANGES`+ exchanges, odds
    by its length), the rest 2 to `max_chunks` chunks (`CHUNK_WEIGHTS`) of segments from different
    sources whose used exchanges' mean vectors have cosine below `join_threshold` pairwise; of
    those with 3+ chunks, `return_rate` split one segment at a fresh user message and put the
    rest of it after one or more others (the return is its own chunk, with the same label).
    Lengths: a target of messages log-normal around `MEDIAN_MESSAGES`, 4 to 74, shared among
    the chunks at random (a segment shorter than its share gives what it has). Each segment is
    used once before any is used twice."""
    pool = sorted((s for s in segs if s.split == split), key=lambda s: (s.source, s.first))
    if not pool:
        raise UserError(f"no segments of split {split!r}")
    rng = random.Random(f"sharegpt-build:{split}:{seed}")
    picker = _Picker(pool, rng, join_threshold)
    cases = []
    for j in range(n):
        for _ in range(20):  # a plan that found too little (under 4 messages) is drawn again
            plan = _plan(picker, rng, single_share, return_rate, max_chunks)
            if sum(st.stop - st.start for st in plan) >= MIN_MESSAGES // 2:
                break
        else:
            raise UserError(f"split {split!r}: too few segments to build conversations")
        cases.append(_case(plan, rng, f"sharegpt-{split}-{seed}-{j:05d}", max_chars))
    return cases


# Sources embedded per split by default: a sample of train (2,800 of 4,061 conversations give
# ~7,000 segments, ~16,000 exchanges: 1,500 conversations with few segments used twice), all
# of valid and test.
DEFAULT_SOURCES = {"train": 2800, "valid": None, "test": None}


def build(
    split: str = "train",
    n: int = 1500,
    seed: int = 0,
    *,
    sources: int | None | str = "default",
    embedder=None,
    convs: list[Conversation] | None = None,
    log=None,
    **kw,
) -> list[dict]:
    """`n` joined chunk cases of `split` ("train", "valid" or "test"): its conversations
    (`load_conversations`; the first `sources` in `sample_sources` order, None: all, "default":
    `DEFAULT_SOURCES`) cut into segments (`segments`, vectors cached in `CACHE_DIR`) and joined
    (`build_from_segments`, keyword settings passed on)."""
    if split not in ("train", "valid", "test"):
        raise UserError(f"split must be train, valid or test, not {split!r}")
    if sources == "default":
        sources = DEFAULT_SOURCES[split]
    convs = convs if convs is not None else load_conversations()
    if embedder is None:
        from mlxlab.embed.model import Embedder

        embedder = Embedder(EMBED_MODEL)
    segs = segments(sample_sources(convs, split, sources), embedder, log=log)
    return build_from_segments(segs, split, n, seed, **kw)


def sources_for(split: str, n: int) -> int | None:
    """How many of `split`'s chats to cut into segments for `n` joined conversations: twice as
    many for training (1,500 conversations used 4,908 segments of 2,800 chats, with few used
    twice), all of valid's and test's (they are small)."""
    return 2 * n if split == "train" else None


# ------------------------------------------------------------------------------ statistics

BINS = {
    "messages": (4, 10, 20, 40, 76, 10**9),
    "chunks": (1, 2, 3, 4, 6, 100),
    "chars": (0, 2000, 4000, 8000, 16000, 32000, 64000, 10**9),
}


def returns(case: dict) -> int:
    """How many chunks of a case come back to a source an earlier, non-adjacent chunk had."""
    seen, n = set(), 0
    srcs = [c.get("source") for c in case["chunks"]]
    for i, s in enumerate(srcs):
        if s in seen and (i == 0 or srcs[i - 1] != s):
            n += 1
        seen.add(s)
    return n


def stats(cases: list[dict]) -> dict:
    """Histograms of messages, chunks and characters (of the message texts) per conversation,
    medians, the one-topic and returns shares, sources and segments used."""
    msgs = sorted(len(c["messages"]) for c in cases)
    chars = sorted(sum(len(m["text"]) for m in c["messages"]) for c in cases)
    nchunks = [len(c["chunks"]) for c in cases]
    segs = collections.Counter()
    for c in cases:
        index = {m["uuid"]: i for i, m in enumerate(c["messages"])}
        for ch in c["chunks"]:
            segs[(ch["source"], c["messages"][index[ch["start_message_uuid"]]]["text"])] += 1
    med = lambda xs: xs[len(xs) // 2] if xs else 0  # noqa: E731
    return {
        "cases": len(cases),
        "median_messages": med(msgs),
        "max_messages": msgs[-1] if msgs else 0,
        "median_chars": med(chars),
        "max_chars": chars[-1] if chars else 0,
        "mean_chunks": round(sum(nchunks) / max(len(cases), 1), 2),
        "one_topic_share": round(sum(n == 1 for n in nchunks) / max(len(cases), 1), 3),
        "returns_share": round(sum(returns(c) > 0 for c in cases) / max(len(cases), 1), 3),
        "sources": len({ch["source"] for c in cases for ch in c["chunks"]}),
        "chunk_openings": len(segs),
        "chunk_openings_used_twice_or_more": sum(v > 1 for v in segs.values()),
        "truncated_messages": sum(
            m["text"].endswith(TRUNCATED) for c in cases for m in c["messages"]
        ),
        "messages": histogram(msgs, BINS["messages"]),
        "chunks": histogram(nchunks, BINS["chunks"]),
        "chars": histogram(chars, BINS["chars"]),
    }
