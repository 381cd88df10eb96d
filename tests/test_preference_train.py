"""DPO and ORPO through the trainer's backward modes: bit-exact across full, checkpointed and
segmented, equal to a straightforward implementation on full logits, the reference being the base
model with the adapter off."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

import mlxlab  # noqa: F401
from mlxlab.data import batches as B
from mlxlab.lora import apply as lora
from mlxlab.models import tiny
from mlxlab.train import backward as bw
from mlxlab.train import objectives as obj
from mlxlab.train import trainer
from tests.helpers.lora_model import lora_model

# two pairs: (tokens after BOS, response offset) of chosen, rejected, chosen, rejected
SHAPES = [(40, 10), (30, 10), (24, 5), (36, 5)]
OBJECTIVES = {
    "dpo": obj.PairObjective("dpo", beta=0.2),
    "ipo": obj.PairObjective("dpo", beta=0.2, dpo_loss="ipo"),
    "orpo": obj.PairObjective("orpo", lam=0.3),
}


def _pairs(family: str):
    model, examples = lora_model(family, SHAPES)
    sampler = B.BatchSampler(examples, 2, 0, shuffle=False, pairs=True)
    batch = next(sampler.one_pass())
    batch = dataclasses.replace(batch, ref=obj.reference_logps(model, batch))
    return model, batch


def _same(got, want):
    assert len(got) == len(want) == 4
    assert got[0].item() == want[0].item() and got[1].item() == want[1].item()
    assert np.array_equal(np.array(got[3]), np.array(want[3]))  # the metrics
    g, r = dict(tree_flatten(got[2])), dict(tree_flatten(want[2]))
    assert g.keys() == r.keys() and r
    for k in r:
        assert np.array_equal(np.array(g[k]), np.array(r[k])), k


@pytest.mark.parametrize("family", tiny.FAMILIES)
@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_pair_gradients_are_bit_exact_across_backward_modes(family, name):
    objective = OBJECTIVES[name]
    model, batch = _pairs(family)
    full = trainer.full_backward(model, objective.loss, compile=False)(model, batch)
    for size in (1, 4):
        plan = bw.plan_by_size(len(model.layers), size)
        _same(bw.segmented_backward(model, plan, objective=objective)(model, batch), full)
    _same(bw.checkpointed_backward(model, objective=objective)(model, batch), full)
    assert np.isfinite(full[0].item()) and any(
        float(np.abs(np.array(g)).max()) > 0 for _, g in tree_flatten(full[2])
    )


def _straightforward(model, batch, objective, ref):
    """Per-token log-probs from the model's own __call__ (full logits, log-softmax, gather),
    summed per sequence with a Python loop, into the published formulas."""
    logits = model(batch.inputs).astype(mx.float32)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    b, t = batch.inputs.shape
    flat = logp.reshape(b * t, -1)
    n = batch.ntoks
    pos, lab = np.array(batch.positions)[:n], np.array(batch.labels)[:n]
    per_row = [[] for _ in range(b)]
    for p, y in zip(pos.tolist(), lab.tolist(), strict=True):
        per_row[p // t].append(flat[p, y])
    sums = mx.stack([mx.stack(r).sum() for r in per_row])
    counts = mx.array([float(len(r)) for r in per_row])
    c, r = slice(0, None, 2), slice(1, None, 2)
    if objective.kind == "orpo":
        m_c, m_r = sums[c] / counts[c], sums[r] / counts[r]
        odds = (m_c - mx.log(1 - mx.exp(m_c))) - (m_r - mx.log(1 - mx.exp(m_r)))
        return -sums[c].sum() / counts[c].sum() - objective.lam * nn.log_sigmoid(odds).mean()
    if objective.dpo_loss == "ipo":
        h = (sums[c] / counts[c] - sums[r] / counts[r]) - (ref[c] / counts[c] - ref[r] / counts[r])
        return ((h - 1 / (2 * objective.beta)) ** 2).mean()
    h = (sums[c] - sums[r]) - (ref[c] - ref[r])
    return -nn.log_sigmoid(objective.beta * h).mean()


@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_pair_loss_and_gradients_match_a_straightforward_implementation(name):
    objective = OBJECTIVES[name]
    model, batch = _pairs("llama")
    loss, _, grads, _ = trainer.full_backward(model, objective.loss, compile=False)(model, batch)

    def plain(params):
        model.update(params)
        return _straightforward(model, batch, objective, batch.ref)

    want, want_grads = mx.value_and_grad(plain)(model.trainable_parameters())
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)
    g, r = dict(tree_flatten(grads)), dict(tree_flatten(want_grads))
    num = sum(float(((g[k] - r[k]) ** 2).sum()) for k in r) ** 0.5
    den = sum(float((r[k] ** 2).sum()) for k in r) ** 0.5
    assert den > 0 and num / den < 1e-4


def test_the_reference_is_the_base_model_bit_for_bit():
    model, batch = _pairs("gemma3")
    base, _, _ = tiny.build("gemma3", seed=0)
    from mlxlab.train.losses import hidden_states

    h = hidden_states(base, batch.inputs)
    want, _ = obj.row_logps(base, h, batch.positions, batch.labels, batch.weights)
    assert np.array_equal(np.array(batch.ref), np.array(want))
    # and the adapter is back on afterwards: the policy differs from the reference
    assert all(m.scale != 0 for _, m in lora.lora_modules(model))
    pi = obj.row_logps(
        model, hidden_states(model, batch.inputs), batch.positions, batch.labels, batch.weights
    )[0]
    assert not np.array_equal(np.array(pi), np.array(want))


def test_dpo_batches_without_a_reference_get_one_first():
    objective = OBJECTIVES["dpo"]
    model, batch = _pairs("qwen2")
    from mlxlab.config import BackwardConfig

    grad_fn, how = bw.make_grad_fn(model, BackwardConfig(mode="full"), (4, 64), False, objective)
    assert "dpo on pairs" in how
    with_ref = grad_fn(model, batch)
    without = grad_fn(model, dataclasses.replace(batch, ref=None))
    assert with_ref[0].item() == without[0].item()
    with pytest.raises(ValueError, match="reference log-probs"):
        bw.segmented_backward(model, bw.plan_by_size(len(model.layers), 2), objective=objective)(
            model, dataclasses.replace(batch, ref=None)
        )


def write_pairs(out_dir, n_train: int = 24, n_valid: int = 6):
    """Preference pairs from the quickstart answers: chosen the real one, rejected the next
    question's answer (a wrong one), in the messages + string shape."""
    import json
    from pathlib import Path

    from tests.helpers.cli import REPO

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    quick = REPO / "mlxlab" / "data" / "quickstart"
    for split, n in (("train", n_train), ("valid", n_valid)):
        rows = [json.loads(x) for x in (quick / f"{split}.jsonl").read_text().splitlines()][: n + 1]
        with (out_dir / f"{split}.jsonl").open("w") as f:
            for a, b in zip(rows, rows[1:], strict=False):
                f.write(
                    json.dumps(
                        {
                            "messages": a["messages"][:-1],
                            "chosen": a["messages"][-1]["content"],
                            "rejected": b["messages"][-1]["content"],
                        }
                    )
                    + "\n"
                )
    return out_dir


