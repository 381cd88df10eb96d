"""What the command line is made of, filled by the packages that provide it.

A provider is a module that, when imported, registers with this one:

- `command(name, schema)`: a command's config dataclass (Hydra's `<name>_schema`);
- `option(command, group, name, schema, hooks)`: an option of a command's config group, as a
  task is an option of train's `task` group (`hooks(config, command=...)` returns the
  `mlxlab.train.job.Hooks` the job runs around the loop);
- `verb(command, task, schema, run, summary)`: what a dispatching command (`data`, `eval`) does
  for a task: `python -m mlxlab eval chunk ...` runs the chunk task's `run(config)`.

Providers are imported by name (`PROVIDERS`, then every module an installed distribution names
in the `mlxlab.providers` entry-point group: a task of your own, in your own package) the first
time anything is looked up. So the Hydra glue (mlxlab/cli.py), the train command and the `data`
and `eval` verbs know no task and import none: a task package registers itself.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from mlxlab.errors import UserError

PROVIDERS = (
    "mlxlab.config",
    "mlxlab.train.config",
    "mlxlab.diag.config",
    "mlxlab.audio.config",
    "mlxlab.serve.config",
    "mlxlab.tasks.chunk",
)
"""mlxlab's own providers, imported in this order."""
ENTRY_POINTS = "mlxlab.providers"
"""The entry-point group other packages name their providers in (`pyproject.toml`:
`[project.entry-points."mlxlab.providers"] mytask = "mypackage.mytask"`)."""


@dataclass(frozen=True)
class Option:
    schema: type
    hooks: Callable | None = None


@dataclass(frozen=True)
class Verb:
    schema: type
    run: Callable
    summary: str = ""


_COMMANDS: dict[str, type] = {}
_OPTIONS: dict[tuple[str, str], dict[str, Option]] = {}
_VERBS: dict[str, dict[str, Verb]] = {}
_loaded = False
_loading = False


def command(name: str, schema: type) -> None:
    _COMMANDS[name] = schema


def option(command: str, group: str, name: str, schema: type, hooks: Callable | None = None):
    _OPTIONS.setdefault((command, group), {})[name] = Option(schema, hooks)


def verb(command: str, task: str, schema: type, run: Callable, summary: str = "") -> None:
    _VERBS.setdefault(command, {})[task] = Verb(schema, run, summary)


def providers() -> list[str]:
    """The provider modules: mlxlab's own, then those of the entry-point group."""
    from importlib.metadata import entry_points

    names = list(PROVIDERS)
    for ep in entry_points(group=ENTRY_POINTS):
        if ep.value not in names:
            names.append(ep.value)
    return names


def load() -> None:
    """Import every provider once (each registers at import)."""
    global _loaded, _loading
    if _loaded or _loading:
        return
    _loading = True
    try:
        for name in providers():
            try:
                importlib.import_module(name)
            except ImportError as e:
                if name in PROVIDERS:
                    raise
                raise UserError(f"the mlxlab provider {name!r} cannot be imported: {e}") from None
        _loaded = True
    finally:
        _loading = False


def commands() -> dict[str, type]:
    """Command name -> its config dataclass."""
    load()
    return dict(_COMMANDS)


def schema(name: str) -> type:
    """The config dataclass of command `name` (a `data`/`eval` verb's: `verb(...).schema`)."""
    load()
    if name not in _COMMANDS:
        raise UserError(f"no command {name!r} registered")
    return _COMMANDS[name]


def groups(command: str) -> dict[str, dict[str, type]]:
    """The config groups of `command`: group -> option name -> its config dataclass."""
    load()
    return {
        group: {name: o.schema for name, o in options.items()}
        for (cmd, group), options in _OPTIONS.items()
        if cmd == command
    }


def group_names() -> set[str]:
    """Every group some command has (Hydra's groups are process-wide: each command registers
    its own only)."""
    load()
    return {group for _, group in _OPTIONS}


def hooks_for(node, command_line: str | None = None, command: str = "train", group: str = "task"):
    """The hooks of the option `node` describes (its config dataclass, or its plain-dict form
    `{"name": ..., ...}` as Hydra composes it); None for no option (no node, or no name: what
    is left of an experiment's option after `task=null`)."""
    from mlxlab.schema import check_choice, from_dict

    if node is None or isinstance(node, dict) and node.get("name") is None:
        return None
    load()
    options = _OPTIONS.get((command, group), {})
    name = node.get("name") if isinstance(node, dict) else getattr(node, "name", None)
    check_choice(f"{group}.name", name, options, group)
    opt = options[name]
    if isinstance(node, dict):
        node = from_dict(opt.schema, node)
    if opt.hooks is None:
        raise UserError(f"{group} {name!r} runs no hooks")
    return opt.hooks(node, command=command_line)


def verbs(command: str) -> dict[str, Verb]:
    """Task name -> what `command` does for it."""
    load()
    return dict(_VERBS.get(command, {}))


def verb_for(command: str, task: str | None) -> tuple[str, Verb]:
    """(task, verb) of `command` for `task`; None: the only task it has (a UserError naming the
    choices when it has several, or the task is not one of them)."""
    from mlxlab.schema import check_choice

    options = verbs(command)
    if task is None:
        if len(options) != 1:
            raise UserError(
                f"{command}: name the task first ({' | '.join(sorted(options)) or 'none registered'}"
                f"): python -m mlxlab {command} TASK key=value ..."
            )
        task = next(iter(options))
    check_choice("task", task, sorted(options), "task")
    return task, options[task]
