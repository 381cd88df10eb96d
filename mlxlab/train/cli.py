"""LoRA fine-tuning from the command line.

    python -m mlxlab train +exp=quickstart                  # bundled data, gemma3-270m, minutes
    python -m mlxlab train data.train=my_data/ lora.rank=16 iters=500
    python -m mlxlab train +exp=quickstart out_dir=outputs/q resume=true   # continue a killed run
    python -m mlxlab train +exp=chunk_seg4                  # a task run (task=chunk): data, eval, report

The run directory gets the final adapter (`adapter/`, mlx-lm's layout), checkpoints, metrics.jsonl,
summary.json and the resolved config.yaml; the last line printed is the adapter's path. The job
itself is `mlxlab.train.job.run`; a `task` node is handed to the task that registered it
(mlxlab/registry.py), which returns the hooks the job runs around the loop.
"""

from __future__ import annotations

from mlxlab.cli import command_overrides, run_hydra
from mlxlab.train.config import TrainCommandConfig, TrainConfig


def run(cfg: TrainConfig | TrainCommandConfig, command: str | None = None) -> dict:
    """Train as `cfg` says (with its task, if any); print the adapter's path; return the summary.

    `command` is the command line's overrides, for a task's report."""
    from mlxlab.train import job

    hooks = None
    if isinstance(cfg, TrainCommandConfig):
        from mlxlab import registry

        hooks = registry.hooks_for(cfg.task, command_line=command)
        cfg = cfg.train_config()
    summary = job.run(cfg, hooks)
    if "adapter" in summary:  # (rank 0 of a run on several processes)
        print(f"adapter: {summary['adapter']}")
    return summary


def main(argv: list[str]) -> None:
    command = command_overrides(argv)
    run_hydra("train", argv, lambda cfg: run(cfg, command=command))
