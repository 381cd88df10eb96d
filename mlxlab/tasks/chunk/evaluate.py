"""Evaluating a model on the chunk task: decode every window of a split, merge, score.

`evaluate_model` runs a whole split and writes per-case results (what `eval chunk` and the chunk
task's base and tuned evaluations call). Each case is read in windows (windows.py
`plan_windows`), decoded greedily in batches (mlxlab/decode `complete`), the windows' answers merged
(`merge_local`) and the merged answer scored (scoring.py, ref.py). With `constrained` the split
is decoded a second time under each window's `answer_grammar`: a window where the grammar had to
overrule the model (it refused the model's own top token somewhere) is merged as unread, as an
unparsable plain answer is, so the merge departs from the plain one only where the grammar chose
tokens for the model. With `shifts` one more decode starts the chunks where a sentence-vector
topic-shift detector says (shifts.py), the model writing only the labels. Decoding and scoring
are apart: `score_windows` re-scores saved window answers without decoding.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict
from pathlib import Path

from mlxlab.decode.offline import complete, reuse_budget
from mlxlab.tasks.chunk.config import WINDOW_MESSAGES
from mlxlab.tasks.chunk.grammar import answer_grammar
from mlxlab.tasks.chunk.metrics import label_similarity, summarize
from mlxlab.tasks.chunk.prompt import conversation_uuid, shown
from mlxlab.tasks.chunk.ref import extract_json_ref, score_ref
from mlxlab.tasks.chunk.scoring import norm_label, score_case
from mlxlab.tasks.chunk.windows import (
    FIXED_CHUNK_TOKENS,
    Window,
    fixed_labels,
    max_prompt_tokens,
    merge_local,
    plan_windows,
    window_chunks,
    window_starts,
)

log = logging.getLogger(__name__)


def n_vocab(model, tokenizer) -> int:
    """The width of the model's logits (embedding rows; may exceed the tokenizer's vocabulary)."""
    return int(getattr(getattr(model, "args", None), "vocab_size", 0) or len(tokenizer._tokenizer))


def evaluate(
    model,
    tokenizer,
    cases: list[dict],
    max_tokens: int = 256,
    batch_size: int = 8,
    progress=None,
    constrained: bool = False,
    budget: int = 8192,
    overlap: int = 2,
    train_labels: set[str] | None = None,
    fixed_starts: list[list[int]] | None = None,
    kv=None,
    max_messages: int | None = WINDOW_MESSAGES,
    speculation: dict | None = None,
) -> list[dict]:
    """Greedy-decode each case's windows (`plan_windows`: at most `max_messages` messages and
    `budget` prompt tokens each; `decode.offline.complete`, in eval mode) and score each case on their
    merge; one dict per case. `constrained` decodes each window under its `answer_grammar`,
    recording the steps where the grammar refused the model's own top token
    (`grammar.Constraint.refused`): a window so overruled is merged as unread (`score_windows`).
    `train_labels` (normalised training-set labels) adds the share of predicted labels that are
    one of them. `fixed_starts` (per case, the shown messages where chunks start: shifts.py
    `chunk_starts`) decodes each window under the grammar whose chunks start exactly there:
    only the labels are the model's. `kv`: the decoder's store of prompt KV, shared by the
    decodes of one model. `speculation`: `offline.complete`'s speculative, draft_tokens,
    draft_model and counts (decode/speculative.py), None: off."""
    windows = plan_windows(cases, tokenizer, budget, overlap, max_messages)
    processors = None
    watched: dict[int, object] = {}  # window -> its watching grammar constraint
    if fixed_starts is not None:
        assert len(fixed_starts) == len(cases), "one list of chunk starts per case"
        constrained = True
        # room for every fixed chunk (two uuids and a label each), however many the detector cut
        most = max((len(window_starts(w, fixed_starts[w.case])) for w in windows), default=0)
        max_tokens = max(max_tokens, FIXED_CHUNK_TOKENS * most + 16)
    if constrained:
        from mlxlab import grammar

        width = n_vocab(model, tokenizer)
        grammars = [
            grammar.lark(
                answer_grammar(w.uuids)
                if fixed_starts is None
                else answer_grammar(w.uuids, fixed=window_starts(w, fixed_starts[w.case])),
                f"case {w.case} answer grammar",
            )
            for w in windows
        ]

        def processors(i):
            watch = fixed_starts is None  # a fixed grammar overrules by design
            constraint = grammar.constrain(grammars[i], tokenizer, width, watch=watch)
            if watch:
                watched[i] = constraint
            return [constraint]

    texts = complete(
        model,
        tokenizer,
        [w.prompt for w in windows],
        max_tokens,
        batch_size,
        progress,
        processors,
        cache=kv,
        **(speculation or {}),
    )
    refused = [watched.pop(i).refused() for i in range(len(windows))] if watched else None
    return score_windows(cases, windows, texts, train_labels, fixed_starts, refused)


def score_windows(
    cases: list[dict],
    windows: list[Window],
    texts: list[str],
    train_labels: set[str] | None = None,
    fixed_starts: list[list[int]] | None = None,
    refused: list[list[int]] | None = None,
) -> list[dict]:
    """`evaluate`'s rows from its windows' answers (`texts`, one per window): a case read in one
    window is scored on its answer as it is, one read in several on their merge (`merge_local`;
    with `fixed_starts`, the fixed chunks named by `fixed_labels`). `refused` (a constrained
    decode's, per window: the steps where the grammar refused the model's own top token; saved
    per window as `window_refused`): a window with any is merged as one whose answer could not be
    read (its answer kept in `window_outputs`, counted in `window_unread` and
    `window_failures`): the model's own answer there was one the grammar does not allow (a label
    of one word or more than 12, a character a label may not hold, a uuid of no message in the
    window, a key skipped, ...), so the grammar chose tokens for it, and what follows is not the
    model's decision. Greedy, a window never overruled is answered token for token as without
    the grammar given the same logits (checked on saved answers: 127 of 127 test windows, 20 of
    20 validation, 58 of 58 off-domain, experiments/chunk_seg4/local-windows.md), so this merge
    departs from the unconstrained one only where the grammar overruled. When no window that the
    grammar did not overrule has a chunk to read, the case's windows are merged as written: the
    grammar's answers still make one well-formed cover. Saved `window_outputs` (and
    `window_refused`) and the windows `plan_windows` gives again re-score a run without
    decoding (scripts/chunk_rescore.py)."""
    rows = []
    for i, case in enumerate(cases):
        mine = [k for k, w in enumerate(windows) if w.case == i]
        uuids = [m["uuid"] for m in shown(case["messages"])]
        conv = conversation_uuid(case)
        row = {"case": i, "id": case.get("id", str(i)), "windows": len(mine)}
        ws, wt = [windows[k] for k in mine], [texts[k] for k in mine]
        unread = set()  # the windows merged as unread: the grammar overruled them
        if refused is not None and fixed_starts is None:
            unread = {k for k in mine if refused[k]}
            if not any(
                window_chunks(texts[k], windows[k].uuids, conv)[0] for k in mine if k not in unread
            ):
                unread = set()  # nothing else to read: the grammar's answers as written
        read = [("" if k in unread else texts[k]) for k in mine]
        fixed = fixed_starts is not None and len(mine) > 1
        points, labels, failed = [], {}, 0
        if fixed:  # the cover is the fixed one, even where no window answered
            points = list(fixed_starts[i])
            labels = fixed_labels(ws, read, points, conv)
            failed = sum(
                not window_chunks(t, w.uuids, conv)[0] for w, t in zip(ws, read, strict=True)
            )
        elif len(mine) > 1:
            points, labels, failed = merge_local(ws, read, len(uuids), conv)
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
        obj = extract_json_ref(text)
        chunks = obj.get("chunks") if isinstance(obj, dict) else None
        row["chunks"] = len(chunks) if isinstance(chunks, list) else 0
        if train_labels is not None:
            labs = [c.get("label") for c in chunks or [] if isinstance(c, dict)]
            labs = [x for x in labs if isinstance(x, str)]
            if labs:
                row["memorized_labels"] = sum(norm_label(x) in train_labels for x in labs) / len(
                    labs
                )
        rows.append(row)
    return rows


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
    """Evaluate `records` (dataset.py `read_split`) with `settings` (EvalSettings), write per-case JSONL to `out`; return the summary (+ seconds, results path).
    With `settings.constrained` the split is decoded again under the answer grammar, written to
    `constrained_path(out)`, and its summary is the summary's "constrained" entry. With more than
    one decode, each window's prompt is prefilled once (the decoder's prompt cache, within
    `reuse_budget`): the held KV counts in the evaluation's peak memory (`peak_mem_gb`, from the
    call's start, the model's weights included)."""
    import mlx.core as mx

    from mlxlab.errors import UserError
    from mlxlab.fsutil import atomic_write_text

    mx.reset_peak_memory()

    speculation = None
    if getattr(settings, "speculative", "off") != "off":
        from mlxlab.decode.speculative import Counts, load_draft

        draft = settings.draft_model
        speculation = {
            "speculative": settings.speculative,
            "draft_tokens": settings.draft_tokens,
            "draft_model": load_draft(draft, model, tokenizer) if draft else None,
            "counts": Counts(),
        }

    kv = None
    if getattr(settings, "constrained", False) or getattr(settings, "shifts", ""):
        from mlxlab.decode.prompt_cache import PromptCache

        kv = PromptCache(reuse_budget())  # the decodes after the first skip the prefill

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
            settings.window_overlap,
            train_labels,
            fixed_starts,
            kv,
            settings.window_messages or WINDOW_MESSAGES,
            speculation,
        )
        if getattr(settings, "label_model", ""):
            try:
                label_similarity(rows, settings.label_model)
            except UserError as e:  # a missing extra score never costs the evaluation
                log.warning(f"warning: no label similarity ({settings.label_model}): {e}")
        atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in rows))
        out = {
            **summarize(rows),
            "seconds": round(time.perf_counter() - t0, 1),
            "results": str(path),
        }
        if speculation is not None:  # this decode's drafted and accepted tokens
            counts = speculation["counts"]
            out["speculative"] = {"mode": settings.speculative, **counts.as_dict()}
            speculation["counts"] = type(counts)()
        return out

    starts, detected = None, 0.0
    if getattr(settings, "shifts", ""):  # first: a bad embedding model fails before any decode
        from mlxlab.tasks.chunk.shifts import chunk_starts, detector_summary, shift_rule

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
