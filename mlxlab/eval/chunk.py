"""Scoring the chunk task: JSON extraction, validation with repairs, well-formedness, accuracy.

Per case, from the model's raw text and the conversation's message uuids:

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
first message), the rate of gold chunks reproduced exactly, label F1 (`label_f1`) and, with an
embedding model, label similarity by meaning (`label_similarity`); with the training split's
labels, the share of predicted labels that are verbatim training labels.
`evaluate` reads a case longer than the prompt budget in windows of consecutive messages
(`plan_windows`; for an adapter that writes `turns`, at most `turns_window_messages` messages, so
its answer has room within `max_tokens`; with `window_messages`, every case in windows of that
many, as such an adapter's training examples are, a window's longest messages cut until it fits
the budget where training would hold fewer: `filled_windows`) and merges their answers into one cover
(`merge_windows`); the merged answer is what is scored. `evaluate_model` runs a whole split and writes per-case results (what `eval
chunk` and the chunk task's base/tuned evaluations call); with
`constrained=true` it decodes the split a second time under `answer_grammar` (mlxlab/grammar.py:
the answer's JSON whose chunks cover the conversation's messages in order, so only where chunks
end and their labels are the model's choice), still batched, and reports those scores as a
second row next to the unconstrained ones.

Two scorers, both with the weights above: `strict` (this module's `score_case`: the
well-formedness above; a gap or overlap zeroes the anchors) and `ref` (`score_ref`: the
predecessor's chunk-eval and its validator, reproduced rule for rule, the one its 95.10 is
held against; see `score_ref`). Each case carries both.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

GENERIC = {
    "chunk",
    "chunks",
    "topic",
    "topics",
    "misc",
    "miscellaneous",
    "other",
    "others",
    "general",
    "discussion",
    "conversation",
    "part",
    "section",
    "summary",
    "untitled",
    "n/a",
    "na",
    "none",
    "unknown",
    "various",
    "stuff",
    "messages",
    "message",
    "the",
    "a",
    "and",
    "of",
}


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


def schema_share(chunks: list) -> float:
    """The share of a non-empty chunk list whose start, end and label are strings (both scorers)."""
    keys = ("start_message_uuid", "end_message_uuid", "label")
    ok = sum(isinstance(c, dict) and all(isinstance(c.get(k), str) for k in keys) for c in chunks)
    return ok / len(chunks)


# --- the reference scorer (the predecessor's chunk-eval) -------------------------------------

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


def _resolve_ref(value, uuids, index, conversation_uuid, end: bool):
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
    `_resolve_ref` (one repair each when not exact; unresolvable: None, the case fails); an
    inverted range is swapped (one repair); gaps and overlaps between chunks cost nothing; a
    trailing gap is covered by extending the latest-ending chunk to the last message (one
    repair)."""
    index = {u: i for i, u in enumerate(uuids)}
    spans, repairs, notes = [], 0, []
    for c in chunks:
        if not isinstance(c, dict):
            return None, repairs, notes + ["a chunk is not an object"]
        s, rs = _resolve_ref(c.get("start_message_uuid"), uuids, index, conversation_uuid, False)
        e, re_ = _resolve_ref(c.get("end_message_uuid"), uuids, index, conversation_uuid, True)
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
    (`conversation_uuid`: the uuid the prompt gives the whole conversation, mlxlab/data/chunk.py
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
    from mlxlab.data.chunk import shown

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


def label_similarity(rows: list[dict], model: str) -> None:
    """Add `label_sim` to each row with gold: the mean over its gold chunks of the cosine
    similarity between the gold label and its matched predicted label (`label_matches`; 0 where
    none) as sentence vectors of embedding model `model` (mlxlab/embed). Runs on this thread."""
    import numpy as np

    from mlxlab.embed.model import Embedder

    texts = sorted(
        {x for r in rows for pair in r.get("label_pairs") or [] for x in pair if isinstance(x, str)}
    )
    if not texts:
        return
    embedder = Embedder(model)
    vectors = embedder.embed(embedder.tokenize(texts, truncate=True)).astype(np.float64)
    vectors /= np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
    at = {t: vectors[i] for i, t in enumerate(texts)}
    for r in rows:
        pairs = r.get("label_pairs")
        if pairs:
            r["label_sim"] = sum(
                float(at[p] @ at[g]) for p, g in pairs if isinstance(p, str)
            ) / len(pairs)


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
    )


METRICS = (
    "ref",
    "wellformed",
    "schema",
    "anchors",
    "labels",
    "nonempty",
    "boundary_f1",
    "exact_match",
    "label_f1",
    "label_sim",
    "memorized_labels",
    "window_ref",
)


def summarize(rows: list[dict]) -> dict:
    """Means of the per-case metrics (rows as `evaluate` returns them); a metric no row has (or
    that is None, as the accuracy without gold) is left out; `window_ref` is the mean over the
    cases read in more than one window. For a constrained decode, of the windows of the cases
    read in several: `overruled_windows` (the grammar refused the model's top token somewhere),
    `unread_windows` (of those, the ones merged as unread: `score_windows`) and `windows`."""
    out = {"cases": len(rows)}
    for k in METRICS:
        values = [r[k] for r in rows if r.get(k) is not None]
        if values:
            out[k] = sum(values) / len(values)
    out["windowed_cases"] = sum(r.get("windows", 1) > 1 for r in rows)
    if any("window_refused" in r for r in rows):  # a constrained decode's windows
        refused = [bool(x) for r in rows for x in r.get("window_refused", [])]
        out["overruled_windows"] = sum(refused)
        out["windows"] = len(refused)
        out["unread_windows"] = sum(r.get("window_unread", 0) for r in rows)
    multi = [r["boundary_f1"] for r in rows if r.get("gold_chunks", 0) >= 2]
    if multi:  # on a one-topic case any one-chunk answer has F1 1: these are the telling ones
        out["boundary_f1_multi"] = sum(multi) / len(multi)
        out["multi_cases"] = len(multi)
    return out


# the second decodes of a split (their summaries under these keys) and their rows' names
PASSES = {"constrained": "constrained", "shifts": "shift boundaries"}


def _fmt(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table(summaries: dict[str, dict]) -> str:
    """A markdown table, one row per evaluated model; a summary's "constrained" entry (the same
    model decoded under the answer grammar) is the row below it, "<name>, constrained", and its
    "shifts" entry (decoded with the topic-shift detector's boundaries) "<name>, shift
    boundaries"."""
    head = (
        "| model | cases | ref | strict | boundary F1 | F1 multi-topic | exact chunks | label F1 "
        "| label similarity | memorized labels | schema | anchors | labels |"
    )
    lines = [head, "|" + "---|" * 13]
    rows = []
    for name, s in summaries.items():
        rows.append((name, s))
        for key, tag in PASSES.items():
            if isinstance(s.get(key), dict):
                rows.append((f"{name}, {tag}", s[key]))
    for name, s in rows:
        lines.append(
            f"| {name} | {s['cases']} | {_fmt(s.get('ref'))} | {s['wellformed']:.1f} | "
            f"{_fmt(s.get('boundary_f1'), 3)} | {_fmt(s.get('boundary_f1_multi'), 3)} | "
            f"{_fmt(s.get('exact_match'), 3)} | "
            f"{_fmt(s.get('label_f1'), 3)} | {_fmt(s.get('label_sim'), 3)} | "
            f"{_fmt(s.get('memorized_labels'), 3)} | "
            f"{s['schema']:.3f} | {s['anchors']:.3f} | {s['labels']:.3f} |"
        )
    return "\n".join(lines)


def read_split(data, settings) -> list[dict]:
    """The cases to evaluate: `data` a JSON file of cases (mlxlab/data/chunk.py `read_cases`), or
    a dataset directory and its `<settings.split>.cases.json`; the first `settings.cases` when
    set."""
    from mlxlab.data.chunk import read_cases
    from mlxlab.errors import UserError

    path = Path(data)
    if path.is_dir():
        path = path / f"{settings.split}.cases.json"
        if not path.is_file():
            raise UserError(
                f"no {path.name} in {data} (build the dataset: python -m mlxlab data chunk "
                "out=DIR; or pass data=FILE.json, a JSON list of cases)"
            )
    elif not path.is_file():
        raise UserError(f"data={data}: no such file or directory")
    cases = read_cases(path)
    return cases[: settings.cases] if settings.cases else cases


def training_labels(data) -> set[str] | None:
    """The gold labels of a dataset directory's train split (normalised), for the memorized-label
    share; None when `data` is not a dataset directory with one."""
    from mlxlab.data.chunk import read_cases

    path = Path(data) / "train.cases.json"
    if not path.is_file():
        return None
    return {_norm_label(c["label"]) for case in read_cases(path) for c in case.get("chunks") or []}


def training_window(data, tokenizer) -> int:
    """The longest prompt (in tokens, with the template's generation prompt) among a dataset
    directory's training examples (chat examples, or preference pairs with a `messages`
    prompt): the window budget that reads a long conversation as the adapter trained on it; 0
    when `data` has no train.jsonl."""
    path = Path(data) / "train.jsonl"
    if not path.is_file():
        return 0
    longest = 0
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line) if line.strip() else {}
            messages = record["messages"]
            if "chosen" not in record:  # a chat example: the prompt is all but the answer
                messages = messages[:-1]
        except (ValueError, KeyError, TypeError):
            messages = None
        if not isinstance(messages, list) or not messages:
            continue  # neither a chat example nor a pair with a chat prompt
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        longest = max(longest, len(ids))
    return longest


