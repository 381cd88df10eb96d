"""The chunk task: a training run that builds its dataset, evaluates the base and the tuned model
on the held-out split, and writes a report (`train +exp=chunk_seg4`, or `train task=chunk`).

The pieces are the ones the commands use on their own: `data chunk` (mlxlab/data/chunk.py),
`eval chunk` (mlxlab/eval/chunk.py) and `train` (mlxlab/train/job.py); this module only sequences
them around the training loop, as the job's hooks, and writes the markdown report.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import platform
from pathlib import Path

from mlxlab.config import DataConfig, TrainConfig, to_dict
from mlxlab.tasks.chunk.config import ChunkTaskConfig, check_window_messages
from mlxlab.train.job import Hooks, Run

log = logging.getLogger(__name__)


QUESTION = (
    "Does LoRA trained with the {how} teach {model} to split a conversation "
    "into topical chunks and answer in the exact JSON schema, on topics it never saw in "
    "training, within a {budget} run on this machine?"
)


class ChunkTask(Hooks):
    """Data into <run>/data, base evaluation before LoRA, tuned evaluation after, the report."""

    def __init__(self, cfg: ChunkTaskConfig, command: str | None = None):
        self.cfg = cfg
        self.command = command
        self.evals: dict[str, dict] = {}

    def config(self) -> dict:
        return to_dict(self.cfg)

    def prepare_data(self, data: DataConfig, run_dir: Path) -> DataConfig:
        """The task's dataset is built into `<run>/data` when data.train is unset."""
        from mlxlab.data import chunk
        from mlxlab.fsutil import writable_dir

        writable_dir(run_dir)
        if data.train:
            self.check_windows(chunk.dataset_dir(data.train))
            return data

        data_dir = run_dir / "data"
        if not (data_dir / "train.cases.json").is_file():
            self.check_windows(None)  # task.data's cap, before building
            chunk.write_dataset(data_dir, self.cfg.data)
            log.info(f"built the {self.cfg.name} dataset in {data_dir}")
        else:  # a resumed run's dataset: its own build.json
            self.check_windows(data_dir)
        return dataclasses.replace(data, train=str(data_dir))

    def check_windows(self, data_dir: Path | None) -> None:
        """UserError now, before the base evaluation and training, where the evaluation's window
        cap is no larger than eval.window_overlap (its windows would step one message at a
        time): eval.window_messages, or when 0 the dataset's (`data_dir`'s build.json, or
        task.data's for the dataset about to be built)."""
        from mlxlab.eval.chunk import built_window_messages

        own = self.cfg.eval.window_messages
        cap = own or (
            built_window_messages(data_dir) if data_dir else self.cfg.data.window_messages
        )
        source = (
            ""
            if own
            else "task.eval.window_messages is 0, so it takes the dataset's: set it, or lower "
            "task.eval.window_overlap"
        )
        check_window_messages(cap, self.cfg.eval.window_overlap, "no cap", source)

    def before_lora(self, run: Run) -> None:
        if self.cfg.eval.shifts:  # a wrong embedding model fails now, not after training
            from mlxlab.eval.shifts import check_model

            check_model(self.cfg.eval.shifts)
        if self.cfg.eval_base:
            self.evals["base"] = self.evaluate(run, "base")

    def after_training(self, run: Run, summary: dict) -> None:
        self.evals["tuned"] = self.evaluate(run, "tuned")
        summary["eval"] = self.evals

    def report_text(self, run: Run, summary: dict) -> str:
        """The run's report (README.md); a subclass's task writes its own."""
        return report(
            run.cfg,
            self.cfg,
            run.run_dir,
            summary,
            self.evals,
            summary["gradients"],
            summary["wall_s"],
            self.command,
            run.tokenizer,
        )

    def finish(self, run: Run, summary: dict) -> None:
        """The report into the run directory (and task.report), the table on the log."""
        from mlxlab.eval.chunk import table
        from mlxlab.fsutil import atomic_write_text, writable_dir

        text = self.report_text(run, summary)
        atomic_write_text(run.run_dir / "README.md", text)
        if self.cfg.report:
            report_path = Path(self.cfg.report).expanduser().absolute()
            writable_dir(report_path.parent)
            atomic_write_text(report_path, text)
            log.info(f"report: {self.cfg.report}")
        log.info(table(self.evals))

    def evaluate(self, run: Run, which: str) -> dict:
        """Evaluate on the task's split; results in <run>/eval_<which>.jsonl, summary cached in
        <run>/eval_<which>.json (a resumed run does not evaluate the base model again)."""
        from mlxlab.eval.chunk import evaluate_model, read_split, training_labels
        from mlxlab.fsutil import atomic_write_text

        cached = run.run_dir / f"eval_{which}.json"
        if cached.is_file():
            return json.loads(cached.read_text())

        from mlxlab.data.chunk import dataset_dir
        from mlxlab.eval.chunk import built_window_messages, openings, training_window

        data_dir = dataset_dir(run.data.train)
        settings = self.cfg.eval
        records = read_split(data_dir, settings)  # a missing or bad split fails here, clearly
        if which == "base" and not self.cfg.eval_base_constrained:
            settings = dataclasses.replace(settings, constrained=False, shifts="")
        # answers opened as the training data's (both models, the same windows)
        settings = dataclasses.replace(settings, **openings(settings, data_dir))
        if not settings.max_prompt_tokens:  # windows as long as the training examples' prompts
            window = training_window(data_dir, run.tokenizer)
            settings = dataclasses.replace(settings, max_prompt_tokens=window)
        if not settings.window_messages:  # at most as many messages as a training example
            cap = built_window_messages(data_dir)
            settings = dataclasses.replace(settings, window_messages=cap)
        summary = evaluate_model(
            run.model,
            run.tokenizer,
            records,
            settings,
            run.run_dir / f"eval_{which}.jsonl",
            which,
            training_labels(data_dir),
        )
        summary["max_prompt_tokens"] = settings.max_prompt_tokens
        summary["turns"] = bool(settings.turns)
        summary["starts"] = bool(settings.starts)
        summary["window_messages"] = settings.window_messages
        atomic_write_text(cached, json.dumps(summary, indent=2) + "\n")
        return summary


