"""What score.py and combine.py share: the chunks a per-place decision gives, scored per case."""

from collections import defaultdict

import numpy as np

from mlxlab.tasks.chunk.prompt import shown
from mlxlab.tasks.chunk.scoring import boundary_f1, case_gold_spans, spans_of
from mlxlab.tasks.chunk.shifts import Rule


def f1s(cases, rows, decide):
    """Mean boundary F1 over `cases`, over the multi-topic ones, and chunks per case (predicted,
    gold), when a chunk starts at each place row `r` (of its case) where `decide(r)`."""
    by = defaultdict(list)
    for r in rows:
        by[r["case"]].append(r)
    every, multi, chunks, gold_chunks = [], [], [], []
    for c in cases:
        gold = case_gold_spans(c)
        starts = [0] + sorted(r["place"] for r in by[c["id"]] if decide(r))
        f = boundary_f1(gold, spans_of(starts, len(shown(c["messages"]))))
        every.append(f)
        if len(gold) >= 2:
            multi.append(f)
        chunks.append(len(starts))
        gold_chunks.append(len(gold))
    return {
        "f1": round(float(np.mean(every)), 3),
        "multi": round(float(np.mean(multi)), 3),
        "chunks": round(float(np.mean(chunks)), 2),
        "gold": round(float(np.mean(gold_chunks)), 2),
        "cases": len(cases),
    }


def detector(r, rule: Rule = Rule()):
    """The detector's rule (shifts.py `starts_from_vectors`) on a place's similarity and its
    conversation's median."""
    return r["sim"] < rule.floor or r["sim"] < min(rule.cap, r["median"] - rule.drop)