def _norm_label(text) -> str:
    return " ".join(text.lower().split()) if isinstance(text, str) else ""


# A label word as the grammar allows it: characters other than a quote, backslash, control
# character or space, or a JSON escape (training answers are json.dumps': "\u2014" for a dash).
LABEL_WORD = r'(?:[^"\\\x00-\x1f\x7f ]|\\["\\bfnrt]|\\u[0-9a-fA-F]{4}){1,40}'
# A turn's topic character: the same, spaces allowed
TOPIC_CHAR = r'(?:[^"\\\x00-\x1f\x7f]|\\["\\bfnrt]|\\u[0-9a-fA-F]{4})'
# Most messages in one window (past what the default 8192-token budget holds; it keeps a
# constrained window's grammar inside llguidance's parser limit of 2000 items per row, which its
# chain of end rules reaches at about 660 messages)
WINDOW_MESSAGES = 500
# A `turns` answer's tokens per message of its window (`turns_window_messages`): a turn_topics entry
# takes about 14 Gemma 3 tokens a user message, 7 a message; a turn_quotes entry about 19 a
# message (chunk_seg4's training answers: median 18.7, at most 41); the rest is room for its
# chunks (about 100 tokens each: a label and two uuids). A heuristic, not a bound: a 512-token
# answer reads at most 17 messages; a window of many short topics can still outgrow it.
ANSWER_TOKENS_PER_MESSAGE = 30
# and at most this many (the grammar's turns openings take about 10 items a user message in its
# start rule, 4 for the topics and 6 for the quotes layout, so a window of all-user messages
# stays inside llguidance's 2000 items a row)
TURNS_WINDOW_MESSAGES = 180


def answer_grammar(
    uuids: list[str],
    cover: bool = True,
    users: list[str] | None = None,
    starts: bool = False,
    fixed: list[int] | None = None,
) -> str:
    """The answer's grammar for one conversation (Lark, for `mlxlab.grammar.lark`): the JSON the
    instructions ask for, `{"chunks": [{"label": ..., "start_message_uuid": ...,
    "end_message_uuid": ...}, ...]}` in the training answers' layout (mlxlab/data/chunk.py
    `answer`), whose chunks follow `uuids` in order: the first starts at the first message, each
    next one at the message after the one before it ends; each label is 2-12 words. With
    `cover` the last chunk ends at the last message, so every answer it allows validates without
    a repair under both scorers and a chunk that ends earlier is followed by another; without,
    the answer may close after any chunk (a trailing gap, which both scorers repair at a cost),
    so the model's wish to stop is not turned into one more chunk. Either way the model chooses
    where chunks end and what they are called (and, with an opening, what it says), nothing
    else. Without messages the only answer is an empty chunk list. With `users` (the uuids of
    the user messages among `uuids`, in order) the answer may instead open with the `"turns"` list a `turn_topics` adapter writes: each of
    those messages' uuid prefix in order, with a topic the model names (1-120 characters); or
    with the one a `turn_quotes` adapter writes: every message's uuid prefix in order, with a
    quote the model writes (at most `QUOTE_CHARS` characters) for a user message, and a chunk
    number (1-999) for each; the chunks that follow are free as above. With
    `starts` it may instead open with the `"starts"` list a `starts` adapter writes: the uuid
    prefixes of the first message and of any later ones the model picks, in order, each once (the
    chunks that follow are free as above: it is the model that ends each chunk before the next
    start it wrote). With `fixed` (indices into `uuids` where chunks start, 0 first, ascending:
    a topic-shift detector's, mlxlab/eval/shifts.py) the chunks are exactly those, to the last
    message, with no opening: the model writes only their labels."""
    from mlxlab.data.chunk import KEYS, QUOTE_CHARS, STARTS_OPENING, TURN_CHARS

    assert KEYS == ("label", "start_message_uuid", "end_message_uuid"), KEYS

    def lit(text: str) -> str:  # a Lark string literal matching `text`
        return json.dumps(text)

    if not uuids:
        return f"start: {lit(json.dumps({'chunks': []}))}"
    assert len(set(uuids)) == len(uuids), "a conversation's shown uuids are distinct"
    n = len(uuids)
    quoted = [lit(json.dumps(u)) for u in uuids]
    opening, closing = lit('{"chunks": ['), lit("]}")
    label, start, end = (lit(f'{", " if k != "label" else "{"}"{k}": ') for k in KEYS)
    word = LABEL_WORD
    rules = [f"start: {opening} c0 {closing}", f'LABEL: /"{word}( {word}){{1,11}}"/']
    if fixed is not None:
        assert fixed[:1] == [0] and fixed == sorted(set(fixed)) and fixed[-1] < n, fixed
        bounds = [*fixed, n]
        body = f" {lit(', ')} ".join(
            f"{label} LABEL {start} {quoted[a]} {end} {quoted[b - 1]} {lit('}')}"
            for a, b in zip(bounds, bounds[1:], strict=False)
        )
        rules[0] = f"start: {opening} {body} {closing}"
        return "\n".join(rules)
    if starts:
        # s{i}: a starts item at message i, then the list ends or goes on from a later message
        # (p{i}: message i or a later one)
        starts_close = lit(', "chunks": [')
        rules[0] += f" | {lit(STARTS_OPENING)} s0 {starts_close} c0 {closing}"
        prefixes = [lit(json.dumps(u[:TURN_CHARS])) for u in uuids]
        for i in range(n):
            more = f" | {prefixes[i]} {lit(', ')} p{i + 1}" if i < n - 1 else ""
            rules.append(f"s{i}: {prefixes[i]} {lit(']')}{more}")
            if i:
                rules.append(f"p{i}: s{i}" + (f" | p{i + 1}" if i < n - 1 else ""))
    if users is not None:
        turns_open, turns_close = lit('{"turns": ['), lit('], "chunks": [')
        topics = f" {lit(', ')} ".join(
            f"{lit('[' + json.dumps(u[:TURN_CHARS]) + ', ')} TOPIC {lit(']')}" for u in users
        )
        asking = set(users)
        quotes = f" {lit(', ')} ".join(
            f"{lit('[' + json.dumps(u[:TURN_CHARS]) + ', ')}"
            + (f" QUOTE {lit(', ')}" if u in asking else "")
            + f" CHUNK {lit(']')}"
            for u in uuids
        )
        rules[0] += f" | {turns_open} {topics} {turns_close} c0 {closing}"
        rules[0] += f" | {turns_open} {quotes} {turns_close} c0 {closing}"
        rules.append(f'TOPIC: /"{TOPIC_CHAR}{{1,120}}"/')
        rules.append(f'QUOTE: /"{TOPIC_CHAR}{{0,{QUOTE_CHARS}}}"/')
        rules.append("CHUNK: /[1-9][0-9]{0,2}/")
    # c{i}: a chunk that starts at message i; e{i}: its end, at message i or a later one (one
    # rule per message, not per pair, so the grammar grows linearly with the window)
    for i in range(n):
        rules.append(f"c{i}: {label} LABEL {start} {quoted[i]} {end} e{i}")
        ends = [f"{quoted[i]} {lit('}, ')} c{i + 1}", f"e{i + 1}"] if i < n - 1 else []
        if i == n - 1 or not cover:
            ends.append(f"{quoted[i]} {lit('}')}")  # the answer may close here
        rules.append(f"e{i}: " + " | ".join(ends))
    return "\n".join(rules)


