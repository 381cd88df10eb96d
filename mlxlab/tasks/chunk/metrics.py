"""A split's figures: per-case rows into means (`summarize`), the results table (`table`), and
label similarity by meaning (`label_similarity`)."""

from __future__ import annotations


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
    counted = [r for r in rows if r.get("chunks") is not None and r.get("gold_chunks")]
    if counted:  # how many chunks, against the gold's: over- and under-split cases
        out["chunks_per_case"] = sum(r["chunks"] for r in counted) / len(counted)
        out["gold_chunks_per_case"] = sum(r["gold_chunks"] for r in counted) / len(counted)
        out["over_split"] = sum(r["chunks"] > r["gold_chunks"] for r in counted)
        out["under_split"] = sum(r["chunks"] < r["gold_chunks"] for r in counted)
    multi = [r["boundary_f1"] for r in rows if r.get("gold_chunks", 0) >= 2]
    if multi:  # on a one-topic case any one-chunk answer has F1 1: these are the telling ones
        out["boundary_f1_multi"] = sum(multi) / len(multi)
        out["multi_cases"] = len(multi)
    return out


# the second decodes of a split (their summaries under these keys) and their rows' names
PASSES = {"constrained": "constrained", "shifts": "shift boundaries"}


def fmt(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table(summaries: dict[str, dict]) -> str:
    """A markdown table, one row per evaluated model; a summary's "constrained" entry (the same
    model decoded under the answer grammar) is the row below it, "<name>, constrained", and its
    "shifts" entry (decoded with the topic-shift detector's boundaries) "<name>, shift
    boundaries"."""
    head = (
        "| model | cases | ref | strict | boundary F1 | F1 multi-topic | chunks / gold | over / "
        "under | exact chunks | label F1 | label similarity | memorized labels | schema | anchors "
        "| labels |"
    )
    lines = [head, "|" + "---|" * 15]
    rows = []
    for name, s in summaries.items():
        rows.append((name, s))
        for key, tag in PASSES.items():
            if isinstance(s.get(key), dict):
                rows.append((f"{name}, {tag}", s[key]))
    for name, s in rows:
        lines.append(
            f"| {name} | {s['cases']} | {fmt(s.get('ref'))} | {s['wellformed']:.1f} | "
            f"{fmt(s.get('boundary_f1'), 3)} | {fmt(s.get('boundary_f1_multi'), 3)} | "
            f"{fmt(s.get('chunks_per_case'), 2)} / {fmt(s.get('gold_chunks_per_case'), 2)} | "
            f"{s.get('over_split', '-')} / {s.get('under_split', '-')} | "
            f"{fmt(s.get('exact_match'), 3)} | "
            f"{fmt(s.get('label_f1'), 3)} | {fmt(s.get('label_sim'), 3)} | "
            f"{fmt(s.get('memorized_labels'), 3)} | "
            f"{s['schema']:.3f} | {s['anchors']:.3f} | {s['labels']:.3f} |"
        )
    return "\n".join(lines)
