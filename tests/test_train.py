"""Training: response-only loss = masked full loss, determinism, NaN guard, kill-and-resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import mlxlab  # noqa: F401
from mlxlab import kernels
from mlxlab.config import DataConfig, LoraConfig, OptimConfig, UserError
from mlxlab.data import batches as B
from mlxlab.data import datasets as D
from mlxlab.models import tiny
from mlxlab.train import losses
from mlxlab.train.config import TrainConfig
from tests.helpers.training import QUICKSTART, examples, run_losses


@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_head_of_hidden_states_is_the_model_output(family):
    import mlx.core as mx

    model, tok, _ = tiny.build(family)
    ids = mx.array(tok.encode("Flat is better than nested."))[None]
    full = model(ids)
    with kernels.off("train"):  # mlx-lm's own layers (the kernels': tests/test_fastlayers.py)
        split = losses.lm_head(model, losses.hidden_states(model, ids))
    assert mx.array_equal(full, split).item()


@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_response_ce_equals_masked_full_ce(family):

    model, tok, _ = tiny.build(family)
    batch = B.collate(examples([(40, 10), (17, 0), (60, 59), (25, 1)]))
    loss, ntoks = losses.response_ce(model, *batch.arrays())
    targets, mask = B.dense_targets(batch)
    ref_loss, ref_ntoks = losses.masked_ce(model, batch.inputs, targets, mask)
    assert ntoks.item() == ref_ntoks.item() == 31 + 17 + 2 + 25  # len - max(offset, 1) each
    np.testing.assert_allclose(loss.item(), ref_loss.item(), rtol=1e-6)


def _cfg(tmp_path: Path, **kw) -> TrainConfig:
    base = dict(
        model="tiny-llama",
        out_dir=str(tmp_path / "run"),
        iters=6,
        batch_size=4,
        val_every=3,
        save_every=2,
        keep_last=2,
        log_every=1,
        wandb="disabled",
        seed=3,
        data=DataConfig(train=str(QUICKSTART), max_seq_length=96),
        lora=LoraConfig(targets=["q", "v", "down"], rank=4, dropout=0.1),
        optim=OptimConfig(lr=1e-3, warmup=2),
    )
    base.update(kw)
    return TrainConfig(**base)


def test_same_seed_gives_identical_losses_and_adapters(tiny_dir, tmp_path):
    from mlxlab.train.cli import run

    tiny_dir("llama")
    a = run(_cfg(tmp_path / "a"))
    b = run(_cfg(tmp_path / "b"))
    run_a, run_b = Path(a["adapter"]).parent, Path(b["adapter"]).parent
    assert run_losses(run_a) == run_losses(run_b) and len(run_losses(run_a)) == 6
    assert (run_a / "adapter" / "adapters.safetensors").read_bytes() == (
        run_b / "adapter" / "adapters.safetensors"
    ).read_bytes()
    assert sorted(p.name for p in (run_a / "checkpoints").iterdir()) == [
        "step_0000002",
        "step_0000004",
    ]
    assert {"adapter", "checkpoints", "config.yaml", "metrics.jsonl", "summary.json"} <= {
        p.name for p in run_a.iterdir()
    }
    c = run(_cfg(tmp_path / "c", seed=4))
    assert run_losses(Path(c["adapter"]).parent) != run_losses(run_a)


def test_training_lowers_the_loss_and_the_adapter_loads_in_mlx_lm(tiny_dir, tmp_path):
    import mlx.core as mx
    from mlx_lm.utils import load

    from mlxlab.lora import io as lora_io
    from mlxlab.train.cli import run

    tiny_dir("qwen3")
    s = run(
        _cfg(
            tmp_path,
            model="tiny-qwen3",
            iters=30,
            val_every=30,
            save_every=0,
            optim=OptimConfig(lr=3e-3),
        )
    )
    assert s["val_loss"] < s["initial_val_loss"] - 0.5
    theirs, tok = load(str(tiny_dir("qwen3")), adapter_path=s["adapter"])
    ours, _ = load(str(tiny_dir("qwen3")))
    lora_io.load(ours, s["adapter"])
    ids = mx.array(tok.encode("What does `json.dumps` do?"))[None]
    assert mx.array_equal(theirs(ids), ours(ids)).item()


def test_nan_loss_stops_without_touching_the_last_adapter(tiny_dir, tmp_path):
    import mlx.core as mx

    from mlxlab.lora import apply as lora_apply
    from mlxlab.models.zoo import load
    from mlxlab.train import checkpoint, trainer

    cfg = _cfg(tmp_path, iters=8, save_every=2)
    model, tokenizer = load("tiny-llama")
    plan = lora_apply.plan(model, cfg.lora)
    lora_apply.apply(model, plan, seed=0)
    split = D.load_split(QUICKSTART / "train.jsonl", tokenizer, cfg.data)
    sampler = B.BatchSampler(split.examples, 4, 0)
    full = trainer.full_backward(model)
    calls = {"n": 0}

    def poisoned(model, batch):
        calls["n"] += 1
        loss, ntoks, grads = full(model, batch)
        return (loss * mx.nan if calls["n"] == 5 else loss), ntoks, grads

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with pytest.raises(trainer.TrainingDiverged, match="at step 5"):
        trainer.train(model, plan, sampler, None, cfg, run_dir, grad_fn=poisoned)
    ckpts = checkpoint.checkpoints(run_dir)
    assert [p.name for p in ckpts] == ["step_0000002", "step_0000004"]
    saved = mx.load(str(ckpts[-1] / "adapters.safetensors"))
    assert all(bool(mx.all(mx.isfinite(v)).item()) for v in saved.values())
    assert all(
        bool(mx.all(mx.isfinite(v)).item()) for v in lora_apply.adapter_parameters(model).values()
    )  # no NaN update applied


def _train_cmd(out_dir: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "mlxlab",
        "train",
        "model=tiny-llama",
        f"out_dir={out_dir}",
        f"data.train={QUICKSTART}",
        "data.max_seq_length=96",
        "iters=240",
        "batch_size=4",
        "save_every=20",
        "keep_last=3",
        "log_every=1",
        "val_every=0",
        "wandb=disabled",
        "lora.rank=4",
        "lora.dropout=0.1",
        "optim.lr=1e-3",
        "optim.warmup=10",
        "grad_accum=2",
        *extra,
    ]


@pytest.mark.slow  # three training subprocesses, one killed
def test_killed_run_resumes_to_the_same_losses(tiny_dir, session_home, tmp_path):
    """SIGKILL mid-run, resume, and match an uninterrupted run step for step."""
    tiny_dir("llama")
    env = {**os.environ, "MLXLAB_HOME": str(session_home)}
    ref = subprocess.run(
        _train_cmd(tmp_path / "ref"),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert ref.returncode == 0, ref.stderr

    out = tmp_path / "killed"
    proc = subprocess.Popen(
        _train_cmd(out), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp_path
    )
    deadline = time.time() + 300
    while time.time() < deadline:
        metrics = out / "metrics.jsonl"
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 130:
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = max(run_losses(out))
    assert 120 < killed_at < 240, killed_at  # really killed mid-run
    assert not (out / "adapter").exists()

    resumed = subprocess.run(
        _train_cmd(out, "resume=true"),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stderr
    assert run_losses(out) == run_losses(tmp_path / "ref")
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps))  # the records after the checkpoint were dropped, not doubled
    assert (out / "adapter" / "adapters.safetensors").read_bytes() == (
        tmp_path / "ref" / "adapter" / "adapters.safetensors"
    ).read_bytes()


def test_resume_before_the_first_checkpoint_starts_over(tiny_dir, tmp_path):
    """A run killed before its first checkpoint (config.yaml written, no checkpoint): resume=true
    trains it from step 0, to the same losses."""
    import shutil

    from mlxlab.train.cli import run

    tiny_dir("llama")
    first = run(_cfg(tmp_path, iters=3, save_every=0))
    run_dir = Path(first["adapter"]).parent
    want = run_losses(run_dir)
    shutil.rmtree(run_dir / "adapter")
    again = run(_cfg(tmp_path, iters=3, save_every=0, resume=True))
    assert run_losses(Path(again["adapter"]).parent) == want
    steps = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps))  # the first attempt's records were dropped, not doubled


def _state(run_dir: Path, step: int) -> dict:
    return json.loads(
        (run_dir / "checkpoints" / f"step_{step:07d}" / "trainer_state.json").read_text()
    )


def test_a_resumed_run_reports_the_whole_runs_time_and_memory(tiny_dir, tmp_path):
    """A checkpoint records the training seconds and peak memory so far; a resumed run adds its
    own seconds to them and keeps the larger peak, even one with no step left to train (it went
    straight to its end: before, its summary said 0 s and 0 GB)."""
    from mlxlab.train.cli import run

    tiny_dir("llama")
    first = run(_cfg(tmp_path, iters=4, save_every=2, val_every=0))
    run_dir = Path(first["adapter"]).parent
    assert "resumed_from_step" not in first
    ckpt = _state(run_dir, 2)
    assert 0 < ckpt["seconds"] < first["seconds"]
    assert 0 < ckpt["peak_mem_gb"] <= first["peak_mem_gb"]

    same = run(_cfg(tmp_path, iters=2, save_every=2, val_every=0, resume=True))
    assert same["start_step"] == same["resumed_from_step"] == 2
    assert ckpt["seconds"] <= same["seconds"] < ckpt["seconds"] + 0.5
    assert same["seconds"] == pytest.approx(ckpt["seconds"] + same["resumed_seconds"])
    assert same["peak_mem_gb"] >= ckpt["peak_mem_gb"] > 0

    more = run(_cfg(tmp_path, iters=6, save_every=2, val_every=0, resume=True))
    assert more["resumed_from_step"] == 2 and more["resumed_seconds"] > 0
    assert more["seconds"] == pytest.approx(ckpt["seconds"] + more["resumed_seconds"])
    assert more["peak_mem_gb"] == max(ckpt["peak_mem_gb"], more["resumed_peak_mem_gb"])
    later = _state(run_dir, 4)  # written by the resumed attempt: both attempts' seconds
    assert ckpt["seconds"] < later["seconds"] < more["seconds"]
    assert json.loads((run_dir / "summary.json").read_text())["seconds"] == more["seconds"]


def test_a_checkpoint_without_totals_takes_them_from_the_metrics(tiny_dir, tmp_path):
    """A checkpoint written before the totals were recorded: the seconds are the logged
    `elapsed_s` (each attempt's clock added up), the peak the largest logged; a run whose
    metrics do not tell either reports them unknown (None)."""
    from mlxlab.train.checkpoint import logged_totals
    from mlxlab.train.cli import run

    tiny_dir("llama")
    first = run(_cfg(tmp_path, iters=4, save_every=2, val_every=0))
    run_dir = Path(first["adapter"]).parent
    path = run_dir / "checkpoints" / "step_0000002" / "trainer_state.json"
    old = {
        k: v for k, v in json.loads(path.read_text()).items() if k not in ("seconds", "peak_mem_gb")
    }
    path.write_text(json.dumps(old))
    logged = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    at2 = next(r for r in logged if r["step"] == 2)
    peak = max(r["peak_mem_gb"] for r in logged if r["step"] <= 2)
    same = run(_cfg(tmp_path, iters=2, save_every=2, val_every=0, resume=True))
    assert same["seconds"] == pytest.approx(at2["elapsed_s"] + same["resumed_seconds"])
    assert same["peak_mem_gb"] == max(peak, same["resumed_peak_mem_gb"])

    metrics = tmp_path / "m.jsonl"  # two attempts: the second's clock restarts
    rows = [{"step": 0, "val_loss": 2.0}, {"step": 1, "elapsed_s": 3.0, "peak_mem_gb": 1.5}]
    rows += [{"step": 2, "elapsed_s": 5.0}, {"step": 3, "elapsed_s": 1.0, "peak_mem_gb": 1.0}]
    rows += [{"step": 4, "elapsed_s": 2.5}, {"step": 5, "elapsed_s": 9.0, "peak_mem_gb": 7.0}]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert logged_totals(metrics, 4) == (7.5, 1.5)
    metrics.write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    assert logged_totals(metrics, 4) == (None, None)
    assert logged_totals(tmp_path / "none.jsonl", 4) == (None, None)

    path.write_text(json.dumps(old))
    (run_dir / "metrics.jsonl").write_text("")
    unknown = run(_cfg(tmp_path, iters=2, save_every=2, val_every=0, resume=True))
    assert unknown["seconds"] is None and unknown["peak_mem_gb"] is None
    assert unknown["resumed_seconds"] > 0


def test_resume_refuses_a_different_run(tiny_dir, session_home, tmp_path):
    from mlxlab.train.cli import run

    tiny_dir("llama")
    run(_cfg(tmp_path, iters=2, save_every=1))
    with pytest.raises(UserError, match="different config.*lora"):
        run(_cfg(tmp_path, iters=4, resume=True, lora=LoraConfig(rank=8)))
    with pytest.raises(UserError, match="not empty"):
        run(_cfg(tmp_path, iters=2))
    s = run(_cfg(tmp_path, iters=4, resume=True))  # more iterations of the same run is fine
    assert s["start_step"] == 1
    (tmp_path / "a_file").write_text("")
    with pytest.raises(UserError, match="is a file"):
        run(_cfg(tmp_path, iters=2, out_dir=str(tmp_path / "a_file")))


def test_a_timestamped_run_resumes_by_its_directory(tiny_dir, monkeypatch, tmp_path):
    """A run started without out_dir (outputs/<name>/<time>) saved out_dir: null; resuming it
    names the directory, which is where the run is, not a different run. Settings added since a
    run was written (missing from its config.yaml) take their defaults."""
    from mlxlab.train.cli import run

    tiny_dir("llama")
    monkeypatch.chdir(tmp_path)
    first = run(_cfg(tmp_path, iters=2, save_every=1, out_dir=None))
    run_dir = Path(first["adapter"]).parent
    assert run_dir.parent.parent == tmp_path / "outputs"
    import yaml

    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    del saved["lora"]["init"], saved["backward"]["pipeline"], saved["dist"]  # an older run's
    (run_dir / "config.yaml").write_text(yaml.safe_dump(saved))
    again = run(_cfg(tmp_path, iters=3, resume=True, out_dir=str(run_dir)))
    assert again["start_step"] == 1  # from its checkpoint, as any resumed run
    assert again["initial_val_loss"] == first["initial_val_loss"]  # read back from metrics.jsonl


def test_unknown_optimizer_is_a_clean_error():
    from mlxlab.train.trainer import make_optimizer

    with pytest.raises(UserError, match="unknown optimizer 'adamz'.*adamw"):
        make_optimizer(OptimConfig(name="adamz"), 10)
    assert type(make_optimizer(OptimConfig(name="lion", weight_decay=0.1), 10)).__name__ == "Lion"


def test_compiled_and_eager_steps_agree(tiny_dir, tmp_path):
    from mlxlab.train.cli import run

    tiny_dir("gemma3")
    a = run(_cfg(tmp_path / "c", model="tiny-gemma3", compile=True, save_every=0))
    b = run(_cfg(tmp_path / "e", model="tiny-gemma3", compile=False, save_every=0))
    la, lb = run_losses(Path(a["adapter"]).parent), run_losses(Path(b["adapter"]).parent)
    assert la.keys() == lb.keys()
    np.testing.assert_allclose([la[k] for k in la], [lb[k] for k in la], rtol=1e-5)


def test_wandb_offline_logs_without_network(tiny_dir, tmp_path):
    from mlxlab.train.cli import run

    tiny_dir("llama")
    s = run(_cfg(tmp_path, iters=2, save_every=0, wandb="offline"))
    run_dir = Path(s["adapter"]).parent
    assert list((run_dir / "wandb").glob("offline-run-*"))


def test_segmented_training_follows_the_full_backward_exactly(tiny_dir, tmp_path):
    from mlxlab.config import BackwardConfig
    from mlxlab.train.cli import run

    tiny_dir("gemma3")
    # No dropout: the modes draw their masks differently (segmented and checkpointed seed each
    # segment/layer so recomputation sees the same masks), so only dropout-free runs can match.
    kw = dict(
        model="tiny-gemma3",
        compile=False,
        save_every=0,
        iters=4,
        val_every=0,
        lora=LoraConfig(targets=["q", "v", "down"], rank=4, dropout=0.0),
    )
    full = run(_cfg(tmp_path / "full", **kw))
    seg = run(
        _cfg(tmp_path / "seg", backward=BackwardConfig(mode="segmented", segment_size=4), **kw)
    )
    ckpt = run(_cfg(tmp_path / "ckpt", backward=BackwardConfig(mode="checkpoint"), **kw))
    losses = [run_losses(Path(s["adapter"]).parent) for s in (full, seg, ckpt)]
    assert losses[0] == losses[1] == losses[2]
    blobs = [(Path(s["adapter"]) / "adapters.safetensors").read_bytes() for s in (full, seg, ckpt)]
    assert blobs[0] == blobs[1] == blobs[2]


def test_a_long_validation_pass_logs_that_it_is_alive(tiny_dir, monkeypatch, caplog):
    """With the heartbeat at 0 every validation batch logs a line; the loss is the same."""
    import logging

    from mlx_lm.utils import load

    from mlxlab.data.batches import BatchSampler
    from mlxlab.data.datasets import Example
    from mlxlab.train import trainer

    model, _ = load(str(tiny_dir("llama")))
    examples = [Example(list(range(3, 3 + n)), 2) for n in (6, 8, 10, 12)]
    quiet = trainer.evaluate(model, BatchSampler(examples, 2, 0, shuffle=False))
    monkeypatch.setattr(trainer, "VALIDATION_HEARTBEAT_S", 0.0)
    with caplog.at_level(logging.INFO, logger="mlxlab.train.trainer"):
        loud = trainer.evaluate(model, BatchSampler(examples, 2, 0, shuffle=False))
    assert loud == quiet
    assert [r.getMessage() for r in caplog.records] == [
        "validation: 1 batches",
        "validation: 2 batches",
    ]
