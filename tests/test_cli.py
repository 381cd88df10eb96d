"""The command line, end to end in subprocesses, on tiny models."""

from __future__ import annotations

import json
import os

import pytest

from tests.helpers.cli import run_cli

pytestmark = pytest.mark.slow  # every test runs `python -m mlxlab` in a subprocess


@pytest.fixture(scope="module")
def env(session_home, tiny_dir):
    tiny_dir("llama")  # built once in-process; the subprocesses reuse it
    return {"MLXLAB_HOME": str(session_home)}


def test_help_lists_the_working_commands():
    r = run_cli("--help")
    assert r.returncode == 0
    assert "generate" in r.stdout and "models" in r.stdout


def test_unknown_command_exits_2():
    r = run_cli("frobnicate")
    assert r.returncode == 2 and "unknown command 'frobnicate'" in r.stderr


def test_generate_streams_and_reports_speed(env):
    r = run_cli("generate", "model=tiny-llama", "max_tokens=6", env=env)
    assert r.returncode == 0, r.stderr
    assert "decode: 6 tokens" in r.stderr and "tok/s" in r.stderr and "peak memory" in r.stderr


def test_generate_is_reproducible_with_a_seed(env):
    """The same seed gives the same text, and another seed other text (so sampling is on)."""
    args = ("generate", "model=tiny-llama", "max_tokens=12", "temperature=1.0")
    first, second = run_cli(*args, "seed=7", env=env), run_cli(*args, "seed=7", env=env)
    other = run_cli(*args, "seed=8", env=env)
    assert first.returncode == 0 and other.returncode == 0, first.stderr + other.stderr
    assert first.stdout == second.stdout
    assert other.stdout.strip() and other.stdout != first.stdout


def test_cfg_job_prints_the_resolved_config(env):
    r = run_cli("generate", "model=tiny-llama", "max_tokens=3", "--cfg", "job", env=env)
    assert r.returncode == 0, r.stderr
    assert "model: tiny-llama" in r.stdout and "max_tokens: 3" in r.stdout


@pytest.mark.parametrize(
    "args,message",
    [
        (("generate", "model=nope"), "unknown model 'nope'"),
        (("generate", "model=tiny-llama", "max_tokens=0"), "max_tokens must be >= 1"),
        (("generate", "model=tiny-llama", "top_p=1.5"), "top_p must be in (0, 1]"),
        (("generate", "max_tokens=abc"), "could not be converted to Integer"),
        (("models", "pull", "nope"), "unknown model 'nope'; known: gemma3-270m"),
        (("models", "convert", "/nonexistent/x.gguf"), "no such GGUF file"),
        (("models", "pull"), "needs a target"),
        (("models", "explode"), "unknown models action"),
    ],
)
def test_bad_input_is_a_one_line_error(env, args, message):
    r = run_cli(*args, env=env)
    assert r.returncode == 1
    assert message in r.stderr
    assert "Traceback" not in r.stderr


def test_models_list_shows_conversion_state(env):
    r = run_cli("models", "list", env=env)
    assert r.returncode == 0
    line = next(x for x in r.stdout.splitlines() if x.startswith("tiny-llama"))
    assert "converted" in line and "not converted" not in line
    assert "gemma3-270m" in r.stdout


def test_unwritable_cache_dir_is_a_clean_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    r = run_cli("models", "pull", "tiny-qwen3", env={"MLXLAB_HOME": str(blocker)})
    assert r.returncode == 1
    assert "cache dir: cannot create directory" in r.stderr and "Traceback" not in r.stderr


def test_gguf_path_works_wherever_a_model_is_named(env, session_home, tmp_path):
    """model=FILE.gguf converts into the cache on first use, then generates."""
    import numpy as np
    from mlx.utils import tree_flatten

    from mlxlab.models import tiny
    from tests.helpers.gguf import write_gguf

    model, tokenizer, config = tiny.build("qwen3", seed=5)
    tokenizer.save_pretrained(str(tmp_path / "tok"))
    weights = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    path = write_gguf(tmp_path / "small.gguf", weights, config, tmp_path / "tok")
    r = run_cli("generate", f"model={path}", "max_tokens=4", env=env)
    assert r.returncode == 0, r.stderr
    cached = [p.name for p in (session_home / "models").iterdir() if p.name.startswith("small-")]
    assert len(cached) == 1 and len(cached[0]) == len("small-") + 12
    r = run_cli(
        "models", "convert", str(path), f"out={tmp_path / 'conv'}", "dtype=float32", env=env
    )
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "conv" / "config.json").is_file()


@pytest.mark.skipif(not os.uname().sysname == "Linux", reason="the BLAS swap is Linux-only")
def test_models_info_reports_the_live_blas(env):
    r = run_cli("models", "info", env=env)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["status"] == "loaded"
    assert report["live"] == report["mlxlab_loaded"]
    assert report["mlxlab_loaded"] in report["mapped_blas_libraries"]
    assert report["default_dtype"] == "mlx.core.float32"


@pytest.mark.parametrize(
    "text", ["def fibonacci(n):", "it's a \\ test, [ok] {x}", "end\\", "a=b c"]
)
def test_free_text_values_need_no_hydra_quoting(env, text):
    r = run_cli("generate", "model=tiny-llama", f"prompt={text}", "--cfg", "job", env=env)
    assert r.returncode == 0, r.stderr
    import yaml

    assert yaml.safe_load(r.stdout)["prompt"] == text
