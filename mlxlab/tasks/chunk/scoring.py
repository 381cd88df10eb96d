"""Scoring one answer: the strict well-formedness score and, against gold chunks, the accuracy.

    well-formedness = 100 * (0.30 schema + 0.35 anchors + 0.15 labels + 0.20 nonempty)

- schema: fraction of chunks with string start_message_uuid, end_message_uuid and label;
- anchors: max(0, 1 - repairs / (2 * #chunks)) after validation; each repair counts once:
  an unknown uuid snapped to the first (start) or last (end) message, a unique >= 8-character
  prefix matched to its uuid, an inverted range swapped, a trailing gap covered. Anything else
  (a leading or inner gap, overlapping chunks, a chunk that is not an object) is unrepairable
  and scores anchors 0;
- labels: fraction of labels of 2-12 words that are not generic ("Chunk 1", "Other topics");
- nonempty: at least one chunk.

Accuracy against the gold chunks (when a case has them): boundary F1 (chunk starts after the
first message), the rate of gold chunks reproduced exactly and label F1 (`label_f1`). Every case
also carries the predecessor's score (`ref`, mlxlab/tasks/chunk/ref.py), the one its 95.10 is
held against: `strict` is this module's, where a gap or overlap zeroes the anchors.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field

from mlxlab.tasks.chunk.ref import RefScore, schema_share, score_ref

GENERIC = frozenset(
    "chunk chunks topic topics misc miscellaneous other others general discussion "
    "conversation part section summary untitled n/a na none unknown various stuff "
    "messages message the a and of".split()
)


def extract_json(text: str):
    """(object, method) trying the raw text, then without code fences, then first { to last }."""
    candidates = [("raw", text.strip())]
    fenced = re.search(r"```(?:json)?\s*(.*?)```", text, re.S)
    if fenced:
        candidates.append(("fence", fenced.group(1).strip()))
    if "{" in text and "}" in text:
        candidates.append(("braces", text[text.index("{") : text.rindex("}") + 1]))
    for method, candidate in candidates:
        try:
            return json.loads(candidate), method
        except (json.JSONDecodeError, ValueError):
            continue
    return None, "none"


@dataclass
class Validated:
    spans: list[tuple[int, int]] | None  # message index ranges after repairs; None: unrepairable
    repairs: int = 0
    notes: list[str] = field(default_factory=list)


def _resolve(value, uuids: list[str], index: dict[str, int], fallback: int, notes: list[str]):
    """(message index, repaired?) for a uuid value."""
    if isinstance(value, str) and value in index:
        return index[value], False
    if isinstance(value, str) and len(value) >= 8:
        matches = [i for i, u in enumerate(uuids) if u.startswith(value)]
        if len(matches) == 1:
            notes.append(f"prefix {value!r} matched")
            return matches[0], True
    notes.append(f"unknown uuid {value!r} snapped to message {fallback}")
    return fallback, True


def validate(chunks, uuids: list[str]) -> Validated:
    if not isinstance(chunks, list) or not all(isinstance(c, dict) for c in chunks):
        return Validated(None, notes=["chunks is not a list of objects"])
    if not chunks:
        return Validated([], notes=["no chunks"])
    index = {u: i for i, u in enumerate(uuids)}
    last = len(uuids) - 1
    notes: list[str] = []
    repairs = 0
    spans = []
    for c in chunks:
        s, rs = _resolve(c.get("start_message_uuid"), uuids, index, 0, notes)
        e, re_ = _resolve(c.get("end_message_uuid"), uuids, index, last, notes)
        repairs += rs + re_
        if s > e:
            s, e = e, s
            repairs += 1
            notes.append(f"inverted range {e}..{s} swapped")
        spans.append((s, e))
    spans.sort()
    if spans[0][0] != 0:
        return Validated(None, repairs, notes + ["does not start at the first message"])
    for (_, e0), (s1, _) in zip(spans, spans[1:], strict=False):
        if s1 != e0 + 1:
            kind = "overlap" if s1 <= e0 else "gap"
            return Validated(None, repairs, notes + [f"{kind} between messages {e0} and {s1}"])
    if spans[-1][1] < last:
        spans[-1] = (spans[-1][0], last)
        repairs += 1
        notes.append("trailing gap covered")
    return Validated(spans, repairs, notes)


def is_specific(label) -> bool:
    if not isinstance(label, str):
        return False
    words = label.split()
    if not 2 <= len(words) <= 12:
        return False
    core = [w for w in (re.sub(r"[^a-z/]", "", w.lower()) for w in words) if w]
    return any(w not in GENERIC for w in core)


@dataclass
class CaseScore:
    wellformed: float
    schema: float
    anchors: float
    labels: float
    nonempty: float
    boundary_f1: float | None  # None without gold
    exact_match: float | None
    extraction: str
    repairs: int
    notes: list[str]
    ref: float = 0.0  # the reference scorer's total (score_ref)
    ref_notes: list[str] = field(default_factory=list)
    label_f1: float | None = None  # predicted vs gold label words (`label_f1`); None without gold
    label_pairs: list | None = None  # [predicted, gold] label per gold chunk (`label_matches`)
    ref_resolved: bool = False  # the reference validator resolved every anchor (score_ref spans)

    def to_dict(self) -> dict:
        return asdict(self)


def boundaries(spans: list[tuple[int, int]]) -> set[int]:
    return {s for s, _ in spans if s > 0}


def boundary_f1(gold_spans: list[tuple[int, int]], pred_spans: list[tuple[int, int]]) -> float:
    """F1 of the predicted chunk starts after the first message against gold's; a one-chunk
    answer to a one-chunk case scores 1, no answer 0."""
    gb, pb = boundaries(gold_spans), boundaries(pred_spans)
    if not gb and not pb:
        return 1.0 if pred_spans else 0.0
    tp = len(gb & pb)
    p = tp / len(pb) if pb else 0.0
    r = tp / len(gb) if gb else 0.0
    return 2 * p * r / (p + r) if p + r else 0.0


def spans_of(starts: list[int], n: int) -> list[tuple[int, int]]:
    """The chunks (first, last message) that start at `starts` (ascending, 0 first) and cover
    messages 0..n-1."""
    return [(a, b - 1) for a, b in zip(starts, [*starts[1:], n], strict=True)]


def case_gold_spans(case: dict) -> list[tuple[int, int]] | None:
    """A case's gold chunks as (first, last) indices among its shown messages, in order; None
    without gold."""
    from mlxlab.tasks.chunk.prompt import shown

    if case.get("chunks") is None:
        return None
    return gold_order(case["chunks"], [m["uuid"] for m in shown(case["messages"])])[1]


def gold_order(gold: list[dict], uuids: list[str]) -> tuple[list[dict], list[tuple[int, int]]]:
    """Gold chunks sorted by their place among the messages `uuids`, and their (first, last)
    message indices in that order."""
    index = {u: i for i, u in enumerate(uuids)}
    spans = [(index[g["start_message_uuid"]], index[g["end_message_uuid"]]) for g in gold]
    order = sorted(range(len(gold)), key=spans.__getitem__)
    return [gold[k] for k in order], [spans[k] for k in order]


def _label_words(text) -> list[str]:
    return re.findall(r"[a-z0-9_]+", text.lower()) if isinstance(text, str) else []


def token_f1(pred, gold) -> float:
    """Word-overlap F1 of two labels (lower-cased alphanumeric words, as a bag)."""
    from collections import Counter

    p, g = Counter(_label_words(pred)), Counter(_label_words(gold))
    common = sum((p & g).values())
    if not common:
        return 0.0
    precision, recall = common / sum(p.values()), common / sum(g.values())
    return 2 * precision * recall / (precision + recall)


def label_matches(
    ref: RefScore, gold_spans: list[tuple[int, int]], gold_labels: list[str]
) -> list[list]:
    """[predicted label, gold label] per gold chunk: the label of the predicted chunk that
    overlaps it most (None where none does, or the answer did not validate)."""
    spans = ref.spans or []
    out = []
    for (gs, ge), glabel in zip(gold_spans, gold_labels, strict=True):
        best, best_overlap = None, 0
        for k, (ps, pe) in enumerate(spans):
            overlap = min(ge, pe) - max(gs, ps) + 1
            if overlap > best_overlap:
                best, best_overlap = k, overlap
        out.append([None if best is None else ref.labels_text[best], glabel])
    return out


def label_f1(pairs: list[list]) -> float:
    """Mean over gold chunks (`label_matches`' pairs) of `token_f1` against the label of the
    predicted chunk that overlaps it most (0 where none does, or the answer did not validate)."""
    if not pairs:
        return 0.0
    return sum(token_f1(p, g) for p, g in pairs if p is not None) / len(pairs)


def norm_label(text) -> str:
    return " ".join(text.lower().split()) if isinstance(text, str) else ""


def score_case(
    text: str, uuids: list[str], gold: list[dict] | None, conversation_uuid: str | None = None
) -> CaseScore:
    """The strict score and, with `gold`, the accuracy against it, with the reference score
    beside; without gold (a user's own conversations) the accuracy fields are None."""
    ref = score_ref(text, uuids, conversation_uuid)
    obj, method = extract_json(text)
    chunks = obj.get("chunks") if isinstance(obj, dict) else None
    no_gold = None if gold is None else 0.0
    if not isinstance(chunks, list):
        return CaseScore(
            0.0,
            0.0,
            0.0,
            0.0,
            0.0,
            no_gold,
            no_gold,
            method,
            0,
            ["no chunks list found"],
            ref.ref,
            ref.notes,
            no_gold,
            ref_resolved=ref.spans is not None,
        )
    n = len(chunks)
    schema = schema_share(chunks) if n else 0.0
    v = validate(chunks, uuids)
    anchors = 0.0 if v.spans is None or not n else max(0.0, 1 - v.repairs / (2 * n))
    labels = (
        sum(is_specific(c.get("label")) for c in chunks if isinstance(c, dict)) / n if n else 0.0
    )
    nonempty = 1.0 if n else 0.0
    wf = 100 * (0.30 * schema + 0.35 * anchors + 0.15 * labels + 0.20 * nonempty)
    f1 = exact = lf1 = pairs = None
    if gold is not None:
        ordered, gold_spans = gold_order(gold, uuids)
        pred_spans = v.spans or []
        f1 = boundary_f1(gold_spans, pred_spans)
        exact = len(set(gold_spans) & set(pred_spans)) / len(gold_spans) if gold_spans else 0.0
        pairs = label_matches(ref, gold_spans, [g["label"] for g in ordered])
        lf1 = label_f1(pairs)
    return CaseScore(
        wf,
        schema,
        anchors,
        labels,
        nonempty,
        f1,
        exact,
        method,
        v.repairs,
        v.notes,
        ref.ref,
        ref.notes,
        lf1,
        pairs,
        ref_resolved=ref.spans is not None,
    )