def fmt_minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min"


def budget_used(task: ChunkTaskConfig, evals: dict[str, dict]):
    """The window budget the evaluations used (recorded in their summaries), else the setting."""
    used = {e.get("max_prompt_tokens") for e in evals.values()} - {None, 0}
    return used.pop() if len(used) == 1 else (task.eval.max_prompt_tokens or "auto")


def failure_modes(rows: list[dict], scorer: str = "strict") -> list[tuple[str, int]]:
    """Why cases lost points under `scorer` (strict | ref), most common first: `verdict` with
    numbers and quoted values removed."""
    import re
    from collections import Counter

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
    from mlxlab.data import chunk as data
    from mlxlab.data.datasets import read_records
    from mlxlab.eval.chunk import built_window_messages

    per_split = {}
    for split in ("train", "valid", "test"):
        path = data_dir / f"{split}.cases.json"
        if path.is_file():
            cases = json.loads(path.read_text())
            per_split[split] = data.stats(
                cases, lambda c: len(tokenizer.encode(data.prompt(c))), "tokens"
            )
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
        data.stats_markdown(per_split),
        "",
    ]


def decode_seconds(summary: dict) -> list[tuple[str, float]]:
    """An evaluation's decodes and their seconds: ("plain", s), then each further pass
    (mlxlab/eval/chunk.py PASSES: constrained, shift boundaries) that ran."""
    from mlxlab.eval.chunk import PASSES

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
    line = (
        f"- wall time: {fmt_minutes(wall_s)} in all; training {fmt_minutes(summary['seconds'])}"
        + "".join(
            f", {k} evaluation {fmt_minutes(eval_seconds(v))}{pass_times(v)}"
            for k, v in evals.items()
        )
    )
    if summary.get("start_step"):
        line += (
            f". Resumed at step {summary['start_step']}: the total and training are this "
            "attempt's, evaluations read back from the run their own attempt's"
        )
    return line


