"""Hydra CLI glue: compose/run a command's config.

Each command's schema is the dataclass it registered (mlxlab/registry.py: the framework's in
`mlxlab/config.py`, `train`'s in `train/config.py`, the server's in `serve/config.py`, a
`data`/`eval` verb's in its task's package), stored in Hydra's ConfigStore as
`<command>_schema`; `configs/<command>.yaml` composes it. `run_hydra` is what every command's
`main(argv)` calls: positional words become overrides, free text needs no Hydra quoting, and a
bad value (UserError, or a ValueError while the config is built) is one line on stderr and exit 1.
Tests and notebooks use `compose(name, overrides)`. Only this module touches Hydra/OmegaConf.
"""

from __future__ import annotations

import os
import re
import sys
from importlib import resources
from pathlib import Path

from mlxlab import registry
from mlxlab.config import config_dir
from mlxlab.errors import UserError
from mlxlab.schema import check_choice, from_dict


def packaged_data(name: str) -> str:
    """Absolute path of a dataset shipped in mlxlab/data/<name> (`${mlxlab_data:name}` in YAML)."""
    path = Path(str(resources.files("mlxlab.data"))) / name
    if not path.exists():
        raise UserError(f"no bundled dataset {name!r} in {path.parent}")
    return str(path.resolve())


def command_groups(name: str | None) -> dict[str, dict[str, type]]:
    """The config groups of a command's schema: group -> option name -> its config dataclass
    (as registered: train's `task`, whose options the task packages provide). Groups are
    process-wide in Hydra and a group shadows a plain field of the same name, so each command
    sees its own groups only."""
    return registry.groups(name) if name else {}


def register_schemas(name: str | None = None, schema: type | None = None) -> None:
    """Put the dataclasses in Hydra's ConfigStore, for `defaults: [<name>_schema, _self_]` (for
    command `name`, `schema` when given: a verb's), and the config groups of command `name`."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("mlxlab_data"):
        OmegaConf.register_new_resolver("mlxlab_data", packaged_data)

    cs = ConfigStore.instance()
    for command, cls in registry.commands().items():
        cs.store(name=f"{command}_schema", node=cls)
    if schema is not None:
        cs.store(name=f"{name}_schema", node=schema)
    for group in registry.group_names():
        cs.repo.pop(group, None)
    for group, options in command_groups(name).items():
        for option, cls in options.items():
            cs.store(group=group, name=option, node=cls)


def to_dataclass(cfg, cls):
    """Resolved OmegaConf node -> the typed dataclass (runs every __post_init__ check)."""
    from omegaconf import OmegaConf

    data = OmegaConf.to_container(cfg, resolve=True)
    data = {k: v for k, v in data.items() if k != "hydra"}
    return from_dict(cls, data)


ALIASES = {"orpo.lambda": "orpo.lam"}
"""Override keys spelled as papers and peers spell them, for fields named otherwise."""


def select_named_groups(name: str, overrides: list[str]) -> list[str]:
    """Check and normalize the overrides that pick a config group's option.

    `task.name=chunk` is `task=chunk` (the override path from before `task` was a group);
    `task=null` (or `task.name=null`) means no task, even when an experiment picked one; an
    unknown option is a UserError naming the choices; an `ALIASES` key is renamed. Other
    overrides pass unchanged.
    """
    groups = command_groups(name)
    out = []
    for override in overrides:
        key, sep, value = override.partition("=")
        if sep and key.lstrip("+~") in ALIASES:  # a config key Python cannot name
            key = key[: len(key) - len(key.lstrip("+~"))] + ALIASES[key.lstrip("+~")]
            override = f"{key}={value}"
        group = key.lstrip("+").removesuffix(".name")
        if not sep or group not in groups or key.lstrip("+") not in (group, f"{group}.name"):
            out.append(override)
            continue
        value = value.strip().strip("'\"")
        if value.lower() in ("null", "none", "~", ""):
            out.append(f"~{group}")
        else:
            check_choice(group, value, groups[group], group)
            out.append(f"{group}={value}")
    return out


def compose(name: str, overrides: list[str] | None = None, schema: type | None = None):
    """Compose a config without the CLI (tests, notebooks) and return its dataclass (command
    `name`'s registered schema, or `schema`; for a command of verbs, `data` or `eval`, the verb's
    of the task a `task=NAME` override names, else of its only task)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    overrides = list(overrides or [])
    if schema is None and registry.verbs(name):
        named = [o for o in overrides if o.partition("=")[0] == "task"]
        overrides = [o for o in overrides if o not in named]
        task = named[-1].partition("=")[2] if named else None
        schema = registry.verb_for(name, task)[1].schema
    schema = schema or registry.schema(name)
    register_schemas(name, schema)
    with initialize_config_dir(config_dir=str(config_dir()), version_base=None):
        cfg = hydra_compose(config_name=name, overrides=select_named_groups(name, overrides))
    return to_dataclass(cfg, schema)


