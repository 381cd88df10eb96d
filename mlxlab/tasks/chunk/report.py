"""The chunk task's report (the experiment's README): one writer for `task=chunk` and
`task=chunk_pref`, which share its sections (how the split was decoded, the results table, the
notes under it, memory and time, what the metrics mean) and differ in what they compare (base
against tuned; SFT alone against SFT + preference)."""

from __future__ import annotations

import dataclasses
import json
import platform
import re
from collections import Counter
from pathlib import Path

from mlxlab.tasks.chunk.config import SPLITS
from mlxlab.tasks.chunk.metrics import PASSES, fmt, table
from mlxlab.tasks.chunk.ref import extract_json_ref
from mlxlab.tasks.chunk.shifts import Rule, shift_rule


def detector_note(summary: dict) -> str:
    """One line on the topic-shift detector's own boundaries (`detector_summary`), '' without."""
    d = (summary.get("shifts") or {}).get("detector") if isinstance(summary, dict) else None
    if not d:
        return ""
    return (
        f"the topic-shift detector alone ({d['model']}, {Rule(**d['rule'])}; no "
        f"language model): boundary F1 {fmt(d.get('boundary_f1'), 3)}, F1 multi-topic "
        f"{fmt(d.get('boundary_f1_multi'), 3)}, {d['chunks_per_case']:.2f} chunks per case"
    )


def overruled_note(summary: dict) -> str:
    """For a constrained decode's summary (`summarize`): in how many of its windows the grammar
    overruled the model, all merged as unread ("" for any other)."""
    if "overruled_windows" not in summary:
        return ""
    n, total = summary["overruled_windows"], summary["windows"]
    if not n:
        return f"; the grammar overruled the model in none of {total} windows"
    unread = summary.get("unread_windows", 0)
    return f"; the grammar overruled the model in {n} of {total} windows, {unread} merged as unread"


def decoding_line(settings) -> str:
    """How a split was decoded: split, max_tokens, batch, and the further decodes."""
    line = (
        f"- evaluation: {settings.split} split, greedy, max_tokens {settings.max_tokens}, batch "
        f"{settings.batch_size}"
    )
    if settings.constrained:
        line += (
            "; also decoded under the answer's grammar (rows marked constrained: its chunks in "
            "order, closed anywhere; a window the grammar overruled merged as unread)"
        )
    if settings.shifts:
        line += (
            "; also decoded with the chunk boundaries of a topic-shift detector (rows marked "
            f"shift boundaries: {settings.shifts} sentence vectors, a chunk starts at an exchange "
            f"with a {shift_rule(settings)}, its cosine taken with the exchange before; the model "
            "writes the labels)"
        )
    return line


def results(evals: dict[str, dict]) -> list[str]:
    """The results table, then a line per decode read in windows, and the detector's line."""
    lines = [table(evals), ""]
    for name, e in evals.items():
        passes = [(f"{name}, {tag}", e.get(key)) for key, tag in PASSES.items()]
        for tag, sm in [(name, e), *passes]:
            if isinstance(sm, dict) and sm.get("windowed_cases"):
                lines.append(
                    f"- {tag}: {sm['windowed_cases']} of {sm['cases']} conversations read in "
                    f"windows; their windows' answers scored alone: ref "
                    f"{fmt(sm.get('window_ref'))}" + overruled_note(sm)
                )
    by_note: dict[str, list[str]] = {}  # one line per detector result, naming its rows
    for name, e in evals.items():
        if detector_note(e):
            by_note.setdefault(detector_note(e), []).append(name)
    lines += [f"- {', '.join(names)}: {note}" for note, names in by_note.items()]
    return lines


def fmt_gb(gb: float | None) -> str:
    """A peak memory; "n/a" for an unknown one (a resumed run whose checkpoint predates it)."""
    return "n/a" if gb is None else f"{gb:.2f} GB"


def memory_line(summary: dict, evals: dict[str, dict]) -> str:
    return f"- peak memory: training {fmt_gb(summary.get('peak_mem_gb'))}" + "".join(
        f", {k} evaluation {v['peak_mem_gb']:.2f} GB"
        for k, v in evals.items()
        if "peak_mem_gb" in v
    )


def machine_line() -> str:
    import mlx.core as mx

    return (
        f"- machine: {platform.system()} {platform.machine()}, {mx.default_device()}, "
        f"mlx {getattr(mx, '__version__', '?')}"
    )


