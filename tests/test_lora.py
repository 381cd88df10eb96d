"""LoRA: targets by name, adapter I/O in mlx-lm's layout both ways, validation, remove and fuse."""

from __future__ import annotations

import json

import numpy as np
import pytest

import mlxlab  # noqa: F401
from mlxlab.config import LoraConfig, UserError
from mlxlab.lora import apply as lora
from mlxlab.lora import io as lora_io

TEXT = "Errors should never pass silently."


def _logits(model, tokenizer):
    import mlx.core as mx

    return np.array(model(mx.array(tokenizer.encode(TEXT))[None]))


def _randomize_b(model, seed=0):
    """Give every B a non-zero value so the adapter changes the output."""
    import mlx.core as mx

    mx.random.seed(seed)
    for _, m in lora.lora_modules(model):
        m.lora_b = 0.05 * mx.random.normal(m.lora_b.shape)
    mx.eval(model.parameters())


def _adapted(tiny_dir, family, cfg, seed=0):
    from mlx_lm.utils import load

    model, tokenizer = load(str(tiny_dir(family)))
    plan = lora.plan(model, cfg)
    lora.apply(model, plan, seed=seed)
    _randomize_b(model, seed)
    return model, tokenizer, plan


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3", "gemma4"])
@pytest.mark.parametrize("layers", ["all", 2, [0, 2]])
def test_mlxlab_adapter_loads_in_mlx_lm_with_the_same_logits(tiny_dir, tmp_path, family, layers):
    from mlx_lm.utils import load

    # Gemma 4's last two layers share K/V and have no v_proj: a v target there would be an error.
    targets = ["q", "down"] if (family, layers) == ("gemma4", 2) else ["q", "v", "down"]
    cfg = LoraConfig(targets=targets, layers=layers, rank=4)
    model, tokenizer, plan = _adapted(tiny_dir, family, cfg)
    lora_io.save(model, plan, tmp_path / "adapter", meta={"base_model": f"tiny-{family}"})
    ours = _logits(model, tokenizer)

    theirs_model, _ = load(str(tiny_dir(family)), adapter_path=str(tmp_path / "adapter"))
    np.testing.assert_array_equal(_logits(theirs_model, tokenizer), ours)

    again, _ = load(str(tiny_dir(family)))
    lora_io.load(again, tmp_path / "adapter")
    np.testing.assert_array_equal(_logits(again, tokenizer), ours)


