"""Typed configs from plain data, and the one-line check of an enum-like field: what every config
dataclass (mlxlab/config.py, serve/config.py, a task's config.py) and the registry use."""

from __future__ import annotations

from collections.abc import Iterable

from mlxlab.errors import UserError


def check_choice(name: str, value, choices: Iterable[str], what: str | None = None) -> None:
    """UserError naming the field and the allowed values unless `value` is one of `choices`.

    `what` words the message as "unknown <what> 'x': <name> must be one of ...".
    """
    choices = tuple(choices)
    if value in choices:
        return
    allowed = f"{name} must be one of {', '.join(map(str, choices))}"
    raise UserError(f"unknown {what} {value!r}: {allowed}" if what else f"{allowed}, got {value!r}")


def from_dict(cls, data: dict):
    """Build a (nested) config dataclass from plain data, rejecting unknown keys."""
    import dataclasses
    import typing

    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - names
    if unknown:
        raise UserError(f"unknown {cls.__name__} keys: {', '.join(sorted(unknown))}")
    kwargs = {}
    for key, value in data.items():
        sub = hints.get(key)
        kwargs[key] = (
            from_dict(sub, value)
            if dataclasses.is_dataclass(sub) and isinstance(value, dict)
            else value
        )
    return cls(**kwargs)


def to_dict(cfg) -> dict:
    import dataclasses

    return dataclasses.asdict(cfg)
