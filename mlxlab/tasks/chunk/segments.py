"""One-subject segments of real conversations: runs of whole exchanges (a user message and its
answer) cut where the subject changes, read from sentence vectors (the mean of an exchange's
two message vectors, the cosine between consecutive exchanges; the vectors cached under
MLXLAB_HOME) and from what a user message says (a fresh request, or one that leans on the answer
before it). Joins (joins.py) put segments of different conversations together, so every topic
boundary they make is known."""

from __future__ import annotations

import collections
import hashlib
import re
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mlxlab.tasks.chunk.labels import label_of
from mlxlab.tasks.chunk.sharegpt import (
    ANAPHOR_RE,
    CONTINUE_RE,
    REFERS_BACK_RE,
    STARTS_MID_RE,
    Conversation,
    Message,
    annotated_ids,
)

EMBED_MODEL = "all-minilm-l6-v2"


def cache_dir() -> Path:
    """Where sentence vectors are kept between builds: MLXLAB_HOME/cache/sentence-vectors."""
    from mlxlab.runtime import home

    return home() / "cache" / "sentence-vectors"


# ------------------------------------------------------------------------------ sentence vectors

USER_TOKENS = 64
ASSISTANT_TOKENS = 64
MAX_EXCHANGES = 30  # exchanges of a conversation that are embedded (and can feed segments)


def token_ids(embedder, texts: list[str], max_tokens: int) -> list[list[int]]:
    """Each text's token ids, [CLS] + its first tokens + [SEP], at most `max_tokens`.

    mlxlab's `Embedder.tokenize(truncate=True)` uses a tokenizer read from tokenizer.json as is,
    and all-MiniLM-L6-v2's tokenizer.json pads to 128 tokens with [PAD] (id 0); `embed` then
    counts the padding as text (its mask is 1 for every id), which pulls short texts' vectors
    together (two unrelated questions: cosine 0.78 instead of 0.07). The padding is cut here."""
    tok = getattr(embedder, "truncating", None)
    pad = (tok.padding or {}).get("pad_id") if tok is not None else None
    out = []
    for ids in embedder.tokenize(list(texts), truncate=True):
        ids = list(ids)
        if pad is not None:
            while len(ids) > 2 and ids[-1] == pad:
                ids.pop()
        if len(ids) > max_tokens:
            ids = ids[: max_tokens - 1] + ids[-1:]
        out.append(ids)
    return out


class VectorCache:
    """Sentence vectors on disk (`cache_dir()`/<model>.npz: keys and vectors in one file, replaced
    atomically, so a crash or a second build cannot pair keys with the wrong vectors; the older
    <model>.keys.npy / .vectors.npy pair is read when no .npz is there), keyed by a hash of
    (model, token cap, text). A file whose keys and vectors differ in count is ignored."""

    def __init__(self, model: str, directory: Path | str | None = "default"):
        self.model = model
        directory = cache_dir() if directory == "default" else directory
        self.dir = Path(directory) if directory else None
        self.index: dict[str, int] = {}
        self.vectors = np.zeros((0, 0), np.float32)
        self.pending: list[tuple[str, np.ndarray]] = []
        keys, vectors = self._read()
        if keys is not None and len(keys) == len(vectors):
            self.vectors = vectors
            self.index = {str(k): i for i, k in enumerate(keys)}

    def _read(self):
        if not self.dir:
            return None, None
        try:
            if (self.dir / f"{self.model}.npz").exists():
                with np.load(self.dir / f"{self.model}.npz") as f:
                    return f["keys"], f["vectors"]
            if (self.dir / f"{self.model}.keys.npy").exists():
                return (
                    np.load(self.dir / f"{self.model}.keys.npy"),
                    np.load(self.dir / f"{self.model}.vectors.npy"),
                )
        except (OSError, ValueError, KeyError):  # unreadable: embedded again
            pass
        return None, None

    def key(self, text: str, max_tokens: int) -> str:
        return hashlib.sha1(f"{self.model}|{max_tokens}|{text}".encode()).hexdigest()

    def get(self, key: str) -> np.ndarray | None:
        i = self.index.get(key)
        return None if i is None else self.vectors[i]

    def add(self, keys: list[str], vectors: np.ndarray) -> None:
        start = len(self.index)
        self.vectors = vectors.copy() if not start else np.concatenate([self.vectors, vectors])
        for j, k in enumerate(keys):
            self.index[k] = start + j

    def save(self) -> None:
        if not self.dir:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        import os
        import tempfile

        keys = np.array(sorted(self.index, key=self.index.get), dtype="U40")
        fd, tmp = tempfile.mkstemp(prefix=f".{self.model}.", suffix=".npz", dir=self.dir)
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez(f, keys=keys, vectors=self.vectors)
            os.replace(tmp, self.dir / f"{self.model}.npz")
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


