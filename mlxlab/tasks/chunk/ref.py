"""The predecessor's chunk-eval (`ref`), reproduced rule for rule: the score its 95.10 is held
against. Its extraction (the trimmed text, then without a ```json fence, then first `{` to
last `}`), its validator (anchors resolve exactly, by the conversation's own uuid snapped to the
first or last message, or by a unique common prefix of 8 or more characters; gaps and overlaps
between chunks cost nothing; a trailing gap is covered by one repair) and its weights:

    ref = 100 * (0.30 schema + 0.35 anchors + 0.15 labels + 0.20 nonempty)
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field


def schema_share(chunks: list) -> float:
    """The share of a non-empty chunk list whose start, end and label are strings (both scorers)."""
    keys = ("start_message_uuid", "end_message_uuid", "label")
    ok = sum(isinstance(c, dict) and all(isinstance(c.get(k), str) for k in keys) for c in chunks)
    return ok / len(chunks)


REF_GENERIC = {
    "technical discussion",
    "conversation",
    "q&a",
    "discussion",
    "chat",
    "general discussion",
}


def extract_json_ref(text: str):
    """The reference extraction: the trimmed text; else that text with a leading ```json or ```
    and a trailing ``` stripped; else its first '{' to its last '}'. None when none parses."""
    t = text.strip()
    candidates = [t]
    fenced = t
    for lead in ("```json", "```"):
        if fenced.startswith(lead):
            fenced = fenced[len(lead) :]
            break
    if fenced.endswith("```"):
        fenced = fenced[:-3]
    candidates.append(fenced.strip())
    if "{" in t and "}" in t and t.index("{") < t.rindex("}"):
        candidates.append(t[t.index("{") : t.rindex("}") + 1])
    for c in candidates:
        try:
            return json.loads(c)
        except (json.JSONDecodeError, ValueError):
            continue
    return None


def resolve_ref(value, uuids, index, conversation_uuid, end: bool):
    """(message index or None, repaired?): the exact uuid; the conversation's own uuid snapped to
    the first (start) or last (end) message; else the message uuid with the longest common
    prefix, if that is >= 8 characters and strictly longer than the second best."""
    if not isinstance(value, str):
        return None, False
    if value in index:
        return index[value], False
    if conversation_uuid is not None and value == conversation_uuid:
        return (len(uuids) - 1 if end else 0), True
    ranked = sorted(
        ((len(os.path.commonprefix((value, u))), i) for i, u in enumerate(uuids)), reverse=True
    )
    if ranked and ranked[0][0] >= 8 and (len(ranked) == 1 or ranked[0][0] > ranked[1][0]):
        return ranked[0][1], True
    return None, False


def validate_ref(chunks: list, uuids: list[str], conversation_uuid: str | None = None):
    """(spans or None, repairs, notes) by the reference validator: anchors resolve as in
    `resolve_ref` (one repair each when not exact; unresolvable: None, the case fails); an
    inverted range is swapped (one repair); gaps and overlaps between chunks cost nothing; a
    trailing gap is covered by extending the latest-ending chunk to the last message (one
    repair)."""
    index = {u: i for i, u in enumerate(uuids)}
    spans, repairs, notes = [], 0, []
    for c in chunks:
        if not isinstance(c, dict):
            return None, repairs, notes + ["a chunk is not an object"]
        s, rs = resolve_ref(c.get("start_message_uuid"), uuids, index, conversation_uuid, False)
        e, re_ = resolve_ref(c.get("end_message_uuid"), uuids, index, conversation_uuid, True)
        if s is None or e is None:
            bad = c.get("start_message_uuid") if s is None else c.get("end_message_uuid")
            return None, repairs, notes + [f"unresolvable anchor {bad!r}"]
        repairs += rs + re_
        if rs or re_:
            notes.append("anchor resolved by the conversation uuid or a prefix")
        if s > e:
            s, e = e, s
            repairs += 1
            notes.append(f"inverted range {e}..{s} swapped")
        spans.append((s, e))
    if spans and uuids:
        latest = max(range(len(spans)), key=lambda k: spans[k][1])
        if spans[latest][1] < len(uuids) - 1:
            spans[latest] = (spans[latest][0], len(uuids) - 1)
            repairs += 1
            notes.append("trailing gap covered")
    return spans, repairs, notes


def is_specific_ref(label) -> bool:
    """2-12 whitespace-separated words, and not exactly one of the generic labels."""
    return (
        isinstance(label, str)
        and 2 <= len(label.split()) <= 12
        and label.strip().lower() not in REF_GENERIC
    )


@dataclass
class RefScore:
    ref: float
    schema: float
    anchors: float
    labels: float
    nonempty: float
    repairs: int
    notes: list[str]
    spans: list[tuple[int, int]] | None = None  # per chunk, after validation (None: it failed)
    labels_text: list = field(default_factory=list)  # each chunk's label value


def score_ref(text: str, uuids: list[str], conversation_uuid: str | None = None) -> RefScore:
    """The predecessor's chunk-eval score of one answer, 0-100, with the weights of `strict`
    (`conversation_uuid`: the uuid the prompt gives the whole conversation, prompt.py
    `conversation_uuid`; None: the snap rule never applies):
    no JSON object or no `chunks` array scores 0; an empty chunk list scores schema, anchors and
    labels 1 and nonempty 0 (80); schema = share of chunks whose start, end and label are
    strings; labels = share that `is_specific_ref`; anchors = max(0, 1 - repairs / (2 * chunks))
    after `validate_ref`, 0 when it fails."""
    obj = extract_json_ref(text)
    chunks = obj.get("chunks") if isinstance(obj, dict) else None
    if not isinstance(chunks, list):
        return RefScore(0.0, 0.0, 0.0, 0.0, 0.0, 0, ["no chunks array"])
    if not chunks:
        return RefScore(80.0, 1.0, 1.0, 1.0, 0.0, 0, ["empty chunk list"])
    n = len(chunks)
    schema = schema_share(chunks)
    labels = sum(isinstance(c, dict) and is_specific_ref(c.get("label")) for c in chunks) / n
    spans, repairs, notes = validate_ref(chunks, uuids, conversation_uuid)
    anchors = 0.0 if spans is None else max(0.0, 1 - repairs / (2 * n))
    total = 100 * (0.30 * schema + 0.35 * anchors + 0.15 * labels + 0.20)
    texts = [c.get("label") if isinstance(c, dict) else None for c in chunks]
    return RefScore(total, schema, anchors, labels, 1.0, repairs, notes, spans, texts)