METRICS = (
    "Metrics: 100 x (0.30 schema + 0.35 anchors + 0.15 labels + 0.20 nonempty) after JSON "
    "extraction and validation with repairs, by two validators: ref = the predecessor's "
    "chunk-eval (gaps and overlaps between chunks cost nothing; the one compared with its "
    "95.10), strict = gaps and overlaps zero the anchors (schema, anchors and labels columns "
    "are strict's); boundary F1 over chunk starts (F1 multi-topic: on the conversations "
    "with two or more gold chunks only; on a one-topic one any one-chunk answer scores 1); "
    "exact chunks = share of gold chunks reproduced exactly; label F1 = word-overlap F1 of "
    "each gold chunk's label with the label of the predicted chunk that overlaps it most "
    "(label similarity: the cosine of the two labels' sentence vectors, with eval.label_model); "
    "memorized labels = share of predicted labels that are verbatim training-set labels (the "
    "test topics are unseen, so these are wrong). Conversations are read in overlapping "
    "windows of at most {budget} prompt tokens and their answers merged "
    "(mlxlab/tasks/chunk/windows.py)."
)


QUESTION = (
    "Does LoRA trained with the {how} teach {model} to split a user/assistant conversation "
    "about anything into topical chunks and answer in the exact JSON schema, on conversations "
    "it never saw in training, within a {budget} run on this machine?"
)


def fmt_minutes(seconds: float | None) -> str:
    """Minutes; "n/a" for unknown seconds (a resumed run whose checkpoint predates them)."""
    return "n/a" if seconds is None else f"{seconds / 60:.1f} min"


def budget_used(task, evals: dict[str, dict]):
    """The window budget the evaluations used (recorded in their summaries), else the setting."""
    used = {e.get("max_prompt_tokens") for e in evals.values()} - {None, 0}
    return used.pop() if len(used) == 1 else (task.eval.max_prompt_tokens or "auto")


def failure_modes(rows: list[dict], scorer: str = "strict") -> list[tuple[str, int]]:
    """Why cases lost points under `scorer` (strict | ref), most common first: `verdict` with
    numbers and quoted values removed."""

    reasons = Counter()
    for r in rows:
        reasons[re.sub(r"\b\d+\b", "N", re.sub(r"'[^']*'", "'...'", verdict(r, scorer)))] += 1
    return reasons.most_common()


def verdict(row: dict, scorer: str = "strict") -> str:
    """One case's verdict under `scorer`: the validator's last note; else "clean" for a full
    score, "labels or schema" when only those cost points."""
    notes_key, total = ("notes", "wellformed") if scorer == "strict" else ("ref_notes", "ref")
    notes = row.get(notes_key) or []
    if notes:
        return notes[-1]
    return "clean" if row.get(total) == 100.0 else "labels or schema"


def data_report(data_dir: Path, tokenizer, max_seq_length: int) -> list[str]:
    """The dataset's histograms in tokens (per split), and how the training examples fit
    max_seq_length."""
    from mlxlab.data.datasets import read_records
    from mlxlab.tasks.chunk.dataset import built_window_messages, stats, stats_markdown
    from mlxlab.tasks.chunk.prompt import prompt

    per_split = {}
    for split in SPLITS:
        path = data_dir / f"{split}.cases.json"
        if path.is_file():
            cases = json.loads(path.read_text())
            per_split[split] = stats(cases, lambda c: len(tokenizer.encode(prompt(c))), "tokens")
    lengths = [
        len(tokenizer.apply_chat_template(r["messages"], return_dict=False))
        for r in read_records(data_dir / "train.jsonl")
    ]
    over = sum(n > max_seq_length for n in lengths)
    cap = built_window_messages(data_dir)
    return [
        "## Data",
        "",
        "Whole conversations per split (the prompt as `eval chunk` reads it, in "
        "tokens; training reads a conversation longer than `window_chars`"
        + (f", or of more than {cap} messages (`window_messages`)," if cap else "")
        + f" as overlapping windows: {len(lengths)} training examples from "
        f"{per_split['train']['cases']} "
        f"conversations, the longest {max(lengths)} tokens with its answer; max_seq_length "
        f"{max_seq_length}, {over} examples over it"
        + (" (cut: see the training log)" if over else ", none cut")
        + ").",
        "",
        stats_markdown(per_split),
        "",
    ]


def decode_seconds(summary: dict) -> list[tuple[str, float]]:
    """An evaluation's decodes and their seconds: ("plain", s), then each further pass
    (metrics.py PASSES: constrained, shift boundaries) that ran."""
    more = [
        (tag, summary[k].get("seconds", 0.0))
        for k, tag in PASSES.items()
        if isinstance(summary.get(k), dict)
    ]
    return [("plain", summary["seconds"]), *more]