EMBED_LOG: dict[str, float] = collections.defaultdict(float)


def text_vectors(
    embedder,
    texts: list[str],
    max_tokens: int,
    cache: VectorCache | None = None,
    chunk: int = 2048,
    log=None,
) -> np.ndarray:
    """[len(texts), dims] vectors of the texts' first `max_tokens` tokens, from `cache` where
    it has them; the rest are embedded `chunk` at a time (the cache saved after each)."""
    keys = [cache.key(t, max_tokens) if cache else "" for t in texts]
    todo = sorted(
        {(k, t) for k, t in zip(keys, texts, strict=True) if not cache or cache.get(k) is None}
    )
    fresh: dict[str, np.ndarray] = {}
    for s in range(0, len(todo), chunk):
        part = todo[s : s + chunk]
        t0 = time.perf_counter()
        ids = token_ids(embedder, [t for _, t in part], max_tokens)
        vecs = np.asarray(embedder.embed(ids), np.float32)
        dt = time.perf_counter() - t0
        EMBED_LOG["seconds"] += dt
        EMBED_LOG["texts"] += len(part)
        EMBED_LOG["tokens"] += sum(map(len, ids))
        if cache:
            cache.add([k for k, _ in part], vecs)
            cache.save()
        else:
            fresh.update({t: v for (_, t), v in zip(part, vecs, strict=True)})
        if log:
            log(
                f"embedded {s + len(part)}/{len(todo)} texts ({sum(map(len, ids))} tokens in "
                f"{dt:.0f}s)"
            )
    if not texts:
        return np.zeros((0, getattr(embedder, "dimensions", 0)), np.float32)
    return np.stack([cache.get(k) if cache else fresh[t] for k, t in zip(keys, texts, strict=True)])


def exchange_vectors(
    conv_messages: list[list[Message]],
    embedder,
    cache: VectorCache | None = None,
    max_exchanges: int = MAX_EXCHANGES,
    log=None,
) -> list[np.ndarray]:
    """For each conversation, [exchanges, dims]: each exchange (a user message and its answer,
    the first `max_exchanges`) the normalised mean of its two message vectors (the user's first
    `USER_TOKENS` tokens, the answer's first `ASSISTANT_TOKENS`), as mlxlab's shift detector
    turns exchanges into vectors."""
    want = {USER_TOKENS: [], ASSISTANT_TOKENS: []}
    for msgs in conv_messages:
        for m in msgs[: 2 * max_exchanges]:
            want[USER_TOKENS if m.sender == "user" else ASSISTANT_TOKENS].append(m.text)
    got = {}
    caps = sorted(set(want))
    for cap in caps:
        texts = sorted(set(t for c in caps if c == cap for t in want[c]))
        vecs = text_vectors(embedder, texts, cap, cache, log=log)
        got[cap] = dict(zip(texts, vecs, strict=True))
    out = []
    for msgs in conv_messages:
        msgs = msgs[: 2 * max_exchanges]
        rows = []
        for k in range(0, len(msgs) - 1, 2):
            u = got[USER_TOKENS][msgs[k].text]
            a = got[ASSISTANT_TOKENS][msgs[k + 1].text]
            v = (u.astype(np.float64) + a) / 2
            rows.append(v / max(np.linalg.norm(v), 1e-12))
        out.append(np.array(rows))
    return out


