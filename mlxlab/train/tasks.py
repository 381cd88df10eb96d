"""Task runs: a training run that builds its task's dataset, evaluates the base and the tuned
model on the held-out split, and writes a report (`train +exp=chunk_seg4`).

The pieces are the ones the commands use on their own: `data chunk` (mlxlab/data/chunk.py),
`eval chunk` (mlxlab/eval/cli.py) and `train`; this module only sequences them around the
training loop and writes the markdown report.
"""

from __future__ import annotations

import dataclasses
import json
import platform
import sys
from pathlib import Path

from mlxlab.config import DataConfig, TrainConfig

QUESTIONS = {
    "chunk": ("Does LoRA trained with the {how} teach {model} to split a conversation "
              "into topical chunks and answer in the exact JSON schema, on topics it never saw in "
              "training, within a {budget} run on this machine?"),
}


def prepare_data(cfg: TrainConfig, run_dir: Path) -> DataConfig:
    """The data config to train on: the task's dataset is built into `<run>/data` when data.train is unset."""
    if not cfg.task.name or cfg.data.train:
        return cfg.data
    from mlxlab.data import chunk

    data_dir = run_dir / "data"
    if not (data_dir / "train.jsonl").is_file():
        chunk.write_jsonl(data_dir, cfg.task.data)
        print(f"built the {cfg.task.name} dataset in {data_dir}", file=sys.stderr)
    return dataclasses.replace(cfg.data, train=str(data_dir))


def evaluate(model, tokenizer, cfg: TrainConfig, data: DataConfig, run_dir: Path, which: str) -> dict:
    """Evaluate on the task's split; results in <run>/eval_<which>.jsonl, summary cached in
    <run>/eval_<which>.json (a resumed run does not evaluate the base model again)."""
    from mlxlab.eval.chunk import read_split
    from mlxlab.eval.cli import evaluate_model
    from mlxlab.fsutil import atomic_write_text

    cached = run_dir / f"eval_{which}.json"
    if cached.is_file():
        return json.loads(cached.read_text())
    import mlx.core as mx

    data_dir = Path(data.train) if Path(data.train).is_dir() else Path(data.train).parent
    mx.reset_peak_memory()
    summary = evaluate_model(model, tokenizer, read_split(data_dir, cfg.task.eval), cfg.task.eval,
                             run_dir / f"eval_{which}.jsonl", which)
    summary["peak_mem_gb"] = round(mx.get_peak_memory() / 1e9, 3)
    atomic_write_text(cached, json.dumps(summary, indent=2) + "\n")
    return summary


def _fmt_minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min"


def command_line() -> str:
    """The overrides this run was started with (when started from the command line)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        return " ".join(HydraConfig.get().overrides.task)
    except (ImportError, ValueError):
        return "..."


def failure_modes(rows: list[dict]) -> list[tuple[str, int]]:
    """Why cases lost points, most common first (the validator's last note, numbers removed)."""
    import re
    from collections import Counter

    reasons = Counter()
    for r in rows:
        note = r["notes"][-1] if r["notes"] else ("clean" if r["wellformed"] == 100.0 else "labels")
        reasons[re.sub(r"\b\d+\b", "N", re.sub(r"'[^']*'", "'...'", note))] += 1
    return reasons.most_common()


def report(cfg: TrainConfig, run_dir: Path, summary: dict, evals: dict[str, dict], how: str,
           wall_s: float, command: str | None = None) -> str:
    """The experiment's README: question, command, config, result table, memory and time."""
    import mlx.core as mx

    from mlxlab.eval import chunk as ev

    budget = "90-minute"
    lines = [f"# {cfg.name}", "",
             "## Question", "", QUESTIONS[cfg.task.name].format(model=cfg.model, budget=budget, how=how.split(":")[0]), "",
             "## Command", "", "```bash",
             "python -m mlxlab train " + (command or command_line()), "```", "",
             "Evaluate any adapter on the same split: `python -m mlxlab eval chunk "
             f"data={run_dir / 'data'} adapter={run_dir}`.", "",
             "## Config", "",
             f"- model: {cfg.model} ({cfg.dtype}), LoRA rank {cfg.lora.rank}, scale {cfg.lora.scale}, "
             f"targets {', '.join(cfg.lora.targets)}, layers {cfg.lora.layers}",
             f"- gradients: {how}",
             f"- steps {cfg.iters} x batch {cfg.batch_size} (accumulation {cfg.grad_accum}), "
             f"{cfg.optim.name} lr {cfg.optim.lr:g}, warm-up {cfg.optim.warmup}, {cfg.optim.schedule}, "
             f"max_seq_length {cfg.data.max_seq_length}",
             f"- data: {json.dumps(dataclasses.asdict(cfg.task.data))}",
             f"- evaluation: {cfg.task.eval.split} split, greedy, max_tokens {cfg.task.eval.max_tokens}, "
             f"batch {cfg.task.eval.batch_size}",
             f"- machine: {platform.system()} {platform.machine()}, {mx.default_device()}, "
             f"mlx {getattr(mx, '__version__', '?')}", "",
             f"## Result ({cfg.task.eval.split} split, topics never seen in training)", "",
             ev.table(evals), ""]
    val0, val1 = summary.get("initial_val_loss"), summary.get("val_loss")
    if val1 is not None:
        lines.append(f"- validation loss: {val0:.4f} -> {val1:.4f}" if val0 is not None
                     else f"- validation loss: {val1:.4f}")
    lines += [f"- peak memory: training {summary['peak_mem_gb']:.2f} GB"
              + "".join(f", {k} evaluation {v['peak_mem_gb']:.2f} GB" for k, v in evals.items()),
              f"- wall time: {_fmt_minutes(wall_s)} in all; training {_fmt_minutes(summary['seconds'])}"
              + "".join(f", {k} evaluation {_fmt_minutes(v['seconds'])}" for k, v in evals.items()),
              "", "Metrics: well-formedness = 100 x (0.30 schema + 0.35 anchors + 0.15 labels + 0.20 "
              "nonempty), after JSON extraction and validation with repairs; boundary F1 over chunk "
              "starts; exact chunks = share of gold chunks reproduced exactly (mlxlab/eval/chunk.py).", ""]
    tuned_rows = run_dir / "eval_tuned.jsonl"
    if tuned_rows.is_file():
        rows = [json.loads(x) for x in tuned_rows.read_text().splitlines()]
        lines += ["## Where the tuned model loses points", "",
                  "The validator's verdict per test case (repairs cost anchor points; a gap or overlap "
                  "between chunks cannot be repaired and zeroes them):", "",
                  "| verdict | cases |", "|---|---|"]
        lines += [f"| {reason} | {n} |" for reason, n in failure_modes(rows)]
        lines.append("")
        first = json.loads(tuned_rows.read_text().splitlines()[0])
        lines += ["## A tuned answer (first test case)", "", "```json", first["output"].strip(), "```",
                  f"well-formedness {first['wellformed']:.1f}, boundary F1 {first['boundary_f1']:.2f}, "
                  f"exact chunks {first['exact_match']:.2f}", ""]
    lines += ["## Files", "", f"Run directory `{run_dir}`: `adapter/`, `metrics.jsonl`, `summary.json`, "
              "`config.yaml`, `data/`, per-case `eval_base.jsonl` / `eval_tuned.jsonl`.", ""]
    return "\n".join(lines)