UUID_CHARS = frozenset("0123456789abcdefABCDEF-")
_PIECES: dict = {}


def uuid_pieces(tokenizer) -> dict[int, str]:
    """{token id: text} of the tokens that can continue a uuid value (hex digits and hyphens, at
    most one leading space and quote: a tokenizer may merge those with the first digits), built
    once per tokenizer."""
    key = getattr(tokenizer, "_tokenizer", tokenizer)
    if key not in _PIECES:
        pieces = {}
        for i, piece in enumerate(key.convert_ids_to_tokens(list(range(len(key))))):
            if not piece:
                continue
            text = piece.replace("\u2581", " ").replace("\u0120", " ")
            core = text.lstrip(' "')
            if len(text) - len(core) <= 2 and core and set(core) <= UUID_CHARS:
                pieces[i] = text
        _PIECES[key] = pieces
    return _PIECES[key]


class SplitBias:
    """An mlx-lm logits processor for one window: inside a chunk's end uuid, `bias` subtracted
    from the log-probability of every token that commits that end to the window's last message
    (the value becomes the last message's uuid and no longer the start of any other message the
    chunk could end at: its start message onwards), once per chunk end. Ending at the last
    message then has to beat the best earlier end by more than `bias`; the earlier ends keep
    their scores. A chunk with no earlier end to choose (it starts at the last message) is left
    alone. Applied in float32, so a small bias survives bf16 logits. `end_choices` measures, on
    the first chunk, whether a model's scores leave anything for such a bias to use."""

    START = re.compile(r'"start_message_uuid": "([^"]*)"')

    def __init__(self, tokenizer, uuids: list[str], bias: float):
        self.tokenizer = tokenizer
        self.uuids = list(uuids)
        self.index = {u: i for i, u in enumerate(self.uuids)}
        self.bias = float(bias)
        self.pieces = uuid_pieces(tokenizer)
        self.start: int | None = None

    def __call__(self, tokens, logits):
        import mlx.core as mx
        import numpy as np

        n = int(tokens.shape[-1]) if tokens is not None else 0
        if self.start is None:
            self.start = n  # the prompt
        text = self.tokenizer.decode(tokens.reshape(-1)[self.start :].tolist()) if n else ""
        at = text.rfind(END_KEY[:-2])
        if at < 0:
            return logits
        tail = text[at + len(END_KEY) - 2 :]  # after `"end_message_uuid":`
        if not set(tail) <= UUID_CHARS | {" ", '"'} or tail.count('"') > 1:
            return logits  # past the value, or not a uuid
        # the messages this chunk may end at: from its start (all of them where the model wrote
        # a start that is none of the window's)
        starts = self.START.findall(text[:at])
        first = self.index.get(starts[-1], 0) if starts else 0
        last, others = self.uuids[-1], self.uuids[first:-1]
        if not others:
            return logits  # no earlier end to prefer

        def committed(value: str) -> bool:
            return last.startswith(value) and not any(o.startswith(value) for o in others)

        if tail.startswith(' "') and tail[2:] and committed(tail[2:]):
            return logits  # the bias was paid when it committed
        hit = [
            i
            for i, piece in self.pieces.items()
            if i < logits.shape[-1]
            and (t := tail + piece).startswith(' "')
            and t.count('"') == 1
            and committed(t[2:])
        ]
        if not hit:
            return logits
        penalty = np.zeros(logits.shape[-1], dtype=np.float32)
        penalty[hit] = self.bias
        return logits.astype(mx.float32) - mx.array(penalty)


def bias_note(settings) -> str:
    """How `split_bias` changed the decoding, for the reports ("" without one)."""
    b = float(getattr(settings, "split_bias", 0.0) or 0.0)
    if b <= 0:
        return ""
    return f"; split_bias {b:g} (ending a chunk at a window's last message costs {b:g} nats)"


def detector_note(summary: dict) -> str:
    """One line on the topic-shift detector's own boundaries (`detector_summary`), '' without."""
    d = (summary.get("shifts") or {}).get("detector") if isinstance(summary, dict) else None
    if not d:
        return ""
    from mlxlab.eval.shifts import Rule

    return (
        f"the topic-shift detector alone ({d['model']}, {Rule(**d['rule'])}; no "
        f"language model): boundary F1 {_fmt(d.get('boundary_f1'), 3)}, F1 multi-topic "
        f"{_fmt(d.get('boundary_f1_multi'), 3)}, {d['chunks_per_case']:.2f} chunks per case"
    )


def constrained_note(settings) -> str:
    """How the constrained rows were decoded, for the reports ("" without `constrained`)."""
    if not getattr(settings, "constrained", False):
        return ""
    order = "to the last message" if getattr(settings, "cover", True) else "closed anywhere"
    trust = (
        "a window the grammar overruled read as the grammar wrote it"
        if getattr(settings, "read_overruled", False)
        else "a window the grammar overruled merged as unread"
    )
    return (
        "; also decoded under the answer's grammar (rows marked constrained: its chunks in "
        f"order, {order}; {trust})"
    )


def overruled_note(summary: dict) -> str:
    """For a constrained decode's summary (`summarize`): in how many of its windows the grammar
    overruled the model, and whether those were merged as unread ("" for any other)."""
    if "overruled_windows" not in summary:
        return ""
    n, total = summary["overruled_windows"], summary["windows"]
    if not n:
        return f"; the grammar overruled the model in none of {total} windows"
    unread = summary.get("unread_windows", 0)
    return f"; the grammar overruled the model in {n} of {total} windows, {unread} merged as unread"


def detector_lines(evals: dict[str, dict]) -> list[str]:
    """The reports' bullet lines on the topic-shift detector (`detector_note`) for evaluations
    by name: one per distinct detector (the same one for every model: one line)."""
    return [f"- {n}" for n in sorted({detector_note(e) for e in evals.values()} - {""})]


def shifts_note(settings) -> str:
    """How the shift-boundaries rows were decoded, for the reports ("" without `shifts`)."""
    model = getattr(settings, "shifts", "")
    if not model:
        return ""
    return (
        "; also decoded with the chunk boundaries of a topic-shift detector (rows marked shift "
        f"boundaries: {model} sentence vectors, a chunk starts at an exchange with a "
        f"{shift_rule(settings)}, its cosine taken with the exchange before; the model writes "
        "the labels)"
    )


def n_vocab(model, tokenizer) -> int:
    """The width of the model's logits (embedding rows; may exceed the tokenizer's vocabulary)."""
    return int(getattr(getattr(model, "args", None), "vocab_size", 0) or len(tokenizer._tokenizer))


def _batch_decode(
    model,
    tokenizer,
    prompts: list[list[int]],
    max_tokens: int,
    processors: list[list] | None,
    sampler=None,
    held: list | None = None,
) -> list[str]:
    """`batch_generate`'s loop with one list of logits processors per row (its own keyword gives
    every row the same processors, and a grammar constraint holds one sequence's state).
    `held`: per row, (a prompt cache, the n prompt tokens it holds: `prefilled`); the row's
    prefill then runs only the prompt's tokens past n."""
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(
        model,
        stop_tokens=[[t] for t in tokenizer.eos_token_ids],
        sampler=sampler,
        prefill_step_size=PREFILL_STEP,
    )
    extra = {}
    if processors is not None:
        extra["logits_processors"] = processors
    if held is not None:
        extra["caches"] = [c for c, _ in held]
        extra["all_tokens"] = [list(p[:n]) for p, (_, n) in zip(prompts, held, strict=True)]
        prompts = [p[n:] for p, (_, n) in zip(prompts, held, strict=True)]
    try:
        uids = gen.insert(prompts, [max_tokens] * len(prompts), **extra)
        tokens: dict[int, list[int]] = {uid: [] for uid in uids}
        while responses := gen.next_generated():
            for r in responses:
                if r.finish_reason != "stop":
                    tokens[r.uid].append(r.token)
    finally:
        gen.close()
    return [tokenizer.decode(tokens[uid]) for uid in uids]


PREFILL_STEP = 512
"""Prompt tokens per forward pass of every prefill an evaluation runs (one row's, `prefilled`,
and mlx-lm's batched one), as serving's `prefill_step`. Measured on the 2-core CPU,
gemma3-270m, random 1,400-token prompts: one row 326 tok/s at 512 against 230 at mlx-lm's 2048
(1,000 tokens: 294 against 267); 32 rows batched 232 against 183, the decode steps after it
unchanged (650 ms at 32 rows)."""
KV_NAMESPACE = "chunk eval"


