"""Task experiments around the training loop: a task is a module here, not fields in TrainConfig.

A task module has `CONFIG` (its config dataclass, with a `name` field; registered as the Hydra
config group option `task/<name>`) and `hooks(cfg, command=None)`, which returns the
`mlxlab.train.job.Hooks` the train command runs around the loop. Registering a task = one line
in TASKS.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from mlxlab.config import check_choice, from_dict

TASKS = {"chunk": "mlxlab.tasks.chunk", "chunk_pref": "mlxlab.tasks.chunk_pref"}
"""Task name -> its module."""


def module(name: str) -> ModuleType:
    check_choice("task.name", name, TASKS, "task")
    return importlib.import_module(TASKS[name])


def configs() -> dict[str, type]:
    """Each task's config dataclass, by name (for Hydra's ConfigStore, group `task`)."""
    return {name: module(name).CONFIG for name in TASKS}


def hooks_for(node, command: str | None = None):
    """The hooks of the task `node` describes: a task config dataclass, or its plain-dict form
    (`{"name": "chunk", ...}`, as composed by Hydra); None for no task (no node, or no name:
    what is left of an experiment's task settings after `task=null`)."""
    if node is None or isinstance(node, dict) and node.get("name") is None:
        return None
    if isinstance(node, dict):
        mod = module(node.get("name"))
        node = from_dict(mod.CONFIG, node)
    else:
        mod = module(getattr(node, "name", None))
    return mod.hooks(node, command=command)
