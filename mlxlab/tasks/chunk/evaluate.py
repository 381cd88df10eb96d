"""Evaluating a model on the chunk task: decode every window of a split, merge, score.

`evaluate_model` runs a whole split and writes per-case results (what `eval chunk` and the chunk
task's base and tuned evaluations call). Each case is read in windows (windows.py
`plan_windows`), decoded greedily in batches (`generate_all`), the windows' answers merged
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

from mlxlab.decode.settings import PREFILL_STEP
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
) -> list[dict]:
    """Greedy-decode each case's windows (`plan_windows`: at most `max_messages` messages and
    `budget` prompt tokens each; `generate_all`, in eval mode) and score each case on their
    merge; one dict per case. `constrained` decodes each window under its `answer_grammar`,
    recording the steps where the grammar refused the model's own top token
    (`grammar.Constraint.refused`): a window so overruled is merged as unread (`score_windows`).
    `train_labels` (normalised training-set labels) adds the share of predicted labels that are
    one of them. `fixed_starts` (per case, the shown messages where chunks start: shifts.py
    `chunk_starts`) decodes each window under the grammar whose chunks start exactly there:
    only the labels are the model's. `kv`: `generate_all`'s store of prompt KV, shared by the
    decodes of one model."""
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
        if train_labels is not None:
            obj = extract_json_ref(text)
            chunks = obj.get("chunks") if isinstance(obj, dict) else None
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
    one decode, each window's prompt is prefilled once (`generate_all`'s `kv`, within
    `kv_budget`): the held KV counts in the evaluation's peak memory (`peak_mem_gb`, from the
    call's start, the model's weights included)."""
    import mlx.core as mx

    from mlxlab.errors import UserError
    from mlxlab.fsutil import atomic_write_text

    mx.reset_peak_memory()

    kv = None
    if getattr(settings, "constrained", False) or getattr(settings, "shifts", ""):
        from mlxlab.serve.engine.prompt_cache import PromptCache  # (moves to mlxlab.decode)

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
            settings.window_overlap,
            train_labels,
            fixed_starts,
            kv,
            settings.window_messages or WINDOW_MESSAGES,
        )
        if getattr(settings, "label_model", ""):
            try:
                label_similarity(rows, settings.label_model)
            except UserError as e:  # a missing extra score never costs the evaluation
                log.warning(f"warning: no label similarity ({settings.label_model}): {e}")
        atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in rows))
        return {
            **summarize(rows),
            "seconds": round(time.perf_counter() - t0, 1),
            "results": str(path),
        }

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
