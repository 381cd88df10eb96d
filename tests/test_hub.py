"""`model=org/name`: Hugging Face repo ids resolved as mlx-lm resolves them (zoo.resolve).

The cache is written in the hub's own layout from a tiny model (tests/helpers/hub.py); the online
path downloads from a loopback stand-in for the Hub's API through the real huggingface_hub, so
nothing leaves the machine."""

from __future__ import annotations

import logging

import numpy as np
import pytest

import mlxlab  # noqa: F401
from mlxlab.config import UserError
from mlxlab.models import zoo
from tests.helpers.hub import FakeHub, write_cache

REPO = "acme/tiny-chat"


@pytest.fixture
def hub_env(monkeypatch, tmp_path):
    """A fresh hub cache (HF_HUB_CACHE) with no endpoint or offline flag set."""
    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    for var in ("HF_HOME", "HF_HUB_OFFLINE", "HF_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)  # no ./acme directory unless a test makes one
    return cache


def _logits(model, tokenizer):
    import mlx.core as mx

    return np.array(model(mx.array(tokenizer.encode("Readability counts."))[None]))


def test_offline_repo_id_loads_from_the_cache(tiny_dir, hub_env, monkeypatch, caplog):
    snapshot = write_cache(hub_env, REPO, tiny_dir("llama"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with caplog.at_level(logging.INFO, logger="mlxlab"):
        assert zoo.resolve(REPO) == snapshot
    assert f"model {REPO}: Hugging Face repo, found in the cache (offline)" in caplog.text
    model, tok = zoo.load(REPO, dtype="float32")
    ref, _ = zoo.load("tiny-llama", dtype="float32")
    np.testing.assert_array_equal(_logits(model, tok), _logits(ref, tok))


def test_hf_home_is_read_when_hf_hub_cache_is_unset(tiny_dir, hub_env, monkeypatch, tmp_path):
    home = tmp_path / "elsewhere"
    snapshot = write_cache(home / "hub", REPO, tiny_dir("llama"))
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert zoo.hub_cache() == home / "hub"
    assert zoo.resolve(REPO) == snapshot


def test_a_local_directory_of_that_name_wins(tiny_dir, hub_env, monkeypatch, tmp_path, caplog):
    import shutil

    write_cache(hub_env, REPO, tiny_dir("llama"))
    local = tmp_path / REPO
    shutil.copytree(tiny_dir("qwen3"), local)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with caplog.at_level(logging.INFO, logger="mlxlab"):
        assert zoo.resolve(REPO).absolute() == local
    assert f"the local directory {local} (not the Hugging Face repo)" in caplog.text


def test_a_missing_repo_offline_is_one_line_naming_what_was_looked_for(hub_env, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError) as err:
        zoo.resolve("acme/absent")
    msg = str(err.value)
    assert "\n" not in msg
    assert "'acme/absent'" in msg and str(hub_env) in msg and "HF_HUB_OFFLINE" in msg
    with pytest.raises(UserError, match="unknown model 'a/b/c'"):
        zoo.resolve("a/b/c")  # not a repo id, not a directory


def test_online_downloads_through_huggingface_hub_then_works_offline(
    tiny_dir, hub_env, monkeypatch, caplog
):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    hub = FakeHub({REPO: tiny_dir("gemma3")})
    try:
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        with caplog.at_level(logging.INFO, logger="mlxlab"):
            path = zoo.resolve(REPO)
        assert "downloaded from the Hub into the cache" in caplog.text
        assert hub.files_served == len(list(tiny_dir("gemma3").iterdir()))
        assert path.parent.parent == hub_env / "models--acme--tiny-chat"
        assert (path / "model.safetensors").read_bytes() == (
            tiny_dir("gemma3") / "model.safetensors"
        ).read_bytes()
        with pytest.raises(UserError, match="the Hub refused it"):
            zoo.resolve("acme/not-there")
    finally:
        hub.close()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the downloaded snapshot is the cache now
    assert zoo.resolve(REPO) == path
    monkeypatch.delenv("HF_HUB_OFFLINE")  # the endpoint is gone: the cache still answers
    assert zoo.resolve(REPO) == path
    with pytest.raises(UserError, match="could not be reached"):
        zoo.resolve("acme/never-cached")


def test_train_generate_and_lora_check_take_a_repo_id(tiny_dir, hub_env, monkeypatch, tmp_path):
    import io

    from mlxlab import generate
    from mlxlab.config import DataConfig, GenerateConfig, LoraConfig, LoraToolConfig
    from mlxlab.lora import cli as lora_cli
    from mlxlab.train.cli import run as train
    from mlxlab.train.config import TrainConfig
    from tests.helpers.cli import REPO as CHECKOUT

    write_cache(hub_env, REPO, tiny_dir("qwen3"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    summary = train(
        TrainConfig(
            model=REPO,
            out_dir=str(tmp_path / "run"),
            iters=2,
            batch_size=2,
            val_every=0,
            save_every=0,
            wandb="disabled",
            data=DataConfig(
                train=str(CHECKOUT / "mlxlab" / "data" / "quickstart"), max_seq_length=64
            ),
            lora=LoraConfig(rank=2),
        )
    )
    out = io.StringIO()
    stats = generate.run(
        GenerateConfig(model=REPO, adapter=summary["adapter"], max_tokens=3, prompt="x"), out=out
    )
    assert stats["generation_tokens"] == 3
    lora_cli.run(LoraToolConfig(action="check", model=REPO, adapter=summary["adapter"]))


@pytest.mark.slow  # subprocesses
def test_the_command_line_takes_a_repo_id_offline(tiny_dir, tmp_path):
    from tests.helpers.cli import run_cli

    cache = tmp_path / "hub"
    write_cache(cache, REPO, tiny_dir("llama"))
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    ok = run_cli("generate", f"model={REPO}", "max_tokens=2", "prompt=hi", env=env)
    assert ok.returncode == 0, ok.stderr
    assert ok.stderr.count(f"model {REPO}: Hugging Face repo, found in the cache (offline)") == 1
    bad = run_cli("generate", "model=acme/absent", "max_tokens=2", env=env)
    assert bad.returncode == 1
    assert bad.stderr.strip().splitlines() == [
        f"mlxlab generate: error: model 'acme/absent': no local directory of that name, and not "
        f"in the Hugging Face cache {cache}; HF_HUB_OFFLINE is set, so nothing is downloaded"
    ]