def eval_seconds(summary: dict) -> float:
    """An evaluation's decoding time: every decode it made (`decode_seconds`)."""
    return sum(s for _, s in decode_seconds(summary))


def pass_times(summary: dict) -> str:
    """The minutes of each decode, " (X plain, Y constrained, Z shift boundaries)", for an
    evaluation that decoded more than once; "" for one that decoded once."""
    decodes = decode_seconds(summary)
    if len(decodes) == 1:
        return ""
    return " (" + ", ".join(f"{s / 60:.1f} {tag}" for tag, s in decodes) + ")"


def wall_line(summary: dict, evals: dict[str, dict], wall_s: float) -> str:
    """The report's wall-time line: the whole run, training, and each evaluation with its
    decodes' minutes; a resumed run says which figures are this attempt's."""
    # training: every attempt's (train/checkpoint.py RunTotals)
    whole = "resumed_from_step" in summary
    training = training_minutes(summary) if whole else fmt_minutes(summary.get("seconds"))
    line = f"- wall time: {fmt_minutes(wall_s)} in all; training {training}" + "".join(
        f", {k} evaluation {fmt_minutes(eval_seconds(v))}{pass_times(v)}" for k, v in evals.items()
    )
    if summary.get("start_step"):
        line += (
            f". Resumed at step {summary['start_step']}: the total "
            + ("is" if whole else "and training are")
            + " this attempt's, evaluations read back from the run their own attempt's"
        )
    return line


def training_minutes(summary: dict) -> str:
    """The training time; a resumed run's says what it covers: every attempt (train/checkpoint.py RunTotals),
    or, in a summary written before those were kept, this attempt alone."""
    line = fmt_minutes(summary.get("seconds"))
    if "resumed_from_step" in summary:
        return (
            f"{line} in all attempts, {fmt_minutes(summary.get('resumed_seconds'))} of it after "
            f"resuming at step {summary['resumed_from_step']}"
        )
    if summary.get("start_step"):
        return f"{line} of this attempt, resumed at step {summary['start_step']}"
    return line


def per_case(run_dir: Path, split: str) -> list[str]:
    """Where the tuned model loses points (the validators' verdicts), its per-case figures, and
    its first answer; [] without `eval_tuned.jsonl`."""
    tuned_rows = run_dir / "eval_tuned.jsonl"
    if not tuned_rows.is_file():
        return []
    rows = [json.loads(x) for x in tuned_rows.read_text().splitlines()]
    lines = [
        "## Where the tuned model loses points",
        "",
        "The validators' verdicts (ref: an unresolvable anchor fails the case, repairs cost "
        "anchor points; strict: a gap or overlap between chunks also zeroes the anchors):",
        "",
        "| ref verdict | cases |",
        "|---|---|",
        *[f"| {reason} | {n} |" for reason, n in failure_modes(rows, "ref")],
        "",
        "| strict verdict | cases |",
        "|---|---|",
        *[f"| {reason} | {n} |" for reason, n in failure_modes(rows, "strict")],
        "",
        "Per case (windows: prompts the conversation was read in; chunks: predicted / gold):",
        "",
        "| case | windows | chunks | ref | strict | boundary F1 | label F1 | ref verdict |",
        "|---|---|---|---|---|---|---|---|",
    ]
    gold_n = {}
    cases_path = run_dir / "data" / f"{split}.cases.json"
    if cases_path.is_file():
        gold_n = {c["id"]: len(c["chunks"]) for c in json.loads(cases_path.read_text())}
    for r in rows:
        obj = extract_json_ref(r["output"])
        chunks = obj.get("chunks") if isinstance(obj, dict) else None
        n_pred = len(chunks) if isinstance(chunks, list) else "-"
        lines.append(
            f"| {r.get('id', r['case'])} | {r.get('windows', 1)} | {n_pred} / "
            f"{gold_n.get(r.get('id'), '?')} | {r['ref']:.1f} | {r['wellformed']:.1f} | "
            f"{fmt(r.get('boundary_f1'), 2)} | {fmt(r.get('label_f1'), 2)} | "
            f"{verdict(r, 'ref')[:60]} |"
        )
    first = rows[0]
    return lines + [
        "",
        "## A tuned answer (first test case)",
        "",
        "```json",
        first["output"].strip(),
        "```",
        f"ref {first['ref']:.1f}, strict {first['wellformed']:.1f}, boundary F1 "
        f"{fmt(first.get('boundary_f1'), 2)}, exact chunks {fmt(first.get('exact_match'), 2)}",
        "",
    ]