_NEEDS_QUOTES = set(" \t\n(),[]{}'\"\\")


def quote_free_text(arg: str) -> str:
    """`prompt=def f(n): ...` -> `prompt='def f(n): ...'` so Hydra's grammar takes it verbatim.

    Values that already use Hydra syntax (quotes, lists, dicts, ${...}) are left alone.
    """
    key, sep, value = arg.partition("=")
    if not sep or key.startswith("-") or not value or value[0] in "[{'\"" or "${" in value:
        return arg
    if not _NEEDS_QUOTES & set(value):
        return arg
    # Hydra unescapes backslashes only before a quote or at the end of the string.
    body = value.replace("'", "\\'")
    tail = len(body) - len(body.rstrip("\\"))
    return key + "='" + body + "\\" * tail + "'"


HYDRA_VALUE_FLAGS = {
    "--cfg",
    "-c",
    "--package",
    "-p",
    "--info",
    "-i",
    "--config-path",
    "-cp",
    "--config-name",
    "-cn",
    "--config-dir",
    "-cd",
    "--experimental-rerun",
}


def positional_to_overrides(argv: list[str], names: tuple[str, ...]) -> list[str]:
    """`pull gemma3-270m force=true` -> `action=pull target="gemma3-270m" force=true`."""
    import json

    if not names:
        return list(argv)
    out, words, takes_value = [], 0, False
    for arg in argv:
        if takes_value or arg.startswith("-") or "=" in arg:
            # Hydra flags whose next word is their value (`--cfg job`, `-p pkg`, ...).
            takes_value = arg in HYDRA_VALUE_FLAGS
            out.append(arg)
            continue
        if words >= len(names):
            raise UserError(f"unexpected argument {arg!r}")
        # Quoted, so Hydra's override grammar takes paths and names verbatim.
        out.append(f"{names[words]}={json.dumps(arg)}")
        words += 1
    return out


def command_overrides(argv: list[str]) -> str:
    """The overrides of a command line as typed, without Hydra's flags and `hydra.*` settings
    (what a run's report shows after `python -m mlxlab <command>`)."""
    out, takes_value = [], False
    for arg in argv:
        if takes_value:
            takes_value = False
        elif arg.startswith("-"):
            takes_value = arg in HYDRA_VALUE_FLAGS
        elif not arg.lstrip("+~").startswith("hydra."):
            out.append(arg)
    return " ".join(out)


def one_line(error: Exception) -> str:
    """The message of `error` on one line; OmegaConf's (an interpolation that fails to resolve)
    become `<key>: <the cause>` instead of their multi-line report; a heading ending in `:` over
    a list of problems keeps its first problem and a count of the rest."""
    key, text = getattr(error, "full_key", None), str(getattr(error, "msg", None) or error)
    text = re.sub(r"^\w+ raised while resolving interpolation: ", "", text.strip())
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    text = lines[0] if lines else type(error).__name__
    if len(lines) > 1 and text.endswith(":"):  # a heading over a list of problems: the first
        tail = re.fullmatch(r"\.\.\. and (\d+) more", lines[-1])  # raise_errors' last line
        more = len(lines) - 2 - bool(tail) + (int(tail.group(1)) if tail else 0)
        text = f"{text} {lines[1]}" + (f" (and {more} more)" if more else "")
    return f"{key}: {text}" if key else text