def kv_budget() -> int:
    """The bytes of prompt KV an evaluation keeps for its decodes after the first: a quarter of
    the machine's memory, at most 4 GiB. gemma3-270m holds at most ~37 KB per prompt token in
    float32 (18 layers, one KV head of 256; prefilled in steps of PREFILL_STEP, the
    sliding-window layers keep at most their window plus a step of it). Prompts past the budget are not kept
    (`prefilled`) and are prefilled again."""
    from mlxlab.serve.engine.admission import total_memory_bytes

    return min(4 << 30, total_memory_bytes() // 4)


def prefilled(model, prompt: list[int], kv) -> tuple[list, int]:
    """(a prompt cache holding `prompt[:n]`, n = len(prompt) - 1): the longest prefix `kv`
    (serving's PromptCache) has, the rest run here in steps of PREFILL_STEP tokens (serving's
    `prefill`). What was run is stored back in `kv` (a copy: the caller's cache is the decode's)
    only where it fits without evicting anything: every decode walks the prompts in the same
    order, so evicting would drop the entry the next decode needs first, and with none evicted
    the first prompts stay and are reused by every decode after."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from mlxlab.serve.engine.prompt_cache import prefill

    head = list(prompt[:-1])
    cache, n = kv.fetch(KV_NAMESPACE, prompt)
    if cache is None:
        cache, n = make_prompt_cache(model), 0
    if n < len(head):
        prefill(model, cache, head[n:], PREFILL_STEP)
        mx.clear_cache()
        kv.insert(KV_NAMESPACE, head, cache, evict=False)
    return cache, len(head)


def generate_all(
    model,
    tokenizer,
    prompts: list[list[int]],
    max_tokens: int,
    batch_size: int,
    progress=None,
    processors=None,
    sampler=None,
    kv=None,
) -> list[str]:
    """Completions of token-id prompts, in order: greedy, or drawn by `sampler` (mlx-lm's
    `make_sampler`; seed MLX's generator first for a repeatable draw).

    batch_size > 1 decodes groups of similar length together with mlx-lm's `batch_generate`
    (left-padded, so a case's text can differ from its unbatched decode in rare near-ties);
    batch_size = 1 uses mlx-lm's `generate` one prompt at a time. `processors(i)`, when given,
    returns prompt i's logits processors (fresh ones: a constraint holds its sequence's state),
    made when its group starts; the groups then run on mlx-lm's `BatchGenerator` with a list
    per row. `kv` (serving's `PromptCache`, for one model): each prompt is prefilled on its own
    (`prefilled`), reusing the KV a decode before stored there for the same prompt, and the
    decode starts from it; a second decode of the same prompts then skips their prefill. A
    decode with `kv` prefills one row at a time instead of mlx-lm's batched prefill, so its texts
    can differ from the decode without it in rare near-ties, as batched ones can from unbatched
    (at batch size 1 the logits processors then see the prompt's last token as its start: both
    of ours take the context at their first call as the prompt). The model decodes in eval mode
    (no dropout) and is put back as it was.
    """
    was_training = model.training
    model.eval()
    try:
        return _decode_groups(
            model, tokenizer, prompts, max_tokens, batch_size, progress, processors, sampler, kv
        )
    finally:
        model.train(was_training)


def _decode_groups(
    model, tokenizer, prompts, max_tokens, batch_size, progress, processors, sampler, kv=None
) -> list[str]:
    """generate_all's loop: length-sorted groups of `batch_size` prompts."""
    from mlx_lm import batch_generate, generate

    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    texts: list[str] = [""] * len(prompts)
    done = 0
    for at in range(0, len(order), batch_size):
        group = order[at : at + batch_size]
        rows = [processors(i) for i in group] if processors else None
        held = [prefilled(model, prompts[i], kv) for i in group] if kv is not None else None
        if batch_size == 1:
            cache, n = held[0] if held else (None, 0)
            outs = [
                generate(
                    model,
                    tokenizer,
                    prompts[group[0]][n:],
                    max_tokens=max_tokens,
                    logits_processors=rows[0] if rows else None,
                    sampler=sampler,
                    prompt_cache=cache,
                    prefill_step_size=PREFILL_STEP,
                )
            ]
        elif rows or held:
            outs = _batch_decode(
                model, tokenizer, [prompts[i] for i in group], max_tokens, rows, sampler, held
            )
        else:
            outs = batch_generate(
                model,
                tokenizer,
                [prompts[i] for i in group],
                max_tokens=max_tokens,
                sampler=sampler,
                prefill_step_size=PREFILL_STEP,
            ).texts
        for i, text in zip(group, outs, strict=True):
            texts[i] = text
        done += len(group)
        if progress:
            progress(done, len(prompts))
    return texts


def max_prompt_tokens(model, settings) -> int:
    """The window budget: `settings.max_prompt_tokens`, or when 0 what the model's context leaves
    after the answer, at most `AUTO_PROMPT_TOKENS`."""
    if getattr(settings, "max_prompt_tokens", 0):
        return settings.max_prompt_tokens
    args = getattr(model, "args", None)
    context = int(getattr(args, "max_position_embeddings", 0) or 0) or AUTO_PROMPT_TOKENS
    return max(256, min(context - settings.max_tokens, AUTO_PROMPT_TOKENS))


AUTO_PROMPT_TOKENS = 8192  # the default budget's cap: prefill time and memory grow past it


@dataclass
class Window:
    case: int
    first: int  # index of its first message among the case's shown messages
    last: int
    uuids: list[str]
    prompt: list[int]
    users: list[str] = field(default_factory=list)  # its user messages' uuids, in order


def turns_window_messages(max_tokens: int) -> int:
    """Most messages in one window when a `turns` answer may take `max_tokens`: about
    `ANSWER_TOKENS_PER_MESSAGE` each (a turns entry per user message and the chunks), at least 8,
    at most `TURNS_WINDOW_MESSAGES`."""
    return min(TURNS_WINDOW_MESSAGES, max(8, max_tokens // ANSWER_TOKENS_PER_MESSAGE))


# the answer-opening eval settings and the ChunkDataConfig options each follows
OPENINGS = {"turns": ("turn_topics", "turn_quotes"), "starts": ("starts",)}


def openings(settings, data) -> dict[str, bool]:
    """The answer-opening settings (`OPENINGS`) that `settings` leaves None, each as the chunk
    dataset directory `data` was built (`built_with` one of its options; false when `data` is
    None): what a run's evaluation and `eval chunk` with a run's adapter fill in."""
    return {
        key: data is not None and any(built_with(data, option) for option in options)
        for key, options in OPENINGS.items()
        if getattr(settings, key, None) is None
    }


def _build(data) -> dict:
    """A chunk dataset directory's build.json settings; {} without a readable one."""
    try:
        build = json.loads((Path(data) / "build.json").read_text())
    except (OSError, ValueError, TypeError):
        return {}
    return build if isinstance(build, dict) else {}


def built_window_messages(data) -> int:
    """A chunk dataset directory's `window_messages` (its build.json; 0 without one): the most
    messages its training examples hold, so the most an adapter trained on it reads at once."""
    try:
        return max(0, int(_build(data).get("window_messages") or 0))
    except (ValueError, TypeError):
        return 0


def built_with(data, option: str) -> bool:
    """Whether a chunk dataset directory was built with `option` (a ChunkDataConfig flag such as
    `turn_topics` or `starts`: its answers open that way) by its build.json; false without one."""
    return bool(_build(data).get(option))


def plan_windows(
    cases: list[dict],
    tokenizer,
    budget: int,
    overlap: int,
    max_messages: int = WINDOW_MESSAGES,
    fill: bool = False,
) -> list[Window]:
    """Each case as one prompt if it fits `budget` tokens and `max_messages`, else as
    overlapping windows of consecutive messages (mlxlab/data/chunk.py `window_cases`), each
    within both. `fill` (windows of a few messages, a small `max_messages`: `window_messages`):
    every window holds `max_messages` messages (the last may hold fewer), its longest cut to one
    cost until it fits the budget (mlxlab/data/chunk.py `filled_windows`), so on alternating
    chats none ends at a question without its answer: a `window_messages` adapter split 34 of 50
    such windows of long exported chats (experiments/chunk_seg4/local-windows.md)."""
    assert not fill or max_messages < WINDOW_MESSAGES, "fill is for windows of a few messages"
    from mlxlab.data import chunk as data

    def encode(text: str) -> list[int]:
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=False
        )

    out = []
    for i, case in enumerate(cases):
        whole = encode(data.prompt(case))
        msgs = data.shown(case["messages"])
        if len(whole) <= budget and len(msgs) <= max_messages:
            out.append(Window(i, 0, len(msgs) - 1, [m["uuid"] for m in msgs], whole, users(msgs)))
            continue
        room = budget - len(encode(data.prompt(case, [])))

        def cost(m: dict) -> int:
            return len(
                tokenizer.encode(data.message_block(m) + "\n---\n", add_special_tokens=False)
            )

        plan = data.filled_windows if fill else data.window_cases
        for a, b, msgs in plan(case, cost, max(room, 16), overlap, max_messages):
            prompt = encode(data.prompt(case, msgs))
            out.append(Window(i, a, b, [m["uuid"] for m in msgs], prompt, users(msgs)))
    return out


# an upper bound on one fixed chunk's tokens: two uuids (a token a character at worst), a label
# of up to 12 words and the keys
FIXED_CHUNK_TOKENS = 160


def fixed_merge(starts: list[int], merged: dict[int, str | None]) -> tuple[list[int], dict]:
    """A windowed case's chunks under fixed starts: they start at `starts` (not also at the
    windows' edges), each called what the merged windows' chunk over its first message is called
    (`merge_windows`' labels; None where no window answered)."""
    return list(starts), {
        s: merged.get(max((p for p in merged if p <= s), default=-1)) for s in starts
    }


def window_starts(w: Window, case_starts: list[int]) -> list[int]:
    """A case's chunk starts (indices among its shown messages) inside window `w`, numbered from
    the window's first message, which always starts one."""
    return [0] + [s - w.first for s in case_starts if w.first < s <= w.last]


def users(msgs: list[dict]) -> list[str]:
    from mlxlab.data.chunk import asks

    return [m["uuid"] for m in msgs if asks(m)]


def window_chunks(text: str, uuids: list[str], conversation_uuid):
    """(starts, labels, gap) of one window's answer: `starts` = [(start, label)], sorted, one per
    message (the first chunk the answer starts there), for each chunk whose start anchor resolves
    as `validate_ref` resolves it (of a range whose end also resolves, the lower end), so a chunk
    whose end alone is past saving still says where a topic starts and what it is called;
    `labels` = every chunk's label that is a string, in order. A label that is not a string is
    None. `gap`: the first message after everything the answer covers, when its chunks (some
    anchor resolving) stop before the window's last message; else None (also when a chunk's
    start resolves and its end does not: a mangled anchor). Every training answer covers its
    window to the last message, so one that stops short says the messages after it are not its
    chunks' topic."""
    obj = extract_json_ref(text)
    chunks = obj.get("chunks") if isinstance(obj, dict) else None
    chunks = [c for c in chunks if isinstance(c, dict)] if isinstance(chunks, list) else []
    index = {u: i for i, u in enumerate(uuids)}
    starts: dict[int, str | None] = {}
    labels: list[str] = []
    reached, mangled = -1, False  # the last message any anchor reaches; an end past saving
    for c in chunks:
        lab = c.get("label") if isinstance(c.get("label"), str) else None
        if lab is not None:
            labels.append(lab)
        s, _ = _resolve_ref(c.get("start_message_uuid"), uuids, index, conversation_uuid, False)
        e, _ = _resolve_ref(c.get("end_message_uuid"), uuids, index, conversation_uuid, True)
        if s is not None:
            starts.setdefault(s if e is None else min(s, e), lab)
            mangled = mangled or e is None
        reached = max(reached, -1 if s is None else s, -1 if e is None else e)
    short = not mangled and 0 <= reached < len(uuids) - 1
    return sorted(starts.items()), labels, reached + 1 if short else None


def window_cuts(windows: list[Window], n_messages: int) -> list[int]:
    """Where each of a case's windows takes over (`merge_windows`: window k owns messages
    cuts[k] to cuts[k + 1] - 1), then `n_messages`."""
    cuts = [0]
    for prev, cur in zip(windows, windows[1:], strict=False):
        cuts.append(min(max((cur.first + prev.last + 2) // 2, cur.first), prev.last + 1))
    return [*cuts, n_messages]


def merge_local(windows: list[Window], texts: list[str], n_messages: int, conversation_uuid):
    """`merge_windows` for windows of a few messages (`window_messages`): every boundary is one
    window's own decision, about a place it owns (`window_cuts`) and sees both sides of. A
    window's answer starts a topic at a user message it owns (any message, where the window does
    not know its users) when one of its chunks starts there (not at the window's first message,
    which every answer starts with), or when the answer stops short of its last message there
    (`window_chunks`' gap): every training answer covers its window, so one that ends with the
    first exchange says the second is not its topic (what these adapters do at a shift; a
    second chunk is rare, experiments/chunk_seg4/local-windows.md). A window with no start to
    read (failed, counted) decides nothing: the chunk before runs on over what it owns, since a
    label read from a broken answer is no evidence of a new topic. A chunk is called by its own
    answer's label; a start from a short answer (or a label that is not a string) by the first
    window after it that answers with a label, its last labelled chunk starting at or before that
    message, else its first label; with no such window (the conversation's end) the start is
    dropped. Message 0 always starts one, called as window 0 calls it (else as the first window
    with a label does; None when none has). Failed windows are counted among those that own
    messages."""
    cuts = window_cuts(windows, n_messages)
    read = [
        window_chunks(t, w.uuids, conversation_uuid) for w, t in zip(windows, texts, strict=True)
    ]

    def name(k: int, at: int):  # the label the first window from k that has one gives message at
        for w, (starts, own, _) in zip(windows[k:], read[k:], strict=True):
            over = [lab for s, lab in starts if s + w.first <= at and isinstance(lab, str)]
            if over or own:
                return over[-1] if over else own[0]
        return None

    labels: dict[int, str | None] = {}
    for k, (w, (starts, _, gap)) in enumerate(zip(windows, read, strict=True)):
        asks = set(w.users) if w.users else set(w.uuids)
        for s, lab in starts:
            if s > 0 and cuts[k] <= s + w.first < cuts[k + 1] and w.uuids[s] in asks:
                lab = lab if isinstance(lab, str) else name(k + 1, s + w.first)
                if lab is not None:
                    labels[s + w.first] = lab
        if not starts or gap is None or w.uuids[gap] not in asks:
            continue  # failed (no start to read: decides nothing), or no short answer
        at = gap + w.first
        if cuts[k] < at < cuts[k + 1] and at not in labels:
            lab = name(k + 1, at)
            if lab is not None:
                labels[at] = lab
    labels[0] = name(0, 0)
    owners = [r for k, r in enumerate(read) if cuts[k] < cuts[k + 1]]
    return sorted(labels), labels, sum(not starts for starts, _, _ in owners)


def merge_windows(
    windows: list[Window],
    texts: list[str],
    n_messages: int,
    conversation_uuid,
    local: bool = False,
):
    """(chunk starts, label per start, failed windows): one cover of messages 0..n_messages-1
    from the windows' answers. With `local` (windows of a few messages, `window_messages`):
    `merge_local`. Otherwise each window owns the messages from the middle of its overlap with
    the one before (the earlier window keeps the first half, rounded up, so every owned message
    has one message of context before it) to the middle of its overlap with the one after; the
    chunk starts a window's answer puts inside what it owns are the merged boundaries, with their
    labels (`window_chunks`: a chunk counts when its start anchor resolves, even if its end does
    not). A window with no such chunk has failed (counted). One whose answer still has a label
    owns one chunk under it, and the window after it starts a chunk where it takes over. One with
    no label to read starts nothing: the chunk the next window that answers has where it takes
    over (its string label) reaches back to where the unread stretch began; with no window after
    it that answers, the chunk before it runs on. A chunk opened at a window's edge (its takeover
    point, message 0, the start of an unread stretch; or, without overlap, a chunk starting with
    the window) is a new one only under a label other than the chunk's it would continue.
    (A long window's answer that stops short is not read as a topic start: those are answers
    that gave up, experiments/chunk_seg4/local-windows.md.)
    Message 0 always starts one (labelled None when no window answered)."""
    if local:
        return merge_local(windows, texts, n_messages, conversation_uuid)
    cuts = window_cuts(windows, n_messages)
    labels: dict[int, str | None] = {}

    def open_chunk(at: int, lab) -> None:  # unless it continues the chunk before, same label
        prior = [x for x in labels if x < at]
        if not prior or _norm_label(labels[max(prior)]) != _norm_label(lab):
            labels[at] = lab

    unread = None  # where a stretch of failed windows with no label began
    failed, prev_failed = 0, False
    for k, (w, text) in enumerate(zip(windows, texts, strict=True)):
        if cuts[k] >= cuts[k + 1]:
            continue  # owns nothing
        starts, own_labels, _ = window_chunks(text, w.uuids, conversation_uuid)
        starts = [(s + w.first, lab) for s, lab in starts]
        if not starts:
            failed += 1
            prev_failed = True
            if own_labels:
                open_chunk(cuts[k] if unread is None else unread, own_labels[0])
                unread = None
            elif unread is None:
                unread = cuts[k]
            continue
        at = [lab for s, lab in starts if s <= cuts[k]]
        covering = at[-1] if at else starts[0][1]
        if covering is None:
            covering = next((lab for _, lab in starts if isinstance(lab, str)), None)
        reached = unread is not None  # the chunk at the takeover point starts back there
        if reached:
            open_chunk(unread, covering)
            unread = None
        elif cuts[k] not in [s for s, _ in starts] and (prev_failed or k == 0):
            open_chunk(cuts[k], covering)
        for s, lab in starts:
            if not cuts[k] <= s < cuts[k + 1] or s in labels or (reached and s == cuts[k]):
                continue
            if k and s == w.first and not prev_failed:
                open_chunk(s, lab)  # no overlap with the window before
            else:
                labels[s] = lab
        prev_failed = False
    labels.setdefault(0, None)
    starts = sorted(labels)
    return starts, labels, failed


def evaluate(
    model,
    tokenizer,
    cases: list[dict],
    max_tokens: int = 256,
    batch_size: int = 8,
    progress=None,
    constrained: bool = False,
    budget: int = AUTO_PROMPT_TOKENS,
    overlap: int = 2,
    train_labels: set[str] | None = None,
    cover: bool = True,
    turns: bool = False,
    starts: bool = False,
    split_bias: float = 0.0,
    fixed_starts: list[list[int]] | None = None,
    kv=None,
    max_messages: int = 0,
    read_overruled: bool = False,
) -> list[dict]:
    """Greedy-decode each case (`generate_all`, in eval mode; a case longer than `budget` prompt
    tokens in windows, their answers merged by `merge_windows`) and score it; one dict per case.
    `constrained` decodes each window under its `answer_grammar` (with `cover`: chunks up to its
    last message); `train_labels` (normalised training-set labels) adds the share of predicted
    labels that are one of them. `turns`: the answers open with a turns list (a `turn_topics`
    or `turn_quotes` adapter): windows of at most `turns_window_messages` messages, a grammar that
    allows either opening;
    `starts`: the grammar allows the starts opening (a `starts` adapter); `split_bias` > 0: each
    window decoded with a `SplitBias` (constrained or not); `fixed_starts` (per case, the shown
    messages where chunks start: mlxlab/eval/shifts.py `chunk_starts`) decodes each window under
    the grammar whose chunks start exactly there (`answer_grammar`'s `fixed`): only the labels
    are the model's. `kv`: `generate_all`'s store of prompt KV, shared by the decodes of one
    model. `max_messages` > 0: no window holds more messages (a `window_messages` adapter's),
    and the windows' answers are merged by `merge_local`. Constrained (not `fixed_starts`, whose
    grammar overrules by design), each window's steps where the grammar refused the model's own
    top token are recorded (`grammar.Constraint.refused`): unless `read_overruled`, a window so
    overruled is merged as unread (`score_windows`)."""
    cap = turns_window_messages(max_tokens) if turns else WINDOW_MESSAGES
    cap = min(cap, max_messages or cap)
    windows = plan_windows(cases, tokenizer, budget, overlap, cap, fill=bool(max_messages))
    processors = None
    watched: dict[int, object] = {}  # window -> its watching grammar constraint
    if fixed_starts is not None:
        assert len(fixed_starts) == len(cases), "one list of chunk starts per case"
        constrained, split_bias = True, 0.0  # the ends are fixed: nothing for a bias to move
        # room for every fixed chunk (two uuids and a label each), however many the detector cut
        most = max((len(window_starts(w, fixed_starts[w.case])) for w in windows), default=0)
        max_tokens = max(max_tokens, FIXED_CHUNK_TOKENS * most + 16)
    if constrained or split_bias > 0:
        from mlxlab import grammar

        width = n_vocab(model, tokenizer)
        grammars = [
            grammar.lark(
                answer_grammar(w.uuids, cover, w.users if turns else None, starts)
                if fixed_starts is None
                else answer_grammar(w.uuids, fixed=window_starts(w, fixed_starts[w.case])),
                f"case {w.case} answer grammar",
            )
            for w in windows
            if constrained
        ]

        def processors(i):
            out = []  # the bias first: the constraint watches the logits the model decodes from
            if split_bias > 0 and windows[i].uuids:
                out.append(SplitBias(tokenizer, windows[i].uuids, split_bias))
            if constrained:
                watch = fixed_starts is None
                out.append(grammar.constrain(grammars[i], tokenizer, width, watch=watch))
                if watch:
                    watched[i] = out[-1]
            return out

    texts = generate_all(
        model,
        tokenizer,
        [w.prompt for w in windows],
        max_tokens,
        batch_size,
        progress,
        processors,
        kv=kv,
    )
    refused = [watched.pop(i).refused() for i in range(len(windows))] if watched else None
    return score_windows(
        cases,
        windows,
        texts,
        train_labels,
        fixed_starts,
        bool(max_messages),
        refused,
        read_overruled,
    )


def score_windows(
    cases: list[dict],
    windows: list[Window],
    texts: list[str],
    train_labels: set[str] | None = None,
    fixed_starts: list[list[int]] | None = None,
    local: bool = False,
    refused: list[list[int]] | None = None,
    read_overruled: bool = False,
) -> list[dict]:
    """`evaluate`'s rows from its windows' answers (`texts`, one per window): a case read in one
    window is scored on its answer as it is, one read in several on their merge
    (`merge_windows`, with `local`; with `fixed_starts`, `fixed_merge`). `refused` (a
    constrained decode's, per window: the steps where the grammar refused the model's own top
    token, `grammar.Constraint.refused`; saved per window as `window_refused`): unless
    `read_overruled`, a window with any is merged as one whose answer could not be read (its
    answer kept in `window_outputs`, counted in `window_unread` and `window_failures`): the
    model's own answer there was one the grammar does not allow (a label of one word or more
    than 12, a character a label may not hold, a uuid of no message in the window, a key
    skipped, ...), so the grammar chose tokens for it, and what follows is not the model's
    decision. A window never overruled is, given the same logits, answered token for token as
    without the grammar (greedy), so this merge departs from the unconstrained one only where
    the grammar overruled (up to the near-ties of batching, `generate_all`). When no window that
    the grammar did not overrule has a chunk to read, the case's windows are merged as written:
    the grammar's answers still make one well-formed cover. Saved `window_outputs` (and
    `window_refused`) and the windows `plan_windows` gives again re-score a run without
    decoding."""
    from mlxlab.data.chunk import conversation_uuid, shown

    rows = []
    for i, case in enumerate(cases):
        mine = [k for k, w in enumerate(windows) if w.case == i]
        uuids = [m["uuid"] for m in shown(case["messages"])]
        conv = conversation_uuid(case)
        row = {"case": i, "id": case.get("id", str(i)), "windows": len(mine)}
        ws, wt = [windows[k] for k in mine], [texts[k] for k in mine]
        unread = set()  # the windows merged as unread: the grammar overruled them
        if refused is not None and not read_overruled and fixed_starts is None:
            unread = {k for k in mine if refused[k]}
            if not any(
                window_chunks(texts[k], windows[k].uuids, conv)[0] for k in mine if k not in unread
            ):
                unread = set()  # nothing else to read: the grammar's answers as written
        read = [("" if k in unread else texts[k]) for k in mine]
        points, labels, failed = (
            merge_windows(ws, read, len(uuids), conv, local) if len(mine) > 1 else ([], {}, 0)
        )
        fixed = fixed_starts is not None and len(mine) > 1
        if fixed:  # the cover is the fixed one, even where no window answered
            points, labels = fixed_merge(fixed_starts[i], labels)
        if len(mine) == 1 or (failed == len(mine) and not fixed):
            text = wt[0]  # one prompt, or no window answered: the first answer as it is
        else:
            ends = [*points[1:], len(uuids)]
            text = json.dumps(
                {
                    "chunks": [
                        {
                            "label": labels[s],
                            "start_message_uuid": uuids[s],
                            "end_message_uuid": uuids[e - 1],
                        }
                        for s, e in zip(points, ends, strict=True)
                    ]
                }
            )
        if len(mine) > 1:
            row["window_failures"] = failed
            row["window_outputs"] = wt
            if refused is not None:
                row["window_refused"] = [refused[k] for k in mine]
                row["window_unread"] = len(unread)
            row["window_ref"] = sum(
                score_ref(t, w.uuids, conv).ref for w, t in zip(ws, wt, strict=True)
            ) / len(ws)
        row["output"] = text
        row["prompt_tokens"] = sum(len(windows[k].prompt) for k in mine)
        if case.get("chunks") is not None:
            row["gold_chunks"] = len(case["chunks"])
        row.update(score_case(text, uuids, case.get("chunks"), conv).to_dict())
        if train_labels is not None:
            obj = extract_json_ref(text)
            chunks = obj.get("chunks") if isinstance(obj, dict) else None
            labs = [c.get("label") for c in chunks or [] if isinstance(c, dict)]
            labs = [x for x in labs if isinstance(x, str)]
            if labs:
                row["memorized_labels"] = sum(_norm_label(x) in train_labels for x in labs) / len(
                    labs
                )
        rows.append(row)
    return rows


ALL_RIGHT = "every decision"
GROUPS = ("one chunk", "several chunks")


def _teacher_forced(ex: dict, tokenizer) -> tuple[str, str, list[dict], list[int]]:
    """A chunk-data chat record's (user prompt text, gold answer text, gold chunks, prompt token
    ids as generation starts after them), for the teacher-forced probes."""
    user, text = ex["messages"][0]["content"], ex["messages"][1]["content"]
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": user}], add_generation_prompt=True, return_dict=False
    )
    return user, text, json.loads(text)["chunks"], prompt


def decision_accuracy(model, tokenizer, examples: list[dict]) -> dict[str, dict[str, list[int]]]:
    """Teacher-forced: at each place a gold answer decides where its chunks are
    (mlxlab/data/chunk.py `boundary_places`: the first characters of every uuid it writes, the
    character after every list item), whether the model's most likely next token, given the
    prompt and the gold answer before it, is the gold one (the token holding that place's first
    character). `examples` are chat records as the chunk data writes them (<split>.jsonl: one per
    window); the answer is tokenized after the prompt as generation would write it. Returns
    {group: {kind: [right, total]}} for the answers of one chunk and of several (`GROUPS`), with
    `ALL_RIGHT`: the answers whose every such token is right, and "skipped": {"no chunks": [0,
    n]} for n answers with no chunk to place. Free decoding must also get its own earlier
    decisions right; this isolates each one."""
    import mlx.core as mx

    from mlxlab.data.chunk import boundary_places
    from mlxlab.train.losses import hidden_states, lm_head

    out: dict[str, dict[str, list[int]]] = {g: {} for g in GROUPS}
    skipped = 0
    training = getattr(model, "training", False)
    model.eval()  # no LoRA dropout
    try:
        for ex in examples:
            _, text, chunks, prompt = _teacher_forced(ex, tokenizer)
            if not chunks:
                skipped += 1
                continue
            places = boundary_places(text, chunks)
            enc = tokenizer._tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            ids, begins = list(enc["input_ids"]), [a for a, _ in enc["offset_mapping"]]
            # the token holding each place's first character: the last one starting at or before
            at = [max(i for i, a in enumerate(begins) if a <= first) for first, _, _ in places]
            h = hidden_states(model, mx.array([prompt + ids]))[0]
            rows = mx.array([len(prompt) + i - 1 for i in at])
            pred = mx.argmax(lm_head(model, h[rows]), axis=-1).tolist()
            group = out[GROUPS[len(chunks) > 1]]
            right = [p == ids[i] for p, i in zip(pred, at, strict=True)]
            for (_, _, kind), ok in zip(places, right, strict=True):
                tally = group.setdefault(kind, [0, 0])
                tally[0] += ok
                tally[1] += 1
            tally = group.setdefault(ALL_RIGHT, [0, 0])
            tally[0] += all(right)
            tally[1] += 1
    finally:
        model.train(training)
    if skipped:
        out["skipped"] = {"no chunks": [0, skipped]}
    return out


def decisions_table(result: dict[str, dict[str, list[int]]]) -> str:
    """`decision_accuracy`'s counts as a markdown table (one row per group and kind)."""
    lines = ["| answers | decision | right | share |", "|---|---|---|---|"]
    for group in (*GROUPS, "skipped"):
        for name, (right, total) in sorted(result.get(group, {}).items()):
            share = f"{right / total:.2f}" if total else "-"
            lines.append(f"| {group} | {name} | {right} / {total} | {share} |")
    return "\n".join(lines)


# a message's header line in a chunk prompt (mlxlab/data/chunk.py `message_block`)
HEADER_UUID = re.compile(r"^\[[^\]\n]*\] \(uuid: ([^)\s]+)\)$", re.M)
END_KEY = '"end_message_uuid": "'


def end_choices(model, tokenizer, examples: list[dict], depth: int = 4) -> list[dict]:
    """Teacher-forced, where an answer chooses its first chunk's end (the decision that says
    whether a second chunk follows, and where): for each example (a chat record as
    `decision_accuracy` reads them) with a chunk, the gold answer up to the first character of
    the first chunk's end uuid; each message the chunk could end at, its start to the window's
    last, is scored by the log-probability the model gives to the first `depth` tokens of the
    message's uuid there. Returns per example {"chunks": gold chunks, "gold": the gold end's index
    among the candidates, "scores": [...]}, candidates in message order: the last one is the
    window's last message, the end of a one-chunk answer."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    rows = []
    training = getattr(model, "training", False)
    model.eval()
    try:
        for ex in examples:
            user, text, chunks, prompt = _teacher_forced(ex, tokenizer)
            if not chunks:
                continue
            uuids = HEADER_UUID.findall(user)
            first = chunks[0]
            cands = uuids[uuids.index(first["start_message_uuid"]) :]
            cut = text.index(END_KEY) + len(END_KEY)
            encode = tokenizer._tokenizer
            prefix = encode(text[:cut], add_special_tokens=False)["input_ids"]
            full = [encode(text[:cut] + u, add_special_tokens=False)["input_ids"] for u in cands]
            # the tokens all candidates share (fewer than the prefix's where a tokenizer merges
            # the quote with a uuid's first characters)
            n = next(
                (
                    i
                    for i in range(len(prefix))
                    if any(i >= len(f) or f[i] != prefix[i] for f in full)
                ),
                None,
            )
            prefix = prefix[:n]
            tails = [f[len(prefix) :] for f in full]
            d = min(depth, *map(len, tails))
            cache = make_prompt_cache(model)
            head = model(mx.array([prompt + prefix]), cache=cache)[0, -1]
            head = head - mx.logsumexp(head)
            toks = mx.array([t[:d] for t in tails])
            for c in cache:  # one row per candidate, all after the same prefix
                c.keys = mx.repeat(c.keys, len(tails), axis=0)
                c.values = mx.repeat(c.values, len(tails), axis=0)
            scores = head[toks[:, 0]]
            if d > 1:
                logits = model(toks[:, :-1], cache=cache)
                logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
                picked = mx.take_along_axis(logp, toks[:, 1:, None], axis=-1)[..., 0]
                scores = scores + picked.sum(axis=-1)
            rows.append(
                {
                    "chunks": len(chunks),
                    "gold": cands.index(first["end_message_uuid"]),
                    "scores": scores.tolist(),
                }
            )
    finally:
        model.train(training)
    return rows


def end_choice_summary(rows: list[dict]) -> dict:
    """`end_choices` in counts: on the several-chunk answers, how often the gold end (an earlier
    message than the last) is the model's first choice, its first choice among the earlier
    messages (where, given that a second chunk follows) and above the last message (whether);
    on the one-chunk answers, how often the last message is its first choice; and the AUC with
    which the margin of the best earlier message over the last tells several-chunk answers from
    one-chunk ones (0.5: no signal a threshold on that margin could use), with the `split_bias`
    (>= 0) that best separates them here ("split iff margin + bias > 0": of the cuts that
    maximise the mean of the two groups' accuracies the highest, moved halfway to the next margin
    above it) and that balanced accuracy. Choose a
    bias on a split the reported scores do not come from (valid)."""
    several = [r for r in rows if r["chunks"] > 1]
    one = [r for r in rows if r["chunks"] == 1]

    def margin(r):
        s = r["scores"]
        return max(s[:-1]) - s[-1] if len(s) > 1 else float("-inf")

    def top(s):
        return max(range(len(s)), key=s.__getitem__)

    out = {
        "several chunks": {
            "answers": len(several),
            "gold end first": sum(top(r["scores"]) == r["gold"] for r in several),
            "gold end first of the earlier": sum(
                top(r["scores"][:-1]) == r["gold"] for r in several
            ),
            "gold end above the last": sum(
                r["scores"][r["gold"]] > r["scores"][-1] for r in several
            ),
        },
        "one chunk": {
            "answers": len(one),
            "last first": sum(top(r["scores"]) == len(r["scores"]) - 1 for r in one),
        },
    }
    if several and one:
        pairs = [(margin(a), margin(b)) for a in several for b in one]
        out["margin AUC"] = sum((a > b) + 0.5 * (a == b) for a, b in pairs) / len(pairs)

        def balanced(t: float) -> float:  # split where the margin exceeds t
            hit = sum(margin(r) > t for r in several) / len(several)
            return 0.5 * (hit + sum(margin(r) <= t for r in one) / len(one))

        cuts = sorted({margin(r) for r in rows if margin(r) > float("-inf")}, reverse=True)
        best = max(cuts or [0.0], key=balanced)  # the first maximum: the highest cut
        # halfway to the next margin up, so the bias does not sit on one answer's own margin
        higher = [c for c in cuts if c > best]
        t = (best + min(higher)) / 2 if higher else best
        out["split bias"] = round(max(0.0, -t), 3)
        out["balanced accuracy"] = round(balanced(-out["split bias"]), 3)  # as clipped
    return out


def end_choice_table(summary: dict) -> str:
    """`end_choice_summary` as a markdown table."""
    lines = ["| answers | first chunk's end | count | share |", "|---|---|---|---|"]
    for group in GROUPS:
        counts = summary.get(group, {})
        n = counts.get("answers", 0)
        for name, k in counts.items():
            if name != "answers":
                lines.append(f"| {group} | {name} | {k} / {n} | {k / n:.2f} |" if n else "")
    if "margin AUC" in summary:
        lines.append(f"| both | margin AUC (several vs one) | | {summary['margin AUC']:.2f} |")
        lines.append(
            f"| both | split_bias {summary['split bias']:g}: balanced accuracy | | "
            f"{summary['balanced accuracy']:.2f} |"
        )
    return "\n".join(x for x in lines if x)


def constrained_path(out: Path) -> Path:
    """Where the constrained decode's per-case results go: eval.jsonl -> eval.constrained.jsonl."""
    return pass_path(out, "constrained")


def pass_path(out: Path, tag: str) -> Path:
    """Where a second decode's per-case results go: eval.jsonl -> eval.<tag>.jsonl."""
    out = Path(out)
    return out.with_name(f"{out.stem}.{tag}{out.suffix or '.jsonl'}")


def evaluate_model(
    model, tokenizer, records: list[dict], settings, out: Path, label: str, train_labels=None
) -> dict:
    """Evaluate `records` (read_split) with `settings` (EvalSettings: max_tokens, batch_size,
    constrained), write per-case JSONL to `out`; return the summary (+ seconds, results path).
    With `settings.constrained` the split is decoded again under the answer grammar, written to
    `constrained_path(out)`, and its summary is the summary's "constrained" entry. With more than
    one decode, each window's prompt is prefilled once (`generate_all`'s `kv`, within
    `kv_budget`): the held KV counts in the evaluation's peak memory (`peak_mem_gb`, from the
    call's start, the model's weights included)."""
    import mlx.core as mx

    from mlxlab.errors import UserError
    from mlxlab.fsutil import atomic_write_text

    mx.reset_peak_memory()

    kv = None
    if getattr(settings, "constrained", False) or getattr(settings, "shifts", ""):
        from mlxlab.serve.engine.prompt_cache import PromptCache

        kv = PromptCache(kv_budget())  # the decodes after the first skip the prefill

    def run(constrained: bool, path: Path, tag: str, fixed_starts=None, t0=None) -> dict:
        t0 = time.perf_counter() if t0 is None else t0

        def progress(done, total):
            log.info(f"[{tag}] {done}/{total} prompts")

        rows = evaluate(
            model,
            tokenizer,
            records,
            settings.max_tokens,
            settings.batch_size,
            progress,
            constrained,
            max_prompt_tokens(model, settings),
            getattr(settings, "window_overlap", 2),
            train_labels,
            getattr(settings, "cover", True),
            bool(getattr(settings, "turns", False)),
            bool(getattr(settings, "starts", False)),
            float(getattr(settings, "split_bias", 0.0)),
            fixed_starts,
            kv,
            int(getattr(settings, "window_messages", 0) or 0),
            bool(getattr(settings, "read_overruled", False)),
        )
        if getattr(settings, "label_model", ""):
            try:
                label_similarity(rows, settings.label_model)
            except UserError as e:  # a missing extra score never costs the evaluation
                log.warning(f"warning: no label similarity ({settings.label_model}): {e}")
        atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in rows))
        bias = float(getattr(settings, "split_bias", 0.0))
        return {
            **summarize(rows),
            "seconds": round(time.perf_counter() - t0, 1),
            "results": str(path),
            **({"split_bias": bias} if bias > 0 else {}),  # what the decode was, in the summary
        }

    starts, detected = None, 0.0
    if getattr(settings, "shifts", ""):  # first: a bad embedding model fails before any decode
        from mlxlab.eval.shifts import chunk_starts

        t0 = time.perf_counter()
        rule = shift_rule(settings)
        starts = chunk_starts(records, settings.shifts, rule)
        detected = time.perf_counter() - t0
    summary = run(False, out, label)
    if getattr(settings, "constrained", False):
        summary["constrained"] = run(True, constrained_path(out), f"{label}, constrained")
    if starts is not None:
        t0 = time.perf_counter() - detected  # the pass's time counts the detector's
        shifted = run(True, pass_path(out, "shifts"), f"{label}, shift boundaries", starts, t0)
        shifted["detector"] = detector_summary(records, starts)
        shifted["detector"].update(model=settings.shifts, rule=asdict(rule))
        summary["shifts"] = shifted
    if kv is not None:
        stats = kv.stats()
        log.info(
            f"[{label}] prompt KV: {stats['reused_tokens']} prompt tokens not prefilled again "
            f"({stats['hits']} lookups found a prefix, {stats['misses']} none), "
            f"{stats['entries']} prompts held in {stats['bytes'] / 1e9:.2f} GB"
        )
    summary["peak_mem_gb"] = round(mx.get_peak_memory() / 1e9, 3)
    return summary


def shift_rule(settings):
    """The topic-shift detector's `Rule` from EvalSettings' shift_drop, shift_cap, shift_floor."""
    from mlxlab.eval.shifts import Rule

    return Rule(float(settings.shift_drop), float(settings.shift_cap), float(settings.shift_floor))


def detector_summary(records: list[dict], starts: list[list[int]]) -> dict:
    """The topic-shift detector's chunks scored alone against gold (no model): mean boundary F1,
    over all cases and over those with two or more gold chunks, and chunks per case."""
    from mlxlab.data.chunk import shown

    f1s, multi = [], []
    for case, st in zip(records, starts, strict=True):
        gold = case_gold_spans(case)
        if gold is None:
            continue
        f1 = boundary_f1(gold, spans_of(st, len(shown(case["messages"]))) if st else [])
        f1s.append(f1)
        if len(gold) >= 2:
            multi.append(f1)
    out = {"chunks_per_case": sum(map(len, starts)) / max(1, len(starts))}
    if f1s:
        out["boundary_f1"] = sum(f1s) / len(f1s)
    if multi:
        out["boundary_f1_multi"] = sum(multi) / len(multi)
    return out
