"""The chunk task: a training run that builds its dataset, evaluates the base and the tuned model
on the held-out split, and writes a report (`train +exp=chunk_seg4`, or `train task=chunk`).

The pieces are the ones the commands use on their own: `data chunk` (dataset.py), `eval chunk`
(evaluate.py) and `train` (mlxlab/train/job.py); this module only sequences them around the
training loop, as the job's hooks, and writes the report (report.py).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

from mlxlab.config import DataConfig, to_dict
from mlxlab.tasks.chunk import dataset
from mlxlab.tasks.chunk.config import WINDOW_MESSAGES, ChunkTaskConfig, check_window_messages
from mlxlab.train.job import Hooks, Run

SPLIT_NAMES = {"dev": "dev (off-domain)", "export": "export-like chats"}
"""How the report names a split's rows."""

log = logging.getLogger(__name__)


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
            self.check_windows(dataset.dataset_dir(data.train))
            self.check_splits(dataset.dataset_dir(data.train))
            return data

        data_dir = run_dir / "data"
        if not (data_dir / "train.cases.json").is_file():
            self.check_windows(None)  # task.data's cap, before building
            self.check_splits(None)
            dataset.write_dataset(data_dir, self.cfg.data, log=log.info)
            log.info(f"built the {self.cfg.name} dataset in {data_dir}")
        else:  # a resumed run's dataset: its own build.json
            self.check_windows(data_dir)
        return dataclasses.replace(data, train=str(data_dir))

    def check_splits(self, data_dir: Path | None) -> None:
        """UserError now, before training, where a split to evaluate will not be there: dev and
        export need task.data.dev=true (in a prebuilt dataset, its files)."""
        from mlxlab.errors import UserError

        for split in [self.cfg.eval.split, *self.cfg.eval_splits]:
            if data_dir is not None:
                if not (data_dir / f"{split}.cases.json").is_file():
                    raise UserError(
                        f"no {split} split in {data_dir} (no {split}.cases.json"
                        + (
                            "; build it with data chunk dev=true)"
                            if split in ("dev", "export")
                            else ")"
                        )
                    )
            elif split in ("dev", "export") and not self.cfg.data.dev:
                raise UserError(f"evaluating the {split} split needs task.data.dev=true")

    def check_windows(self, data_dir: Path | None) -> None:
        """UserError now, before the base evaluation and training, where the evaluation's window
        cap is no larger than eval.window_overlap (its windows would step one message at a
        time): eval.window_messages, or when 0 the dataset's (`data_dir`'s build.json, or
        task.data's for the dataset about to be built; 4 for a dataset that says none)."""
        own = self.cfg.eval.window_messages
        cap = own or (
            dataset.built_window_messages(data_dir) if data_dir else self.cfg.data.window_messages
        )
        source = (
            ""
            if own
            else "task.eval.window_messages is 0, so it takes the dataset's: set it, or lower "
            "task.eval.window_overlap"
        )
        check_window_messages(cap or WINDOW_MESSAGES, self.cfg.eval.window_overlap, "", source)

    def before_lora(self, run: Run) -> None:
        if self.cfg.eval.shifts:  # a wrong embedding model fails now, not after training
            from mlxlab.tasks.chunk.shifts import check_model

            check_model(self.cfg.eval.shifts)
        if self.cfg.eval_base:
            self.evaluate_splits(run, "base")

    def after_training(self, run: Run, summary: dict) -> None:
        self.evaluate_splits(run, "tuned")
        summary["eval"] = self.evals

    def evaluate_splits(self, run: Run, which: str) -> None:
        """`which` on eval.split (its row `which`), then on each of eval_splits (its row
        "<which>, <split's name>")."""
        self.evals[which] = self.evaluate(run, which)
        for split in self.cfg.eval_splits:
            self.evals[f"{which}, {SPLIT_NAMES.get(split, split)}"] = self.evaluate(
                run, which, split
            )

    def report_text(self, run: Run, summary: dict) -> str:
        """The run's report (README.md); a subclass's task writes its own."""
        from mlxlab.tasks.chunk.report import report

        return report(run, self.cfg, summary, self.evals, self.command)

    def finish(self, run: Run, summary: dict) -> None:
        """The report into the run directory (and task.report), the table on the log."""
        from mlxlab.fsutil import atomic_write_text, writable_dir
        from mlxlab.tasks.chunk.metrics import table

        text = self.report_text(run, summary)
        atomic_write_text(run.run_dir / "README.md", text)
        if self.cfg.report:
            report_path = Path(self.cfg.report).expanduser().absolute()
            writable_dir(report_path.parent)
            atomic_write_text(report_path, text)
            log.info(f"report: {self.cfg.report}")
        log.info(table(self.evals))

    def evaluate(self, run: Run, which: str, split: str | None = None) -> dict:
        """Evaluate on the task's split (or `split`); results in <run>/eval_<which>[_<split>].jsonl,
        summary cached in <run>/eval_<which>[_<split>].json (a resumed run does not evaluate the
        base model again)."""
        from mlxlab.fsutil import atomic_write_text
        from mlxlab.tasks.chunk.evaluate import evaluate_model

        settings = self.cfg.eval
        if split is not None:
            settings = dataclasses.replace(settings, split=split)
        stem = f"eval_{which}" + (f"_{split}" if split is not None else "")
        cached = run.run_dir / f"{stem}.json"
        if cached.is_file():
            return json.loads(cached.read_text())
        data_dir = dataset.dataset_dir(run.data.train)
        records = dataset.read_split(data_dir, settings)  # a missing or bad split fails here
        if which == "base" and not self.cfg.eval_base_constrained:
            settings = dataclasses.replace(settings, constrained=False, shifts="")
        if not settings.max_prompt_tokens:  # windows as long as the training examples' prompts
            window = dataset.training_window(data_dir, run.tokenizer)
            settings = dataclasses.replace(settings, max_prompt_tokens=window)
        if not settings.window_messages:  # as many messages as a training example
            cap = dataset.built_window_messages(data_dir) or WINDOW_MESSAGES
            settings = dataclasses.replace(settings, window_messages=cap)
        summary = evaluate_model(
            run.model,
            run.tokenizer,
            records,
            settings,
            run.run_dir / f"{stem}.jsonl",
            which,
            dataset.training_labels(data_dir),
        )
        summary["max_prompt_tokens"] = settings.max_prompt_tokens
        summary["window_messages"] = settings.window_messages
        atomic_write_text(cached, json.dumps(summary, indent=2) + "\n")
        return summary