_HYDRA_NOISE = (
    "To append to your config",
    "See https://hydra.cc",
    "full_key:",
    "reference_type=",
    "object_type=",
    "Config search path",
    "provider=",
    "Set the environment variable HYDRA_FULL_ERROR",
)


def hydra_problem(error: BaseException) -> str:
    """Hydra's report of an override it cannot apply (an unknown key, a value of the wrong type,
    a config group option that does not exist, a syntax error), on one line: the messages of the
    error and its causes, less the hints that do not apply here, with a group's options listed."""
    said, options = [], []
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        listing = False
        for line in str(error).splitlines():
            line = line.strip()
            if not line:
                listing = False
            elif line.startswith("Available options"):
                listing = True
            elif line.startswith(_HYDRA_NOISE):
                listing = False
            elif listing:
                options.append(line)
            elif line not in said and line != "None" and "$VALUE" not in line:
                said.append(line)
        error = error.__cause__
    text = "".join(
        ("" if i == 0 else " " if said[i - 1].endswith((".", ":")) else ": ") + line
        for i, line in enumerate(said)
    )
    text = text or "the overrides could not be applied"
    return text + (f" (available: {', '.join(options)})" if options else "")


def fail(name: str, error: Exception) -> None:
    """The one-line error of `mlxlab <name>`, exit code 1."""
    print(f"mlxlab {name}: error: {one_line(error)}", file=sys.stderr)
    sys.exit(1)


def run_hydra(
    name: str,
    argv: list[str],
    task,
    positional: tuple[str, ...] = (),
    schema: type | None = None,
) -> None:
    """Run `task(dataclass)` under Hydra's CLI (overrides, --cfg job, --help, multirun).

    Leading bare words fill the `positional` fields in order (`models pull NAME`). The config is
    command `name`'s registered schema, or `schema` (a verb's). The command's log handler
    (mlxlab/log.py) is installed first.
    """
    import hydra

    from mlxlab import log

    log.setup()
    schema = schema or registry.schema(name)
    register_schemas(name, schema)
    try:
        argv = select_named_groups(name, positional_to_overrides(argv, positional))
    except UserError as e:
        fail(name, e)
    sys.argv = [f"mlxlab {name}", *(quote_free_text(a) for a in argv)]

    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    started = []  # once the task runs, Hydra's and OmegaConf's errors are bugs: tracebacks

    @hydra.main(config_path=str(config_dir()), config_name=name, version_base=None)
    def _main(cfg):
        started.append(True)
        try:
            typed = to_dataclass(cfg, schema)
        except (UserError, ValueError, TypeError) as e:  # a bad value; nothing has run yet
            fail(name, e)
        try:
            return task(typed)
        except UserError as e:
            fail(name, e)
        except KeyboardInterrupt:
            print(f"mlxlab {name}: interrupted", file=sys.stderr)
            sys.exit(130)

    # Hydra reports an override it cannot apply in several lines with hints that do not apply
    # here; with HYDRA_FULL_ERROR it raises instead, and the error is said on one line.
    before = os.environ.get("HYDRA_FULL_ERROR")
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        _main()
    except (HydraException, OmegaConfBaseException) as e:
        if started or before == "1":  # a bug, or a user who asked for the whole report
            raise
        print(f"mlxlab {name}: error: {hydra_problem(e)}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:  # while Hydra composes the config
        print(f"mlxlab {name}: interrupted", file=sys.stderr)
        sys.exit(130)
    finally:
        if before is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = before
