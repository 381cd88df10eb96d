"""The commands whose work a task provides: `python -m mlxlab data TASK ...` and `python -m
mlxlab eval TASK ...`. The first bare word names the task (or `task=NAME`; none: the only task
that has the verb); its registered verb (mlxlab/registry.py) gives the config and the function
run with it."""

from __future__ import annotations

import sys

from mlxlab import registry
from mlxlab.cli import HYDRA_VALUE_FLAGS, fail, run_hydra
from mlxlab.errors import UserError


def split_task(argv: list[str]) -> tuple[str | None, list[str]]:
    """(the task argv names, the rest): its first bare word (not a flag, not key=value) or a
    `task=NAME` override; None when it names none."""
    takes_value = False
    for i, arg in enumerate(argv):
        if takes_value or arg.startswith("-"):
            takes_value = arg in HYDRA_VALUE_FLAGS  # `--cfg job`: job is the flag's
            continue
        key, sep, value = arg.partition("=")
        if not sep:
            return arg, argv[:i] + argv[i + 1 :]
        if key.lstrip("+") == "task":
            return value.strip("'\""), argv[:i] + argv[i + 1 :]
    return None, list(argv)


def dispatch(command: str, argv: list[str]) -> None:
    if any(a in ("-h", "--help") for a in argv) and split_task(argv)[0] is None:
        tasks = registry.verbs(command)
        print(f"usage: python -m mlxlab {command} TASK [key=value ...] [--cfg job] [--help]\n")
        for name, verb in sorted(tasks.items()):
            print(f"  {name:<10} {verb.summary}")
        return
    task, rest = split_task(argv)
    try:
        task, verb = registry.verb_for(command, task)
    except UserError as e:
        fail(command, e)
    run_hydra(command, rest, verb.run, schema=verb.schema)


def data(argv: list[str]) -> None:
    dispatch("data", argv)


def eval(argv: list[str]) -> None:  # noqa: A001 - the command's name
    dispatch("eval", argv)


if __name__ == "__main__":
    dispatch(sys.argv[1], sys.argv[2:])