def test_mlx_lm_adapter_loads_in_mlxlab_with_the_same_logits(tiny_dir, tmp_path):
    """An adapter as mlx_lm.lora writes it (keys omitted: mlx-lm's default of every linear)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load

    theirs, tokenizer = load(str(tiny_dir("qwen3")))
    theirs.freeze()
    linear_to_lora_layers(theirs, 3, {"rank": 4, "scale": 10.0, "dropout": 0.0})
    _randomize_b(theirs, seed=1)
    out = tmp_path / "mlx_lm_adapter"
    out.mkdir()
    mx.save_safetensors(
        str(out / "adapters.safetensors"), dict(tree_flatten(theirs.trainable_parameters()))
    )
    (out / "adapter_config.json").write_text(
        json.dumps(
            {
                "fine_tune_type": "lora",
                "num_layers": 3,
                "model": "whatever",
                "lora_parameters": {"rank": 4, "scale": 10.0, "dropout": 0.0},
            }
        )
    )
    ours, _ = load(str(tiny_dir("qwen3")))
    plan = lora_io.load(ours, out)
    assert plan.layers == (1, 2, 3)
    np.testing.assert_array_equal(_logits(ours, tokenizer), _logits(theirs, tokenizer))


def test_targets_by_short_name_and_path(tiny_dir):
    from mlx_lm.utils import load

    model, _ = load(str(tiny_dir("llama")))
    plan = lora.plan(model, LoraConfig(targets=["q", "mlp.up_proj"], layers=1))
    assert plan.keys == ("mlp.up_proj", "self_attn.q_proj") and plan.layers == (3,)
    with pytest.raises(UserError, match=r"\['qq'\] match no module"):
        lora.plan(model, LoraConfig(targets=["q", "qq"]))
    with pytest.raises(UserError, match="the model has 4 layers"):
        lora.plan(model, LoraConfig(layers=9))
    with pytest.raises(UserError, match="indices must be in 0..3"):
        lora.plan(model, LoraConfig(layers=[1, 7]))


def test_only_adapters_train(tiny_dir):
    from mlx.utils import tree_flatten

    model, _, _ = _adapted(tiny_dir, "llama", LoraConfig(targets=["q", "v"], layers=2))
    names = [k for k, _ in tree_flatten(model.trainable_parameters())]
    assert names and all(k.endswith(("lora_a", "lora_b")) for k in names)
    assert len(names) == 2 * 2 * 2


def test_remove_restores_the_base_and_fuse_bakes_the_adapter(tiny_dir, tmp_path):
    from mlx_lm.utils import load

    base_model, tokenizer = load(str(tiny_dir("gemma3")))
    base = _logits(base_model, tokenizer)
    model, _, _ = _adapted(tiny_dir, "gemma3", LoraConfig(targets=["q", "o", "gate"]))
    adapted = _logits(model, tokenizer)
    assert np.abs(adapted - base).max() > 1e-3
    lora.fuse(model)
    assert not lora.lora_modules(model)
    np.testing.assert_allclose(_logits(model, tokenizer), adapted, atol=1e-4)

    model2, _, _ = _adapted(tiny_dir, "gemma3", LoraConfig(targets=["q"]))
    lora.remove(model2)
    np.testing.assert_array_equal(_logits(model2, tokenizer), base)


def test_every_problem_is_reported_at_once(tiny_dir, tmp_path):
    import mlx.core as mx
    from mlx_lm.utils import load

    model, _, plan = _adapted(tiny_dir, "llama", LoraConfig(targets=["q", "v"], rank=4))
    lora_io.save(model, plan, tmp_path / "a")
    weights = mx.load(str(tmp_path / "a" / "adapters.safetensors"))
    weights["model.layers.0.self_attn.q_proj.lora_a"] = mx.zeros((3, 3))
    weights["model.layers.0.self_attn.nope.lora_a"] = mx.zeros((3, 3))
    mx.save_safetensors(str(tmp_path / "a" / "adapters.safetensors"), weights)
    fresh, _ = load(str(tiny_dir("llama")))
    with pytest.raises(UserError) as err:
        lora_io.load(fresh, tmp_path / "a")
    msg = str(err.value)
    assert "q_proj.lora_a: shape (3, 3)" in msg and "nope.lora_a: not an adapter parameter" in msg
    assert not lora.lora_modules(fresh)  # nothing attached

    wrong_base, _ = load(str(tiny_dir("gemma3")))  # 6 layers, other widths
    with pytest.raises(lora_io.BaseMismatch, match="does not fit the model"):
        lora_io.load(wrong_base, tmp_path / "a")
    with pytest.raises(UserError) as err:  # wrong shapes on its own base: not another base's
        lora_io.load(fresh, tmp_path / "a")
    assert not isinstance(err.value, lora_io.BaseMismatch)

    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "adapter_config.json").write_text("{not json")
    with pytest.raises(UserError, match="not readable JSON.*missing adapters.safetensors"):
        lora_io.load(fresh, tmp_path / "b")
    with pytest.raises(UserError, match="not a directory"):
        lora_io.load(fresh, tmp_path / "missing")


def test_saving_over_an_adapter_replaces_files_atomically(tiny_dir, tmp_path):
    model, _, plan = _adapted(tiny_dir, "llama", LoraConfig(targets=["q"]))
    out = lora_io.save(model, plan, tmp_path / "a")
    first = (out / "adapters.safetensors").read_bytes()
    _randomize_b(model, seed=9)
    lora_io.save(model, plan, out)
    assert (out / "adapters.safetensors").read_bytes() != first
    assert sorted(p.name for p in out.iterdir()) == [
        "adapter_config.json",
        "adapters.safetensors",
        "mlxlab_adapter.json",
    ]


@pytest.mark.slow  # CLI subprocesses
def test_cli_check_and_fuse(tiny_dir, session_home, tmp_path):
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load

    from tests.helpers.cli import run_cli

    model, tokenizer, plan = _adapted(tiny_dir, "llama", LoraConfig(targets=["q", "up"], rank=4))
    lora_io.save(model, plan, tmp_path / "adapter")
    expected = _logits(model, tokenizer)
    env = {"MLXLAB_HOME": str(session_home)}

    r = run_cli("lora", "check", "model=tiny-llama", f"adapter={tmp_path / 'adapter'}", env=env)
    assert r.returncode == 0, r.stderr
    assert "ok: 16 tensors, rank 4" in r.stdout
    r = run_cli("lora", "check", "model=tiny-gemma3", f"adapter={tmp_path / 'adapter'}", env=env)
    assert r.returncode == 1 and "does not fit the model" in r.stderr

    r = run_cli(
        "lora",
        "fuse",
        "model=tiny-llama",
        f"adapter={tmp_path / 'adapter'}",
        f"out={tmp_path / 'fused'}",
        "dtype=float32",
        env=env,
    )
    assert r.returncode == 0, r.stderr
    fused, _ = load(str(tmp_path / "fused"))
    np.testing.assert_allclose(_logits(fused, tokenizer), expected, atol=1e-4)
    assert not [n for n, _ in tree_flatten(fused.parameters()) if "lora" in n]
    r = run_cli(
        "generate", "model=tiny-llama", f"adapter={tmp_path / 'adapter'}", "max_tokens=3", env=env
    )
    assert r.returncode == 0, r.stderr


@pytest.mark.slow  # an `mlx_lm lora` subprocess
def test_adapter_trained_by_mlx_lm_lora_loads_in_mlxlab(tiny_dir, tmp_path):
    """A real `mlx_lm lora` run (2 steps on the tiny model), loaded both ways: same logits."""
    import subprocess
    import sys

    from mlx_lm.utils import load

    from tests.helpers.cli import REPO

    out = tmp_path / "mlx_lm_adapter"
    cmd = [
        sys.executable,
        "-m",
        "mlx_lm",
        "lora",
        "--model",
        str(tiny_dir("qwen3")),
        "--train",
        "--data",
        str(REPO / "mlxlab" / "data" / "quickstart"),
        "--iters",
        "3",
        "--batch-size",
        "2",
        "--num-layers",
        "2",
        "--learning-rate",
        "1e-2",
        "--max-seq-length",
        "96",
        "--adapter-path",
        str(out),
        "--val-batches",
        "1",
        "--steps-per-eval",
        "100",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    theirs, tokenizer = load(str(tiny_dir("qwen3")), adapter_path=str(out))
    ours, _ = load(str(tiny_dir("qwen3")))
    plan = lora_io.load(ours, out)
    assert plan.layers == (2, 3)
    np.testing.assert_array_equal(_logits(ours, tokenizer), _logits(theirs, tokenizer))
    base, _ = load(str(tiny_dir("qwen3")))
    assert np.abs(_logits(base, tokenizer) - _logits(ours, tokenizer)).max() > 1e-4  # it trained
