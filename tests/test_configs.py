"""Every config composes into its dataclass; Hydra finds configs from the package, not the cwd."""

from __future__ import annotations

import pytest

from mlxlab import cli, config, registry
from mlxlab.train.config import TrainConfig

VERBS = [(c, t) for c in ("data", "eval") for t in sorted(registry.verbs(c))]


@pytest.mark.parametrize("name", sorted(registry.commands()))
def test_every_entry_config_composes(name):
    cfg = cli.compose(name)
    assert isinstance(cfg, registry.commands()[name])


@pytest.mark.parametrize("command,task", VERBS)
def test_every_verb_config_composes(command, task):
    _, verb = registry.verb_for(command, task)
    assert isinstance(cli.compose(command, schema=verb.schema), verb.schema)


def test_every_yaml_is_an_entry_or_a_known_fragment():
    names = {p.stem for p in config.config_dir().glob("*.yaml")}
    assert names - set(registry.commands()) - {"data", "eval"} == {"quiet"}


def test_overrides_apply_and_validate():
    cfg = cli.compose("generate", ["max_tokens=5", "model=tiny-llama"])
    assert (cfg.max_tokens, cfg.model) == (5, "tiny-llama")
    with pytest.raises(config.UserError, match="temperature"):
        cli.compose("generate", ["temperature=-1"])


def test_config_dir_is_absolute_and_independent_of_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert config.config_dir().is_absolute()
    assert (config.config_dir() / "generate.yaml").is_file()


@pytest.mark.parametrize(
    "exp", sorted(p.stem for p in (config.config_dir() / "exp").glob("*.yaml"))
)
def test_every_experiment_composes(exp):
    cfg = cli.compose("train", [f"+exp={exp}"])
    assert cfg.name == exp
    text = (config.config_dir() / "exp" / f"{exp}.yaml").read_text()
    assert text.startswith("# @package _global_")
    assert f"python -m mlxlab train +exp={exp}" in text  # the run command is in the header


def test_quickstart_points_at_the_bundled_data():
    from pathlib import Path

    cfg = cli.compose("train", ["+exp=quickstart"])
    assert (Path(cfg.data.train) / "train.jsonl").is_file()
    with pytest.raises(config.UserError, match="unknown TrainConfig keys: bogus"):
        config.from_dict(TrainConfig, {"bogus": 1})


def test_the_task_is_a_config_group_not_trainer_fields():
    import dataclasses

    assert "task" not in {f.name for f in dataclasses.fields(TrainConfig)}
    assert cli.compose("train", ["+exp=quickstart"]).task is None
    seg4 = cli.compose("train", ["+exp=chunk_seg4", "task.eval.cases=2", "iters=3"])
    assert seg4.task["name"] == "chunk" and seg4.task["eval"]["cases"] == 2 and seg4.iters == 3
    assert seg4.task["report"] == "experiments/chunk_seg4/README.md"
    assert type(seg4.train_config()) is TrainConfig
    hooks = registry.hooks_for(seg4.task)
    assert hooks.cfg.eval.max_tokens == 256 and hooks.config()["name"] == "chunk"
    # one decode per split: the grammar's and the shift boundaries' decodes are opt-in
    assert hooks.cfg.eval.shifts == "" and not hooks.cfg.eval.constrained
    assert hooks.cfg.eval_splits == ["dev", "export"] and hooks.cfg.data.dev
    assert hooks.cfg.data.sharegpt and hooks.cfg.data.natural
    on = cli.compose("train", ["+exp=chunk_seg4", "task.eval.shifts=all-minilm-l6-v2"])
    assert registry.hooks_for(on.task).cfg.eval.shifts == "all-minilm-l6-v2"
    assert cli.compose("train", ["task.name=chunk"]).task["name"] == "chunk"  # the old path
    off = cli.compose("train", ["+exp=chunk_seg4", "task=null"])
    assert registry.hooks_for(off.task) is None
    _, verb = registry.verb_for("eval", "chunk")
    assert cli.compose("eval", ["split=valid"], verb.schema).split == "valid"  # no group there