def report(run, task, summary: dict, evals: dict[str, dict], command: str | None = None) -> str:
    """`task=chunk`'s README: question, command, config, results (base and tuned), failure
    modes, data histograms (in tokens), memory and time."""
    cfg, run_dir, how = run.cfg, run.run_dir, summary["gradients"]
    lines = [
        f"# {cfg.name}",
        "",
        "## Question",
        "",
        QUESTION.format(model=cfg.model, budget="90-minute", how=how.split(":")[0]),
        "",
        "## Command",
        "",
        "```bash",
        "python -m mlxlab train " + (command or "..."),
        "```",
        "",
        "Evaluate any adapter on the same split: `python -m mlxlab eval chunk "
        f"data={run_dir / 'data'} adapter={run_dir}`.",
        "",
        "## Config",
        "",
        f"- model: {cfg.model} ({cfg.dtype}), LoRA rank {cfg.lora.rank}, scale {cfg.lora.scale}, "
        f"targets {', '.join(cfg.lora.targets)}, layers {cfg.lora.layers}",
        f"- gradients: {how}",
        f"- steps {cfg.iters} x batch {cfg.batch_size} (accumulation {cfg.grad_accum}), "
        f"{cfg.optim.name} lr {cfg.optim.lr:g}, warm-up {cfg.optim.warmup}, {cfg.optim.schedule}, "
        f"max_seq_length {cfg.data.max_seq_length}",
        f"- data: {json.dumps(dataclasses.asdict(task.data))}",
        decoding_line(task.eval),
        machine_line(),
        "",
        f"## Result ({task.eval.split} split"
        + "".join(f", {x}" for x in task.eval_splits)
        + "; nothing evaluated was seen in training)",
        "",
        *results(evals),
    ]
    val0, val1 = summary.get("initial_val_loss"), summary.get("val_loss")
    if val1 is not None:
        lines.append(
            f"- validation loss: {val0:.4f} -> {val1:.4f}"
            if val0 is not None
            else f"- validation loss: {val1:.4f}"
        )
    lines += [
        memory_line(summary, evals),
        wall_line(summary, evals, summary["wall_s"]),
        "",
        METRICS.format(budget=budget_used(task, evals)),
        "",
        *per_case(run_dir, task.eval.split),
    ]
    if run.tokenizer is not None and (run_dir / "data" / "train.cases.json").is_file():
        lines += data_report(run_dir / "data", run.tokenizer, cfg.data.max_seq_length)
    lines += [
        "## Files",
        "",
        f"Run directory `{run_dir}`: `adapter/`, `metrics.jsonl`, `summary.json`, "
        "`config.yaml`, `data/`, per-case `eval_base.jsonl` / `eval_tuned.jsonl`.",
        "",
    ]
    return "\n".join(lines)


def _steps(run_dir: Path, key: str = "loss") -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if key in r]


def _grpo_lines(cfg, made: dict) -> tuple[str, str, str]:
    """(the question, the objective, the data line) of a GRPO run's report."""
    g = cfg.grpo
    question = (
        f"Does GRPO, rewarding the answer's validity times its boundary F1 (reward.py "
        f"`chunk_reward`) on the SFT run's own training windows, teach {cfg.model} where the "
        "topic of a conversation changes, beyond what SFT alone learned, without losing the "
        "answer's form?"
    )
    objective = (
        f"GRPO ({g.loss}, {g.group_size} completions a prompt at temperature {g.temperature}, "
        f"at most {g.max_tokens} tokens, beta {g.beta}; rewards {', '.join(g.rewards)})"
    )
    data = (
        f"- prompts: {made['examples']} training examples ({made['multi_chunk_examples']} with "
        f"two or more gold chunks) of {made['windows']}, each the SFT example's prompt"
    )
    return question, objective, data


