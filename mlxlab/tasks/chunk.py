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
from dataclasses import dataclass, field
from pathlib import Path

from mlxlab.config import (
    ChunkDataConfig,
    DataConfig,
    EvalSettings,
    TrainConfig,
    check_choice,
    to_dict,
)
from mlxlab.train.job import Hooks, Run

log = logging.getLogger(__name__)


@dataclass
class ChunkTaskConfig:
    """`task=chunk`: the run's dataset is built when data.train is unset, and the base and tuned
    models are evaluated on it after training."""

    name: str = "chunk"
    """The task (config group option `task/chunk`)."""
    data: ChunkDataConfig = field(default_factory=ChunkDataConfig)
    eval: EvalSettings = field(default_factory=EvalSettings)
    eval_base: bool = True
    """Also evaluate the base model (before LoRA is attached)."""
    report: str | None = None
    """Markdown report written after the run (e.g. experiments/chunk_seg4/README.md)."""

    def __post_init__(self):
        check_choice("task.name", self.name, ("chunk",), "task")


CONFIG = ChunkTaskConfig

QUESTION = (
    "Does LoRA trained with the {how} teach {model} to split a conversation "
    "into topical chunks and answer in the exact JSON schema, on topics it never saw in "
    "training, within a {budget} run on this machine?"
)


def hooks(cfg: ChunkTaskConfig, command: str | None = None) -> ChunkTask:
    return ChunkTask(cfg, command)


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
        from mlxlab.fsutil import writable_dir

        writable_dir(run_dir)
        if data.train:
            return data
        from mlxlab.data import chunk

        data_dir = run_dir / "data"
        if not (data_dir / "train.jsonl").is_file():
            chunk.write_jsonl(data_dir, self.cfg.data)
            log.info(f"built the {self.cfg.name} dataset in {data_dir}")
        return dataclasses.replace(data, train=str(data_dir))

    def before_lora(self, run: Run) -> None:
        if self.cfg.eval_base:
            self.evals["base"] = self.evaluate(run, "base")

    def after_training(self, run: Run, summary: dict) -> None:
        self.evals["tuned"] = self.evaluate(run, "tuned")
        summary["eval"] = self.evals

    def finish(self, run: Run, summary: dict) -> None:
        from mlxlab.eval.chunk import table
        from mlxlab.fsutil import atomic_write_text, writable_dir

        text = report(
            run.cfg,
            self.cfg,
            run.run_dir,
            summary,
            self.evals,
            summary["gradients"],
            summary["wall_s"],
            self.command,
        )
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
        from mlxlab.eval.chunk import evaluate_model, read_split
        from mlxlab.fsutil import atomic_write_text

        cached = run.run_dir / f"eval_{which}.json"
        if cached.is_file():
            return json.loads(cached.read_text())
        import mlx.core as mx

        train = Path(run.data.train)
        data_dir = train if train.is_dir() else train.parent
        mx.reset_peak_memory()
        summary = evaluate_model(
            run.model,
            run.tokenizer,
            read_split(data_dir, self.cfg.eval),
            self.cfg.eval,
            run.run_dir / f"eval_{which}.jsonl",
            which,
        )
        summary["peak_mem_gb"] = round(mx.get_peak_memory() / 1e9, 3)
        atomic_write_text(cached, json.dumps(summary, indent=2) + "\n")
        return summary


def _fmt_minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min"


def failure_modes(rows: list[dict]) -> list[tuple[str, int]]:
    """Why cases lost points, most common first (the validator's last note, numbers removed)."""
    import re
    from collections import Counter

    reasons = Counter()
    for r in rows:
        note = r["notes"][-1] if r["notes"] else ("clean" if r["wellformed"] == 100.0 else "labels")
        reasons[re.sub(r"\b\d+\b", "N", re.sub(r"'[^']*'", "'...'", note))] += 1
    return reasons.most_common()


def report(
    cfg: TrainConfig,
    task: ChunkTaskConfig,
    run_dir: Path,
    summary: dict,
    evals: dict[str, dict],
    how: str,
    wall_s: float,
    command: str | None = None,
) -> str:
    """The experiment's README: question, command, config, result table, memory and time."""
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
        + (
            "; also decoded under the answer's JSON schema (rows marked constrained)"
            if task.eval.constrained
            else ""
        ),
        f"- machine: {platform.system()} {platform.machine()}, {mx.default_device()}, "
        f"mlx {getattr(mx, '__version__', '?')}",
        "",
        f"## Result ({task.eval.split} split, topics never seen in training)",
        "",
        ev.table(evals),
        "",
    ]
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
        f"- wall time: {_fmt_minutes(wall_s)} in all; training {_fmt_minutes(summary['seconds'])}"
        + "".join(f", {k} evaluation {_fmt_minutes(v['seconds'])}" for k, v in evals.items()),
        "",
        "Metrics: 100 x (0.30 schema + 0.35 anchors + 0.15 labels + 0.20 nonempty) after JSON "
        "extraction and validation with repairs, by two validators: ref = the predecessor's "
        "chunk-eval (gaps and overlaps between chunks cost nothing; the one compared with its "
        "95.10), strict = gaps and overlaps zero the anchors (schema, anchors and labels columns "
        "are strict's); boundary F1 over chunk starts; exact chunks = share of gold chunks "
        "reproduced exactly (mlxlab/eval/chunk.py).",
        "",
    ]
    tuned_rows = run_dir / "eval_tuned.jsonl"
    if tuned_rows.is_file():
        rows = [json.loads(x) for x in tuned_rows.read_text().splitlines()]
        lines += [
            "## Where the tuned model loses points",
            "",
            "The validator's verdict per test case (repairs cost anchor points; a gap or overlap "
            "between chunks cannot be repaired and zeroes them):",
            "",
            "| verdict | cases |",
            "|---|---|",
        ]
        lines += [f"| {reason} | {n} |" for reason, n in failure_modes(rows)]
        lines.append("")
        first = json.loads(tuned_rows.read_text().splitlines()[0])
        lines += [
            "## A tuned answer (first test case)",
            "",
            "```json",
            first["output"].strip(),
            "```",
            (f"ref {first['ref']:.1f}, " if "ref" in first else "")
            + f"strict {first['wellformed']:.1f}, boundary F1 {first['boundary_f1']:.2f}, "
            f"exact chunks {first['exact_match']:.2f}",
            "",
        ]
    lines += [
        "## Files",
        "",
        f"Run directory `{run_dir}`: `adapter/`, `metrics.jsonl`, `summary.json`, "
        "`config.yaml`, `data/`, per-case `eval_base.jsonl` / `eval_tuned.jsonl`.",
        "",
    ]
    return "\n".join(lines)
