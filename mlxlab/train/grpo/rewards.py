"""Reward functions: the built-in `json` and `match`, and any `module:function` a config names.

A reward is a callable

    reward(completions: list[str], records: list[dict]) -> list[float]

called once per rollout batch with every completion's text (without the end-of-sequence token,
cut before a stop string) and, at the same index, the record of the prompt it answers (the
prompt file's JSON object, every field as written: mlxlab/data/prompts.py). It returns one
finite float per completion. It may carry a `check(records)` attribute: called once on the
training and validation records before training, it raises (or returns a message) when a
record lacks what the reward needs, so bad data stops the run before any rollout.

How a task supplies its reward: a function of this shape in the task's package (the chunk
task's is `mlxlab.tasks.chunk.reward:chunk_reward`, scoring `ref` validity and boundary F1
against the gold boundaries its data step wrote into each prompt record), the task's data step
writing prompt records that carry what it reads, and its experiment naming it:
`grpo.rewards=[mlxlab.tasks.chunk.reward:chunk_reward]` (configs/exp/chunk_grpo.yaml; with
`grpo.reward_weights` beside others). Nothing here imports a task: the name is imported when the run starts.
"""

from __future__ import annotations

import importlib
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass

from mlxlab.errors import UserError


def _validator(schema_text: str):
    import jsonschema

    schema = json.loads(schema_text)
    cls = jsonschema.validators.validator_for(schema)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


_VALIDATORS: dict[str, object] = {}


def validator(schema):
    """A jsonschema validator for `schema` (its draft by `$schema`, 2020-12 by default; formats
    checked), built once per distinct schema."""
    key = json.dumps(schema, sort_keys=True)
    if key not in _VALIDATORS:
        _VALIDATORS[key] = _validator(key)
    return _VALIDATORS[key]


def json_reward(completions: list[str], records: list[dict]) -> list[float]:
    """1.0 where the completion (surrounding whitespace aside) is one JSON value and, where its
    record has a `schema`, that value validates against it; else 0.0."""
    out = []
    for text, record in zip(completions, records, strict=True):
        try:
            value = json.loads(text.strip())
        except ValueError:
            out.append(0.0)
            continue
        schema = record.get("schema")
        ok = schema is None or validator(schema).is_valid(value)
        out.append(1.0 if ok else 0.0)
    return out


def _check_json(records: list[dict]) -> str | None:
    import jsonschema

    for i, r in enumerate(records):
        schema = r.get("schema")
        if schema is None:
            continue
        if not isinstance(schema, (dict, bool)):
            return f"record {i + 1}: 'schema' must be a JSON schema (an object)"
        try:
            jsonschema.validators.validator_for(schema).check_schema(schema)
        except jsonschema.SchemaError as e:
            return f"record {i + 1}: 'schema' is not a valid JSON schema ({e.message})"
    return None


json_reward.check = _check_json


def match_reward(completions: list[str], records: list[dict]) -> list[float]:
    """1.0 where the completion (surrounding whitespace aside) equals its record's `answer` (a
    string, or a list of accepted strings) or, with `answer_regex`, matches it whole
    (re.fullmatch); else 0.0."""
    out = []
    for text, record in zip(completions, records, strict=True):
        text = text.strip()
        if "answer_regex" in record:
            ok = re.fullmatch(record["answer_regex"], text) is not None
        else:
            answer = record["answer"]
            ok = text in answer if isinstance(answer, list) else text == answer
        out.append(1.0 if ok else 0.0)
    return out


def _check_match(records: list[dict]) -> str | None:
    for i, r in enumerate(records):
        if "answer_regex" in r:
            try:
                re.compile(r["answer_regex"])
            except (re.error, TypeError) as e:
                return f"record {i + 1}: 'answer_regex' does not compile ({e})"
        elif "answer" not in r:
            return f"record {i + 1} has no 'answer' (or 'answer_regex')"
        elif not (
            isinstance(r["answer"], str)
            or (isinstance(r["answer"], list) and all(isinstance(a, str) for a in r["answer"]))
        ):
            return f"record {i + 1}: 'answer' must be a string or a list of strings"
    return None


match_reward.check = _check_match

BUILTIN: dict[str, Callable] = {"json": json_reward, "match": match_reward}


@dataclass(frozen=True)
class Reward:
    name: str
    """What the logs call it: the built-in's name, or the function's (reward_<name>)."""
    fn: Callable
    weight: float = 1.0


def resolve(names: list[str], weights: list[float] | None = None) -> list[Reward]:
    """The configured rewards: built-in names, or `module:function` imported now."""
    weights = weights or [1.0] * len(names)
    out, seen = [], set()
    for spec, weight in zip(names, weights, strict=True):
        if spec in BUILTIN:
            name, fn = spec, BUILTIN[spec]
        else:
            module, _, attr = spec.partition(":")
            try:
                obj = importlib.import_module(module)
            except ImportError as e:
                raise UserError(
                    f"grpo.rewards: cannot import {module!r} for {spec} ({e})"
                ) from None
            fn = obj
            for part in attr.split("."):
                fn = getattr(fn, part, None)
            if not callable(fn):
                raise UserError(f"grpo.rewards: {spec} is not a function in {module}")
            name = attr.split(".")[-1]
        if name in seen:
            name = f"{name}_{len(out)}"
        seen.add(name)
        out.append(Reward(name, fn, float(weight)))
    return out


def check(rewards: list[Reward], records: list[dict], source: str) -> None:
    """Each reward's `check` on the records: its complaint as a one-line UserError."""
    for r in rewards:
        checker = getattr(r.fn, "check", None)
        if checker is None:
            continue
        problem = checker(records)
        if problem:
            raise UserError(f"{source}: reward {r.name}: {problem}")


def score(
    rewards: list[Reward], completions: list[str], records: list[dict]
) -> tuple[list[float], dict[str, list[float]]]:
    """(weighted total per completion, {reward name: its values}); a reward that returns
    anything but one finite number per completion stops the run (UserError naming it)."""
    per: dict[str, list[float]] = {}
    for r in rewards:
        try:
            values = r.fn(list(completions), list(records))
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001 - a user's function: name it, then stop
            raise UserError(f"reward {r.name} raised {type(e).__name__}: {e}") from e
        try:
            values = [float(v) for v in values]
        except (TypeError, ValueError):
            raise UserError(f"reward {r.name} must return a list of numbers") from None
        if len(values) != len(completions):
            raise UserError(
                f"reward {r.name} returned {len(values)} values for {len(completions)} completions"
            )
        if not all(math.isfinite(v) for v in values):
            raise UserError(f"reward {r.name} returned a value that is not finite")
        per[r.name] = values
    total = [sum(r.weight * per[r.name][i] for r in rewards) for i in range(len(completions))]
    return total, per