def pref_report(run, task, summary: dict, evals: dict, command: str | None = None) -> str:
    """`task=chunk_pref`'s README: question, command, config, SFT against SFT + preference, the
    pairs (GRPO: the prompts), the training curve's ends, per-case boundary F1 of both, memory and time."""
    cfg, run_dir = run.cfg, run.run_dir
    grpo = cfg.objective == "grpo"
    made = json.loads((run_dir / "data" / ("prompts.json" if grpo else "pairs.json")).read_text())
    tuned = f"sft + {cfg.objective}"
    how = summary.get("gradients", "")
    objective = (
        f"DPO (beta {cfg.dpo.beta}, {cfg.dpo.loss}, reference = the SFT adapter)"
        if cfg.objective == "dpo"
        else f"ORPO (lambda {cfg.orpo.lam})"
    )
    question = (
        f"Does {cfg.objective.upper()} on pairs made from the SFT adapter's own mistakes teach "
        f"{cfg.model} where the topic of a conversation changes, beyond what SFT alone learned, "
        "without losing the answer's form?"
    )
    if grpo:
        question, objective, data_line = _grpo_lines(cfg, made)
    else:
        data_line = (
            f"- pairs: {made['pairs']} from {made['examples']} training examples "
            f"({made['multi_chunk_examples']} with two or more gold chunks) of {made['windows']}: "
            f"{made['pairs_sampled']} of the SFT adapter's sampled answers (temperature "
            f"{made['temperature']}) that were wrong ({made['sampled_right']} were right), "
            f"{made['pairs_moved']} gold answers with a boundary moved by one message; sampled "
            f"in {fmt_minutes(made['seconds'])}"
        )
    lines = [
        f"# {cfg.name}",
        "",
        "## Question",
        "",
        question,
        "",
        "## Command",
        "",
        "```bash",
        "python -m mlxlab train " + (command or "..."),
        "```",
        "",
        f"On top of the SFT run `{made['sft']}` (`python -m mlxlab train +exp=chunk_seg4`): its "
        f"adapter starts this run, its data gives the {'prompts' if grpo else 'pairs'} and the "
        "evaluation split.",
        "",
        "## Config",
        "",
        f"- objective: {objective}; steps {cfg.iters} x batch {cfg.batch_size} "
        f"{'prompts' if grpo else 'pairs'}, "
        f"{cfg.optim.name} lr {cfg.optim.lr:g}, warm-up {cfg.optim.warmup}, {cfg.optim.schedule}; "
        f"max_seq_length {cfg.data.max_seq_length}",
        f"- gradients: {how}",
        data_line,
        decoding_line(task.eval),
        machine_line(),
        "",
        f"## Result ({task.eval.split} split, topics never seen in training)",
        "",
        *results(evals),
    ]
    steps = _steps(run_dir, "reward" if grpo else "loss")
    if steps:
        curve = ("reward", "completion_len", "truncated", "groups_kept")
        keys = [
            k
            for k in (
                curve if grpo else ("loss", "reward_margin", "pref_accuracy", "log_odds_ratio")
            )
            if k in steps[0]
        ]
        head, tail = steps[: min(8, len(steps))], steps[-min(8, len(steps)) :]
        mean = lambda rs, k: sum(r[k] for r in rs) / len(rs)  # noqa: E731
        lines.append(
            "- training, mean of the first / last 8 steps: "
            + ", ".join(f"{k} {mean(head, k):.3f} -> {mean(tail, k):.3f}" for k in keys)
        )
    lines += [
        memory_line(summary, evals),
        f"- wall time: {fmt_minutes(summary['wall_s'])} in all ({'prompts' if grpo else 'pairs'} "
        f"{fmt_minutes(made['seconds'])}, "
        f"training {training_minutes(summary)}, "
        + ", ".join(f"{k} evaluation {fmt_minutes(v['seconds'])}" for k, v in evals.items())
        + "; SFT alone reused from its run costs nothing here)",
        "",
        METRICS.format(budget=budget_used(task, evals)),
        "",
    ]
    rows = {}
    for name, path in (("sft", run_dir / "eval_sft.jsonl"), (tuned, run_dir / "eval_tuned.jsonl")):
        if path.is_file():
            rows[name] = {r["id"]: r for r in map(json.loads, path.read_text().splitlines())}
    if len(rows) == 2:
        lines += [
            "## Per case (boundary F1 / ref)",
            "",
            f"| case | gold chunks | sft | {tuned} |",
            "|---|---|---|---|",
        ]
        for cid, r in rows[tuned].items():
            s = rows["sft"].get(cid, {})
            lines.append(
                f"| {cid} | {r.get('gold_chunks', '?')} | {fmt(s.get('boundary_f1'), 2)} / "
                f"{fmt(s.get('ref'))} | {fmt(r.get('boundary_f1'), 2)} / {fmt(r.get('ref'))} |"
            )
        lines.append("")
    lines += [
        "## Files",
        "",
        f"Run directory `{run_dir}`: `adapter/`, `metrics.jsonl`, `summary.json`, `config.yaml`, "
        + (
            "`data/` (the prompt records `train.jsonl`, `prompts.json`, the SFT run's cases), "
            "`completions.jsonl` (every rollout with its reward), per-case "
            if grpo
            else "`data/` (the pairs `train.jsonl`, `pairs.json`, the SFT run's cases), per-case "
        )
        + "`eval_sft.jsonl` / `eval_tuned.jsonl`.",
        "",
    ]
    return "\n".join(lines)