def report(
    cfg: TrainConfig,
    task: ChunkTaskConfig,
    run_dir: Path,
    summary: dict,
    evals: dict[str, dict],
    how: str,
    wall_s: float,
    command: str | None = None,
    tokenizer=None,
) -> str:
    """The experiment's README: question, command, config, result table, failure modes, data
    histograms (in tokens, with `tokenizer`), memory and time."""
    import mlx.core as mx

    from mlxlab.eval import chunk as ev

    budget = "90-minute"
    lines = [
        f"# {cfg.name}",
        "",
        "## Question",
        "",
        QUESTION.format(model=cfg.model, budget=budget, how=how.split(":")[0]),
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
        f"- evaluation: {task.eval.split} split, greedy, max_tokens {task.eval.max_tokens}, "
        f"batch {task.eval.batch_size}"
        + ev.bias_note(task.eval)
        + ev.constrained_note(task.eval)
        + ev.shifts_note(task.eval),
        f"- machine: {platform.system()} {platform.machine()}, {mx.default_device()}, "
        f"mlx {getattr(mx, '__version__', '?')}",
        "",
        f"## Result ({task.eval.split} split, topics never seen in training)",
        "",
        ev.table(evals),
        "",
    ]
    for name, e in evals.items():
        passes = [(f"{name}, {tag}", e.get(key)) for key, tag in ev.PASSES.items()]
        for tag, sm in [(name, e), *passes]:
            if isinstance(sm, dict) and sm.get("windowed_cases"):
                lines.append(
                    f"- {tag}: {sm['windowed_cases']} of {sm['cases']} conversations read in "
                    f"windows; their windows' answers scored alone: ref "
                    f"{ev._fmt(sm.get('window_ref'))}" + ev.overruled_note(sm)
                )
    lines += ev.detector_lines(evals)
    val0, val1 = summary.get("initial_val_loss"), summary.get("val_loss")
    if val1 is not None:
        lines.append(
            f"- validation loss: {val0:.4f} -> {val1:.4f}"
            if val0 is not None
            else f"- validation loss: {val1:.4f}"
        )
    lines += [
        f"- peak memory: training {summary['peak_mem_gb']:.2f} GB"
        + "".join(f", {k} evaluation {v['peak_mem_gb']:.2f} GB" for k, v in evals.items()),
        wall_line(summary, evals, wall_s),
        "",
        "Metrics: 100 x (0.30 schema + 0.35 anchors + 0.15 labels + 0.20 nonempty) after JSON "
        "extraction and validation with repairs, by two validators: ref = the predecessor's "
        "chunk-eval (gaps and overlaps between chunks cost nothing; the one compared with its "
        "95.10), strict = gaps and overlaps zero the anchors (schema, anchors and labels columns "
        "are strict's); boundary F1 over chunk starts (F1 multi-topic: on the conversations "
        "with two or more gold chunks only; on a one-topic one any one-chunk answer scores 1); "
        "exact chunks = share of gold chunks "
        "reproduced exactly; label F1 = word-overlap F1 of each gold chunk's label with the "
        "label of the predicted chunk that overlaps it most (label similarity: the cosine of "
        "the two labels' sentence vectors, with eval.label_model); memorized labels = share of "
        "predicted labels that are verbatim training-set labels (the test topics are unseen, so "
        "these are wrong). A conversation longer than the window budget "
        f"({budget_used(task, evals)} prompt tokens) is read in overlapping windows "
        "and scored on the merged answer (mlxlab/eval/chunk.py).",
        "",
    ]
    tuned_rows = run_dir / "eval_tuned.jsonl"
    if tuned_rows.is_file():
        rows = [json.loads(x) for x in tuned_rows.read_text().splitlines()]
        lines += [
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
        cases_path = run_dir / "data" / f"{task.eval.split}.cases.json"
        if cases_path.is_file():
            gold_n = {c["id"]: len(c["chunks"]) for c in json.loads(cases_path.read_text())}
        for r in rows:
            obj = ev.extract_json_ref(r["output"])
            n_pred = (
                len(obj["chunks"])
                if isinstance(obj, dict) and isinstance(obj.get("chunks"), list)
                else "-"
            )
            lines.append(
                f"| {r.get('id', r['case'])} | {r.get('windows', 1)} | {n_pred} / "
                f"{gold_n.get(r.get('id'), '?')} | {r['ref']:.1f} | {r['wellformed']:.1f} | "
                f"{ev._fmt(r.get('boundary_f1'), 2)} | {ev._fmt(r.get('label_f1'), 2)} | "
                f"{verdict(r, 'ref')[:60]} |"
            )
        lines.append("")
        first = rows[0]
        lines += [
            "## A tuned answer (first test case)",
            "",
            "```json",
            first["output"].strip(),
            "```",
            f"ref {first['ref']:.1f}, strict {first['wellformed']:.1f}, boundary F1 "
            f"{ev._fmt(first.get('boundary_f1'), 2)}, exact chunks "
            f"{ev._fmt(first.get('exact_match'), 2)}",
            "",
        ]
    if tokenizer is not None and (run_dir / "data" / "train.cases.json").is_file():
        lines += data_report(run_dir / "data", tokenizer, cfg.data.max_seq_length)
    lines += [
        "## Files",
        "",
        f"Run directory `{run_dir}`: `adapter/`, `metrics.jsonl`, `summary.json`, "
        "`config.yaml`, `data/`, per-case `eval_base.jsonl` / `eval_tuned.jsonl`.",
        "",
    ]
    return "\n".join(lines)
