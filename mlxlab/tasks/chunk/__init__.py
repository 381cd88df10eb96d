"""The chunk task: split a user/assistant conversation into topic chunks and answer in JSON.

One package holds the whole task (nanochat's `tasks/` is the model: a task is its data and its
evaluation, in one place):

    config.py      its settings: data, evaluation, the verbs' and the train task options'
    task.py        `train task=chunk`: build the data, evaluate base and tuned, write the report
    pref.py        `train task=chunk_pref`: pairs (or GRPO prompts) from an SFT run, DPO/ORPO/GRPO
    reward.py      GRPO's chunk reward and the prompt records it reads
    cli.py         the verbs `data chunk` and `eval chunk`

Importing the package registers it (mlxlab/registry.py); the registrations import nothing
heavy until a command runs.
"""

from __future__ import annotations

from mlxlab import registry
from mlxlab.tasks.chunk.config import (
    ChunkBuildConfig,
    ChunkEvalConfig,
    ChunkPrefConfig,
    ChunkTaskConfig,
)


def _task_hooks(cfg, command=None):
    from mlxlab.tasks.chunk.task import ChunkTask

    return ChunkTask(cfg, command)


def _pref_hooks(cfg, command=None):
    from mlxlab.tasks.chunk.pref import ChunkPrefTask

    return ChunkPrefTask(cfg, command)


def _build(cfg):
    from mlxlab.tasks.chunk import cli

    return cli.build(cfg)


def _evaluate(cfg):
    from mlxlab.tasks.chunk import cli

    return cli.evaluate(cfg)


registry.option("train", "task", "chunk", ChunkTaskConfig, _task_hooks)
registry.option("train", "task", "chunk_pref", ChunkPrefConfig, _pref_hooks)
registry.verb("data", "chunk", ChunkBuildConfig, _build, "build the chunk dataset: out=DIR")
registry.verb("eval", "chunk", ChunkEvalConfig, _evaluate, "score a model on it: adapter=RUN")
