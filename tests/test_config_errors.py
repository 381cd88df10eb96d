"""A bad value of any enum-like config field, on any command, is a one-line UserError at config
time that names the field and the allowed values (no traceback on the command line)."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from mlxlab import config, registry
from mlxlab.errors import UserError
from tests.helpers.cli import run_cli

DTYPES = ("auto", "float32", "bfloat16", "float16")


def _optimizers() -> tuple[str, ...]:
    import mlx.optimizers as optim

    return tuple(
        n.lower()
        for n, c in vars(optim).items()
        if isinstance(c, type)
        and issubclass(c, optim.Optimizer)
        and c not in (optim.Optimizer, optim.MultiOptimizer)
    )


# command -> {field path: the values it allows}; "modes" is a list field (each entry is checked).
# speculative=draft_model needs draft_model=, so the values tried alone are these two
SPECULATIVE = ("off", "prompt_lookup")
ENUMS = {
    "generate": {
        "dtype": DTYPES,
        "decode_head": ("auto", "exact", "bfloat16"),
        "speculative": SPECULATIVE,
    },
    "models": {
        "action": ("list", "pull", "convert", "quantize", "info"),
        "dtype": ("float32", "bfloat16", "float16"),
    },
    "lora": {
        "action": ("check", "fuse", "export", "import"),
        "dtype": DTYPES,
        "format": ("peft", "gguf"),
    },
    "train": {
        "dtype": DTYPES,
        "wandb": ("offline", "online", "disabled"),
        "data.on_too_long": ("truncate", "error"),
        "optim.name": _optimizers(),
        "optim.schedule": ("cosine", "constant"),
        "backward.mode": ("full", "checkpoint", "segmented"),
        "backward.plan": ("size", "auto"),
        "objective": ("sft", "dpo", "orpo", "grpo"),
        "lora.type": ("lora", "dora", "full"),
        "dpo.loss": ("sigmoid", "ipo"),
        "grpo.loss": ("grpo", "dr_grpo", "gspo", "dapo"),
        "grpo.scale_rewards": ("group", "none"),
        "dist.backend": ("any", "ring", "mpi", "jaccl", "nccl"),
    },
    "diag": {
        "speculative": SPECULATIVE,
        "action": ("parity", "leak", "memory", "decode", "profile"),
        "dtype": DTYPES,
        "decode_head": ("auto", "exact", "bfloat16"),
        "mode": ("full", "checkpoint", "segmented"),
        "modes": ("full", "checkpoint", "seg1", "seg12", "auto", "mlx_lm", "mlx_lm_gc"),
        "lora_type": ("lora", "dora", "full"),
        "objective": ("sft", "dpo", "orpo"),
        "dpo.loss": ("sigmoid", "ipo"),
    },
    "data chunk": {},
    "eval chunk": {
        "split": ("train", "valid", "test"),
        "dtype": DTYPES,
        "speculative": SPECULATIVE,
    },
    "serve": {
        "speculative": SPECULATIVE,
        "dtype": DTYPES,
        "decode_head": ("auto", "exact", "bfloat16"),
        "kv_quant": ("off", "4", "8", "config", "plan.json"),
    },
    "runs": {},
    "transcribe": {
        "task": ("transcribe", "translate"),
        "format": ("text", "json", "verbose_json", "srt", "vtt"),
        "dtype": DTYPES,
    },
}
# Task configs (train's `task` group): task name -> {field path under task.: allowed values}.
TASK_ENUMS = {
    "chunk": {
        "name": ("chunk",),
        "eval.split": ("train", "valid", "test"),
        "eval_splits": ("valid", "dev", "export"),  # train and eval.split's test: refused
        "eval.speculative": SPECULATIVE,
    },
    "chunk_pref": {
        "name": ("chunk_pref",),
        "eval.split": ("train", "valid", "test"),
        "eval.speculative": SPECULATIVE,
    },
}

# String fields that take free text (paths, names, prompts): everything else string-typed is an enum.
FREE = {
    "generate": {"model", "prompt", "system", "adapter", "draft_model"},
    "models": {"target", "out"},
    "lora": {"model", "adapter", "out"},
    "train": {
        "name",
        "model",
        "out_dir",
        "wandb_project",
        "data.train",
        "data.valid",
        "lora.targets",
        "lora.init",
        "grpo.stop",
        "grpo.rewards",  # format-checked (a built-in name or module:function)
    },
    "diag": {"model", "adapter", "out"},
    "data chunk": {"out"},
    "eval chunk": {"model", "adapter", "data", "out", "label_model", "shifts", "draft_model"},
    "serve": {"model", "host", "adapter_root", "draft_model"}
    | {"api_key", "api_key_file", "admin_key", "allowed_hosts", "cors_origins"}  # format-checked
    | {"runs_dir"}
    | {"image_url_hosts"}  # format-checked
    | {"stt_model", "embeddings_model", "stt_language"},  # resolved (and checked) at load
    "runs": {"dir", "host", "api_key", "api_key_file", "allowed_hosts", "cors_origins"},
    "transcribe": {"file", "model", "language", "prompt", "out"},
}
TASK_FREE = {
    "chunk": {"report", "eval.label_model", "eval.shifts", "eval.draft_model"},
    "chunk_pref": {"report", "sft", "eval.label_model", "eval.shifts", "eval.draft_model"},
}


def schemas() -> dict[str, type]:
    """Every command's config dataclass, a verb's as "<command> <task>" (`eval chunk`)."""
    out = dict(registry.commands())
    for command in ("data", "eval"):
        out |= {f"{command} {t}": v.schema for t, v in registry.verbs(command).items()}
    return out


SCHEMAS = schemas()
TASKS = registry.groups("train")["task"]


def string_fields(cls, prefix: str = "") -> set[str]:
    """Dotted paths of every str / str | None / list[str] field, nested dataclasses included."""
    out = set()
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            out |= string_fields(hint, f"{prefix}{f.name}.")
        elif hint in (str, str | None, list[str]):
            out.add(prefix + f.name)
    return out


def nested(path: str, value) -> dict:
    head, _, rest = path.partition(".")
    return {head: nested(rest, value) if rest else value}


def bad_value(path: str):
    return ["seg1", "bogus"] if path.endswith("modes") else "bogus"


@pytest.mark.parametrize("command", sorted(SCHEMAS))
def test_every_string_field_is_an_enum_or_free_text(command):
    """A new string field has to be sorted here, so an enum-like one cannot go unchecked."""
    fields = string_fields(SCHEMAS[command])
    assert fields == set(ENUMS[command]) | FREE[command]


@pytest.mark.parametrize("task", sorted(TASKS))
def test_every_task_string_field_is_an_enum_or_free_text(task):
    assert string_fields(TASKS[task]) == set(TASK_ENUMS[task]) | TASK_FREE[task]


CASES = [(c, p, v) for c, fields in ENUMS.items() for p, v in fields.items()]


@pytest.mark.parametrize("command,path,allowed", CASES, ids=[f"{c}-{p}" for c, p, _ in CASES])
def test_bad_enum_value_is_a_user_error_naming_field_and_choices(command, path, allowed):
    schema = SCHEMAS[command]
    with pytest.raises(UserError) as e:
        config.from_dict(schema, nested(path, bad_value(path)))
    message = str(e.value)
    assert "\n" not in message and "'bogus'" in message
    assert path in message, message
    shown = [a for a in allowed if a not in ("seg1", "seg12", "plan.json")]
    assert all(a in message for a in shown), message
    for value in allowed:  # and every allowed value is accepted
        data = nested(path, [value] if path.endswith("modes") else value)
        if path == "backward.plan" and value == "auto":
            data["backward"]["memory_target_gb"] = 2.0
        config.from_dict(schema, data)


TASK_CASES = [(t, p, v) for t, fields in TASK_ENUMS.items() for p, v in fields.items()]


@pytest.mark.parametrize(
    "task,path,allowed", TASK_CASES, ids=[f"{t}-{p}" for t, p, _ in TASK_CASES]
)
def test_bad_task_value_is_a_user_error(task, path, allowed):
    cls = TASKS[task]
    listed = path.endswith("splits")  # a list of choices: each element is checked
    with pytest.raises(UserError) as e:
        config.from_dict(cls, nested(path, ["bogus"] if listed else "bogus"))
    message = str(e.value)
    assert "\n" not in message and path.rpartition(".")[2] in message
    assert all(a in message for a in allowed), message
    for value in allowed:
        config.from_dict(cls, nested(path, [value] if listed else value))


def test_task_group_options_are_checked_before_hydra():
    from mlxlab.cli import select_named_groups

    with pytest.raises(UserError, match="unknown task 'bogus': task must be one of chunk"):
        select_named_groups("train", ["task.name=bogus"])
    assert select_named_groups(
        "train", ["task.name=chunk", "+task=chunk", "task=null", "task.eval.cases=2"]
    ) == ["task=chunk", "task=chunk", "~task", "task.eval.cases=2"]
    assert select_named_groups("eval", ["split=valid"]) == ["split=valid"]  # no groups there


def test_unknown_dtype_at_run_time_is_a_user_error_too():
    from mlxlab import runtime

    with pytest.raises(UserError, match="unknown dtype 'int8'"):
        runtime.resolve_dtype("int8")
    with pytest.raises(ValueError):
        runtime.resolve_dtype("int8")


@pytest.mark.slow
@pytest.mark.parametrize(
    "args",
    [
        ("generate", "model=tiny-llama", "dtype=foo"),
        ("models", "list", "dtype=foo"),
        ("train", "optim.name=adamz"),
        ("train", "task=bogus"),
        ("lora", "explode"),
        ("diag", "memory", "modes=[full,seg0]"),
        ("data", "bogus"),
        ("eval", "chunk", "split=bogus"),
        ("serve", "kv_quant=bogus"),
        ("train", "data.train=${mlxlab_data:nope}"),  # fails while OmegaConf resolves it
        # found by a CLI probe: Hydra's own several-line reports, and tracebacks
        ("train", "lora.rnak=8"),
        ("train", "iters=abc"),
        ("train", "+exp=nope"),
        ("train", "lora.targets=[q,v"),
        ("generate", "promt=hi"),
        ("train", "model=tiny-llama", "optim.warmup=-5"),
        ("train", "model=tiny-llama", "seed=-1"),
        ("train", "model=tiny-llama", "optim.min_lr=1"),
    ],
    ids=lambda a: "-".join(a).replace("=", "_"),
)
def test_bad_value_on_the_command_line_is_one_line(args):
    r = run_cli(*args, timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1, r.stderr
    assert len(lines) == 1 and lines[0].startswith(f"mlxlab {args[0]}: error:"), r.stderr
    assert "Traceback" not in r.stderr


def test_hydra_reports_and_problem_lists_are_said_on_one_line():
    """What `run_hydra` and `fail` print: Hydra's report less its hints, a list's first problem."""
    from hydra.errors import ConfigCompositionException

    from mlxlab.cli import hydra_problem, one_line

    cause = ValueError(
        "Value 'abc' of type 'str' could not be converted to Integer\n    full_key: iters\n"
        "    object_type=TrainCommandConfig"
    )
    err = ConfigCompositionException("Error merging override iters=abc")
    err.__cause__ = cause
    assert hydra_problem(err) == (
        "Error merging override iters=abc: Value 'abc' of type 'str' could not be converted to "
        "Integer"
    )
    missing = ConfigCompositionException(
        "In 'train': Could not find 'exp/nope'\n\nAvailable options in 'exp':\n\tquickstart\n"
        "\tchunk_seg4\nConfig search path:\n\tprovider=hydra, path=pkg://hydra.conf"
    )
    assert hydra_problem(missing) == (
        "In 'train': Could not find 'exp/nope' (available: quickstart, chunk_seg4)"
    )
    listed = UserError("bad training data:\n  a.jsonl:2: invalid JSON\n  a.jsonl:3: no text\n")
    assert one_line(listed) == "bad training data: a.jsonl:2: invalid JSON (and 1 more)"
    assert one_line(UserError("one thing\nand a detail")) == "one thing"
    many = UserError(
        "bad training data:\n" + "\n".join(f"  a:{i}: x" for i in range(10)) + "\n  ... and 5 more"
    )
    assert one_line(many) == "bad training data: a:0: x (and 14 more)"


@pytest.mark.parametrize(
    "field,value,fragment",
    [
        ("val_batches", -1, "val_batches must be >= 0"),
        ("save_every", -1, "save_every must be >= 0"),
        ("val_every", -1, "val_every must be >= 0"),
        ("seed", -1, "seed must be in"),
        ("optim.warmup", -5, "optim.warmup must be >= 0"),
        ("optim.min_lr", 1.0, "optim.min_lr must be in"),
        ("optim.weight_decay", -1.0, "optim.weight_decay must be >= 0"),
        ("optim.grad_clip", -1.0, "optim.grad_clip must be >= 0"),
    ],
)
def test_training_numbers_out_of_range_are_refused_before_anything_runs(field, value, fragment):
    """A CLI probe found these accepted (a negative val_batches dropped a validation batch,
    min_lr above lr drove the rate up) or failing later with a traceback (warmup, seed)."""
    from mlxlab.config import OptimConfig
    from mlxlab.train.config import TrainConfig

    with pytest.raises(UserError, match=fragment):
        if field.startswith("optim."):
            OptimConfig(**{field.split(".")[1]: value})
        else:
            TrainConfig(**{field: value})