# ------------------------------------------------------------------------------ segments

SEGMENT_THRESHOLD = 0.45  # consecutive exchanges below this cosine are cut apart (README.md)
FOLLOW_UP_FLOOR = 0.3  # ... unless the later one points back (not a fresh start) and is above this


@dataclass(frozen=True, eq=False)
class Segment:
    """A run of whole exchanges of one source conversation on one subject."""

    source: str  # the base id
    split: str
    first: int  # its first exchange's index in the source conversation
    messages: tuple[Message, ...]
    vectors: np.ndarray  # [exchanges, dims] exchange vectors
    label: str

    @property
    def exchanges(self) -> int:
        return len(self.messages) // 2

    @property
    def key(self) -> str:
        return f"{self.source}:{self.first}"

    def mean(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """The normalised mean vector of exchanges [start, stop)."""
        v = self.vectors[start:stop].astype(np.float64).mean(0)
        return v / max(float(np.linalg.norm(v)), 1e-12)

    def sims(self) -> np.ndarray:
        return (self.vectors[1:] * self.vectors[:-1]).sum(1)


BACK_WORDS = re.compile(
    r"\b(?:it|its|this|that|these|those|them|they|above|previous|same|again|also|too|another|"
    r"instead|there|here|ones?|such|more|else|other|further|now|then|either|still|he|she|his|"
    r"her)\b",
    re.I,
)
# Instructions that work on something already there ("expand on the causes", "add a prayer").
EDIT_VERB_RE = re.compile(
    r"^\W*(?:please\s+)?(?:expand|elaborate|add|remove|delete|change|replace|include|modify|adjust|"
    r"update|fix|improve|shorten|lengthen|simplify|rephrase|reword|redo|revise|refactor|"
    r"convert|translate|summari[sz]e|continue|finish|combine|merge|reduce|increase)\b",
    re.I,
)
FIRST_SENTENCE = re.compile(r"^[^\n.?!]{0,200}")


def fresh_start(text: str) -> bool:
    """Whether a user message can open a segment cut out of the middle of a conversation (or
    resume a subject after a break): not a continuation ("continue", "more"), not opening on
    what came before ("it", "now", "rewrite it", "what about", "why", "thanks" ...:
    `ANAPHOR_RE`), not an edit of something already there ("expand on ...", "add ...":
    `EDIT_VERB_RE`), at least 5 words, and no word that points back ("this", "them", "above",
    "again", "another", "he" ...: `BACK_WORDS`) in it (40 words or more: in its first sentence):
    "are there statistics to back this up?" is not a start."""
    words = text.split()
    return (
        len(words) >= 5
        and not CONTINUE_RE.match(text)
        and not ANAPHOR_RE.match(text)
        and not STARTS_MID_RE.match(text)
        and not EDIT_VERB_RE.match(text)
        and not REFERS_BACK_RE.search(text[:600])
        and not BACK_WORDS.search(text if len(words) < 40 else FIRST_SENTENCE.match(text).group())
    )


def follows_up(text: str) -> bool:
    """Whether a user message plainly carries on from the exchange before it: "continue", an
    opening that leans back ("it", "now", "what about", "why": `ANAPHOR_RE`, `STARTS_MID_RE`),
    a mention of an earlier answer (`REFERS_BACK_RE`), or under 25 words with a word that
    points back (`BACK_WORDS`)."""
    return bool(
        CONTINUE_RE.match(text)
        or ANAPHOR_RE.match(text)
        or STARTS_MID_RE.match(text)
        or REFERS_BACK_RE.search(text[:600])
        or (len(text.split()) < 25 and BACK_WORDS.search(text))
    )


def cut_conversation(
    messages: list[Message],
    vectors: np.ndarray,
    threshold: float = SEGMENT_THRESHOLD,
    floor: float = FOLLOW_UP_FLOOR,
) -> list[tuple[int, int, str | None]]:
    """[(first exchange, stop exchange, why dropped or None)]: the conversation cut before
    every exchange whose cosine with the one before is below `threshold`; the piece it opens is
    kept when its user message is a fresh start (`fresh_start`), else dropped. Two exceptions:
    a "continue" turn is never cut, and a user message that plainly follows up (`follows_up`:
    "can you make it shorter?") with a cosine of at least `floor` carries the subject on. A
    piece is also dropped when no label comes out of its first user message (`label_of`)."""
    n = len(vectors)
    users = [messages[2 * k].text for k in range(n)]
    sims = (vectors[1:] * vectors[:-1]).sum(1)
    starts, dropped = [0], set()
    for j in range(1, n):
        if sims[j - 1] >= threshold or CONTINUE_RE.match(users[j]):
            continue
        if fresh_start(users[j]):
            starts.append(j)
        elif not (follows_up(users[j]) and sims[j - 1] >= floor):
            starts.append(j)
            dropped.add(j)
    out = []
    for a, b in zip(starts, [*starts[1:], n], strict=True):
        why = None
        if a in dropped:
            why = "opens mid-way"
        elif label_of(users[a]) is None:
            why = "no label"
        out.append((a, b, why))
    return out


SEGMENT_STATS: dict[str, object] = {}


def segments(
    convs: list[Conversation],
    embedder,
    threshold: float = SEGMENT_THRESHOLD,
    cache: VectorCache | None | str = "default",
    max_exchanges: int = MAX_EXCHANGES,
    log=None,
) -> list[Segment]:
    """The one-subject segments of `convs` (never of the hand-annotated ones): each conversation's first
    `max_exchanges` exchanges embedded (`exchange_vectors`, cached) and cut where consecutive
    exchanges are less alike than `threshold` (`cut_conversation`). `SEGMENT_STATS` records
    what was kept and dropped, and the time taken."""
    convs = [c for c in convs if c.split != "annotated" and c.id not in annotated_ids()]
    if cache == "default":
        cache = VectorCache(getattr(embedder, "name", EMBED_MODEL))
    t0 = time.perf_counter()
    before = dict(EMBED_LOG)
    vecs = exchange_vectors([list(c.messages) for c in convs], embedder, cache, max_exchanges, log)
    out, why = [], collections.Counter()
    for conv, v in zip(convs, vecs, strict=True):
        msgs = list(conv.messages[: 2 * len(v)])
        for a, b, drop in cut_conversation(msgs, v, threshold):
            if drop:
                why[drop] += 1
                continue
            why["kept"] += 1
            label = label_of(msgs[2 * a].text)
            out.append(Segment(conv.id, conv.split, a, tuple(msgs[2 * a : 2 * b]), v[a:b], label))
    SEGMENT_STATS.update(
        {
            "conversations": len(convs),
            "exchanges": int(sum(len(v) for v in vecs)),
            "pieces": dict(why),
            "segments": len(out),
            "segment exchanges": dict(
                sorted(collections.Counter(min(s.exchanges, 10) for s in out).items())
            ),
            "seconds": round(time.perf_counter() - t0, 1),
            "embed seconds": round(EMBED_LOG["seconds"] - before.get("seconds", 0.0), 1),
            "embedded texts": int(EMBED_LOG["texts"] - before.get("texts", 0)),
            "embedded tokens": int(EMBED_LOG["tokens"] - before.get("tokens", 0)),
        }
    )
    return out


def sample_sources(convs: list[Conversation], split: str, n: int | None = None, seed: int = 0):
    """`split`'s conversations in a seeded hash order, the first `n` (None: all): the sources
    whose exchanges get embedded (embedding every chat costs too much on a CPU)."""
    cs = [c for c in convs if c.split == split]
    cs.sort(key=lambda c: hashlib.sha256(f"sharegpt-sample:{seed}:{c.id}".encode()).digest())
    return cs if n is None else cs[:n]
