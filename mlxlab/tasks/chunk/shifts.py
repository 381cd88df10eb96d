"""Where a conversation changes topic, from sentence vectors: a topic-shift detector for the
chunk task that needs no training.

A conversation is read as exchanges: a user message and the assistant messages that answer it
(any messages before the first user message belong to the first exchange). Each message becomes
one sentence vector of an embedding model (mlxlab/embed, its first `max_tokens` tokens), an
exchange the normalised mean of its messages' vectors, and each exchange after the first has a
similarity: its cosine with the exchange before it. An exchange starts a chunk when its
similarity is below `floor`, or below both `cap` and the conversation's median similarity less
`drop` (`Rule`); the first message always starts one. The cut is relative because how alike two
exchanges on one topic are depends on the conversation: in the chunk dataset's documentation
chats they have a median cosine of 0.73 and a topic change 0.55, in realistic chats 0.60 and
0.23 (experiments/chunk_seg4/topic-shifts.md), so no one fixed threshold serves both.
`chunk_starts` returns the message indices where chunks start, among the messages a prompt
shows (prompt.py `shown`), the same numbering as the answer's anchors.

`eval chunk shifts=all-minilm-l6-v2` (evaluate.py `evaluate`) decodes each window under
an answer grammar whose chunks start exactly there: the detector places the boundaries, the
model writes the labels. The default rule was chosen on a validation build whose topics are
disjoint from the training and test splits' and on the hand-written realistic chats
(scripts/shift_rule.py), never on the test split.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mlxlab.tasks.chunk.prompt import is_user, shown
from mlxlab.tasks.chunk.scoring import boundary_f1, case_gold_spans, spans_of


@dataclass(frozen=True)
class Rule:
    """Where an exchange starts a chunk: similarity < floor, or < min(cap, median - drop)."""

    drop: float = 0.15
    cap: float = 0.6
    floor: float = 0.3

    def __str__(self) -> str:
        return (
            f"cosine below {self.floor:g}, or below both {self.cap:g} and the conversation's "
            f"median less {self.drop:g}"
        )


def exchanges(messages: list[dict]) -> list[list[int]]:
    """Message indices grouped as exchanges: each user message (prompt.py `is_user`)
    opens one, the assistant messages after it join it; leading assistant messages join the
    first."""

    out: list[list[int]] = []
    for i, m in enumerate(messages):
        if is_user(m) or not out:
            if out and not any(is_user(messages[j]) for j in out[-1]):
                out[-1].append(i)  # the leading assistant messages and the first question
            else:
                out.append([i])
        else:
            out[-1].append(i)
    return out


def similarities(groups: list[list[int]], vectors: np.ndarray) -> np.ndarray:
    """Each exchange after the first: the cosine of its normalised mean message vector with the
    one before it (len(groups) - 1 values)."""
    if not groups:
        return np.zeros(0)
    means = np.stack([vectors[g].astype(np.float64).mean(0) for g in groups])
    means /= np.maximum(np.linalg.norm(means, axis=1, keepdims=True), 1e-12)
    return (means[1:] * means[:-1]).sum(1)


def starts_from_vectors(groups: list[list[int]], vectors: np.ndarray, rule: Rule) -> list[int]:
    """Chunk starts (message indices, 0 first) from per-message sentence vectors: where an
    exchange's normalised mean vector is far enough from the one before it (`rule`)."""
    if not groups:
        return []
    sims = similarities(groups, vectors)
    if not len(sims):
        return [0]
    cut = min(rule.cap, float(np.median(sims)) - rule.drop)
    return [0] + [groups[j + 1][0] for j, s in enumerate(sims) if s < rule.floor or s < cut]


def check_model(model: str) -> None:
    """Load embedding model `model` once: a UserError names what is wrong (not an embedding
    model, not found) before anything is decoded."""
    from mlxlab.embed.model import Embedder

    Embedder(model)


def message_vectors(embedder, msgs: list[dict]) -> np.ndarray:
    """[len(msgs), dims] sentence vectors of the messages' texts (each its first tokens)."""
    return embedder.embed(embedder.tokenize([m["text"] for m in msgs], truncate=True))


def chunk_starts(cases: list[dict], model: str, rule: Rule = Rule()) -> list[list[int]]:
    """For each case ({messages: [{uuid, sender, text}]}), the indices among its shown messages
    where a chunk starts (`starts_from_vectors`), with embedding model `model` (a zoo name or an
    MLX embedding directory). [] for a case with no shown message. Runs on this thread (MLX)."""
    from mlxlab.embed.model import Embedder

    embedder = Embedder(model)
    out = []
    for case in cases:
        msgs = shown(case["messages"])
        if not msgs:
            out.append([])
            continue
        vectors = message_vectors(embedder, msgs)
        out.append(starts_from_vectors(exchanges(msgs), vectors, rule))
    return out


def shift_rule(settings):
    """The topic-shift detector's `Rule` from EvalSettings' shift_drop, shift_cap, shift_floor."""
    return Rule(float(settings.shift_drop), float(settings.shift_cap), float(settings.shift_floor))


def detector_summary(records: list[dict], starts: list[list[int]]) -> dict:
    """The topic-shift detector's chunks scored alone against gold (no model): mean boundary F1,
    over all cases and over those with two or more gold chunks, and chunks per case."""
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