def _pair_cfg(tmp_path, objective: str, **kw):
    from mlxlab.config import DataConfig, LoraConfig, OptimConfig
    from mlxlab.train.config import TrainConfig

    base = dict(
        model="tiny-llama",
        out_dir=str(tmp_path / "run"),
        objective=objective,
        iters=6,
        batch_size=2,
        val_every=3,
        save_every=0,
        log_every=1,
        wandb="disabled",
        data=DataConfig(train=str(write_pairs(tmp_path / "pairs")), max_seq_length=128),
        lora=LoraConfig(targets=["q", "v", "down"], rank=4),
        optim=OptimConfig(lr=1e-3, warmup=0),
    )
    base.update(kw)
    return TrainConfig(**base)


def _records(run_dir):
    import json

    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("objective", ["dpo", "orpo"])
def test_preference_training_runs_logs_and_matches_across_backward_modes(
    tiny_dir, tmp_path, objective
):
    from pathlib import Path

    from mlxlab.config import BackwardConfig
    from mlxlab.train.cli import run

    tiny_dir("llama")
    full = run(_pair_cfg(tmp_path / "full", objective))
    seg = run(
        _pair_cfg(
            tmp_path / "seg", objective, backward=BackwardConfig(mode="segmented", segment_size=2)
        )
    )
    run_full, run_seg = Path(full["adapter"]).parent, Path(seg["adapter"]).parent
    steps = [r for r in _records(run_full) if "loss" in r]
    assert len(steps) == 6 and all(k in steps[0] for k in obj.METRICS[objective])
    assert [r["loss"] for r in steps] == [r["loss"] for r in _records(run_seg) if "loss" in r]
    assert (run_full / "adapter" / "adapters.safetensors").read_bytes() == (
        run_seg / "adapter" / "adapters.safetensors"
    ).read_bytes()
    assert any("val_loss" in r for r in _records(run_full))
    if objective == "dpo":
        # before any update the policy is the reference: the margin is 0 and the loss log 2
        assert steps[0]["reward_margin"] == 0.0 and steps[0]["loss"] == pytest.approx(0.693147)
        assert (run_full / "reference_train.json").is_file()
        assert (run_full / "reference_valid.json").is_file()
        later = run(_pair_cfg(tmp_path / "later", objective, dpo=_dpo(precompute_ref=False)))
        assert [r["loss"] for r in _records(Path(later["adapter"]).parent) if "loss" in r] == [
            r["loss"] for r in steps
        ]


def _dpo(**kw):
    from mlxlab.config import DPOConfig

    return DPOConfig(**kw)


def test_preference_config_errors(tmp_path):
    from mlxlab.cli import compose
    from mlxlab.config import DataConfig, UserError
    from mlxlab.train.config import TrainConfig

    with pytest.raises(UserError, match="objective must be one of"):
        TrainConfig(objective="kto")
    with pytest.raises(UserError, match="data.pack is for SFT"):
        TrainConfig(objective="dpo", data=DataConfig(pack=True))
    with pytest.raises(UserError, match="dpo.beta"):
        _dpo(beta=0)
    with pytest.raises(UserError, match="sigmoid only"):
        _dpo(loss="ipo", label_smoothing=0.1)
    assert compose("train", ["objective=orpo", "orpo.lambda=0.5"]).orpo.lam == 0.5


@pytest.mark.slow  # three training subprocesses, one killed
def test_killed_dpo_run_resumes_to_the_same_losses(tiny_dir, session_home, tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    tiny_dir("llama")
    data = write_pairs(tmp_path / "pairs", n_train=40)
    env = {**os.environ, "MLXLAB_HOME": str(session_home)}

    def cmd(out, *extra):
        return [
            sys.executable, "-m", "mlxlab", "train", "model=tiny-llama", "objective=dpo",
            f"out_dir={out}", f"data.train={data}", "data.max_seq_length=128", "iters=120",
            "batch_size=2", "save_every=20", "log_every=1", "val_every=0", "wandb=disabled",
            "lora.rank=4", "lora.dropout=0.1", "optim.lr=1e-3", "backward.mode=segmented",
            "backward.segment_size=2", *extra,
        ]  # fmt: skip

    def losses(out):
        return {r["step"]: r["loss"] for r in _records(out) if "loss" in r}

    ref = subprocess.run(
        cmd(tmp_path / "ref"), env=env, capture_output=True, text=True, timeout=600
    )
    assert ref.returncode == 0, ref.stderr
    out = tmp_path / "killed"
    proc = subprocess.Popen(cmd(out), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline:
        metrics = out / "metrics.jsonl"
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 70:
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert 60 < max(losses(out)) < 120 and not (out / "adapter").exists()
    ref_file = out / "reference_train.json"
    written = ref_file.stat().st_mtime_ns
    resumed = subprocess.run(
        cmd(out, "resume=true"), env=env, capture_output=True, text=True, timeout=600
    )
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stderr
    assert ref_file.stat().st_mtime_ns == written  # read back, not recomputed
    assert losses(out) == losses(tmp_path / "ref")
    assert (out / "adapter" / "adapters.safetensors").read_bytes() == (
        tmp_path / "ref" / "adapter" / "adapters.safetensors"
    ).read_bytes()


def test_memory_harness_takes_preference_modes(tiny_dir):
    from mlxlab.config import UserError
    from mlxlab.diag import memory
    from mlxlab.diag.config import DiagConfig, is_memory_mode

    assert is_memory_mode("dpo-seg4") and is_memory_mode("orpo-full")
    assert not is_memory_mode("dpo-mlx_lm") and not is_memory_mode("kto-full")
    with pytest.raises(UserError, match="memory mode"):
        DiagConfig(action="memory", modes=["dpo-mlx_lm_gc"])
    tiny_dir("llama")
    r = memory.worker("tiny-llama", "dpo-seg2", 64, 1, "auto", 1.6)
    assert r["s_per_step"] > 0 and r["peak_gb"] > 0


def test_saved_reference_log_probs_must_match_the_data(tmp_path):
    import json

    from mlxlab.errors import UserError

    model, examples = lora_model("llama", SHAPES)
    sampler = B.BatchSampler(examples, 2, 0, shuffle=False, pairs=True)
    path = tmp_path / "reference_train.json"
    obj.precompute_reference(model, sampler, path, "tiny-llama")
    first = list(sampler.ref)
    obj.precompute_reference(model, sampler, path, "tiny-llama")  # read back
    assert sampler.ref == first
    other = B.BatchSampler(examples[2:] + examples[:2], 2, 0, shuffle=False, pairs=True)
    with pytest.raises(UserError, match="other data or another model"):
        obj.precompute_reference(model, other, path, "tiny-llama")
    with pytest.raises(UserError, match="other data or another model"):
        obj.precompute_reference(model, sampler, path, "another-model")
    path.write_text("{not json")
    with pytest.raises(UserError, match="not a reference log-prob file"):
        obj.precompute_reference(model, sampler, path, "tiny-llama")
    assert json.loads(json.dumps(first))


def test_dpo_accumulation_equals_one_batch_of_all_pairs(tiny_dir, tmp_path):
    """grad_accum=2 of one pair each is the step of one batch of both pairs (DPO's loss is a mean
    over pairs; accumulation weights micro-batches by pairs), to float rounding."""
    objective = OBJECTIVES["dpo"]
    model, examples = lora_model("llama", SHAPES)
    both = next(B.BatchSampler(examples, 2, 0, shuffle=False, pairs=True).one_pass())
    both = dataclasses.replace(both, ref=obj.reference_logps(model, both))
    singles = []
    for unit in ([0, 1], [2, 3]):
        b = B.collate([examples[i] for i in unit])
        b = dataclasses.replace(b, pairs=True)
        singles.append(dataclasses.replace(b, ref=obj.reference_logps(model, b)))
    grad_fn = trainer.full_backward(model, objective.loss, compile=False)
    loss, _, grads, _ = grad_fn(model, both)
    parts = [grad_fn(model, b) for b in singles]
    assert loss.item() == pytest.approx((parts[0][0].item() + parts[1][0].item()) / 2, rel=1e-5)
    g = dict(tree_flatten(grads))
    acc = {
        k: (dict(tree_flatten(parts[0][2]))[k] + dict(tree_flatten(parts[1][2]))[k]) / 2 for k in g
    }
    num = sum(float(((g[k] - acc[k]) ** 2).sum()) for k in g) ** 0.5
    den = sum(float((acc[k] ** 2).sum()) for k in g) ** 0.5
    assert den > 0 and num / den < 1e-5  # the same step to float rounding (other paddings)


def test_lora_init_starts_from_an_adapter_and_is_dpos_reference(tiny_dir, tmp_path):
    """A DPO run on top of an adapter (lora.init): its first step sees the policy equal to the
    reference, so the margin is 0 and the loss log 2. Neither a policy left at a fresh init nor
    the base as reference would give that: against the base, the starting adapter has a margin
    (checked below, so the test can fail)."""
    from pathlib import Path

    from mlxlab.config import LoraConfig, UserError
    from mlxlab.data.batches import BatchSampler
    from mlxlab.data.datasets import resolve_paths
    from mlxlab.data.preference import load_pair_split
    from mlxlab.lora import io as lora_io
    from mlxlab.models.zoo import load
    from mlxlab.train.cli import run

    tiny_dir("llama")
    first = run(_pair_cfg(tmp_path / "first", "orpo", iters=3, val_every=0))
    lora_cfg = LoraConfig(targets=["q", "v", "down"], rank=4, init=str(Path(first["adapter"])))
    on_top = run(_pair_cfg(tmp_path / "top", "dpo", lora=lora_cfg, iters=2, val_every=2))
    steps = [r for r in _records(Path(on_top["adapter"]).parent) if "loss" in r]
    assert steps[0]["reward_margin"] == 0.0 and steps[0]["loss"] == pytest.approx(0.693147)
    assert on_top["initial_val_loss"] == pytest.approx(0.693147)  # validation's reference too

    model, tokenizer = load("tiny-llama", "float32")
    lora_io.load(model, first["adapter"])
    cfg = _pair_cfg(tmp_path / "probe", "dpo")
    examples = load_pair_split(resolve_paths(cfg.data)[0], tokenizer, cfg.data).examples
    batch = next(BatchSampler(examples, 2, cfg.seed, pairs=True).one_pass())
    policy = obj.reference_logps(model, batch, lora.adapter_parameters(model))
    assert not np.array_equal(np.array(policy), np.array(obj.reference_logps(model, batch)))
    with pytest.raises(UserError, match=r"does not match lora\.\*.*rank 4 here 8"):
        run(_pair_cfg(tmp_path / "bad", "orpo", lora=dataclasses.replace(lora_cfg, rank=8)))
