"""The diagnostics harnesses on tiny models, including proof that each gate can fail."""

from __future__ import annotations

import json

import pytest

import mlxlab  # noqa: F401
from mlxlab.config import LoraConfig
from mlxlab.diag import compare, leak, memory, parity
from mlxlab.diag.config import DiagConfig
from tests.helpers.cli import run_cli

# Netlib's reference BLAS computes every row of a product the same way whatever the matrix shape;
# OpenBLAS's blocked kernels need not (mlx-lm takes the loss over all logits, mlxlab over the
# trained positions only), so bit-exactness with mlx-lm is checked under the reference BLAS.
REFERENCE_BLAS = {"MLXLAB_BLAS": "off"}
INTERNAL = {
    "logits (base)",
    "logits (adapter)",
    "segmented size 1 vs full",
    "segmented size 3 vs full",
    "checkpointed vs full",
}


@pytest.mark.slow  # a CLI subprocess (the BLAS is chosen when mlxlab is imported)
@pytest.mark.parametrize("family", ["llama", "gemma3", "gemma4"])
def test_parity_with_mlx_lm_is_bit_exact_on_tiny_models(tiny_dir, session_home, tmp_path, family):
    tiny_dir(family)
    r = run_cli(
        "diag",
        "parity",
        f"model=tiny-{family}",
        "segment_sizes=[1,3]",
        f"out={tmp_path / 'p'}",
        env={"MLXLAB_HOME": str(session_home), **REFERENCE_BLAS},
    )
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads((tmp_path / "p_parity.json").read_text())
    assert report["passed"], [c for c in report["checks"] if not c["passed"]]
    assert all(c["verdict"] == "BIT-EXACT" for c in report["checks"])
    names = [c["name"] for c in report["checks"]]
    assert {"loss (prompt 0)", "loss (response 1)", "LoRA gradients vs mlx-lm"} | INTERNAL <= set(
        names
    )
    # mlx-lm's padded batches count one pad position per sequence (see parity.py)
    counts = report["token_counts"]["response 1"]
    assert (counts["ours"], counts["mlx_lm_unpadded"], counts["mlx_lm_padded_batch"]) == (1, 1, 2)


@pytest.mark.parametrize("family", ["llama", "gemma3", "gemma4"])
def test_parity_with_mlx_lm_under_the_optimized_blas(tiny_dir, family):
    """In-process, with whatever BLAS is live: mlxlab's own modes agree bit for bit; against mlx-lm
    the loss is within a few ulp and the gradients within 1e-4 relative."""
    tiny_dir(family)
    report = parity.run(
        DiagConfig(model=f"tiny-{family}", segment_sizes=[1, 3], max_ulp=64, max_rel=1e-4),
        verbose=False,
    )
    assert report["passed"], [c for c in report["checks"] if not c["passed"]]
    exact = {c["name"] for c in report["checks"] if c["verdict"] == "BIT-EXACT"}
    assert INTERNAL <= exact, exact


@pytest.mark.parametrize("objective", ["dpo", "orpo"])
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_pair_parity_against_a_straightforward_implementation(tiny_dir, family, objective):
    """DPO / ORPO on one pair: the response log-probs, loss and gradients agree with plain code on
    mlx-lm's model; every backward mode is bit for bit the full one."""
    tiny_dir(family)
    report = parity.run(
        DiagConfig(model=f"tiny-{family}", objective=objective, segment_sizes=[1, 3]),
        verbose=False,
    )
    assert report["passed"], [c for c in report["checks"] if not c["passed"]]
    by_name = {c["name"]: c for c in report["checks"]}
    assert by_name["response log-probs vs plain"]["rel_norm"] < 1e-6
    for name in ("segmented size 1 vs full", "segmented size 3 vs full", "checkpointed vs full"):
        assert by_name[name]["verdict"] == "BIT-EXACT", name
    assert set(report["metrics"]) >= {"pref_accuracy", "logp_chosen", "logp_rejected"}


@pytest.mark.slow  # CLI subprocesses
def test_perturbed_gradients_fail_the_gate(tiny_dir, session_home, tmp_path):
    tiny_dir("llama")
    env = {"MLXLAB_HOME": str(session_home)}
    env = {**env, **REFERENCE_BLAS}
    r = run_cli(
        "diag",
        "parity",
        "model=tiny-llama",
        "segment_sizes=[2]",
        "perturb_grads=1e-3",
        f"out={tmp_path / 'bad'}",
        env=env,
    )
    assert r.returncode == 1
    assert "LoRA gradients vs mlx-lm" in r.stdout and "FAIL" in r.stdout
    report = json.loads((tmp_path / "bad_parity.json").read_text())
    assert not report["passed"]
    r = run_cli(
        "diag", "parity", "model=tiny-llama", "segment_sizes=[2]", f"out={tmp_path / 'ok'}", env=env
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads((tmp_path / "ok_parity.json").read_text())["passed"]


def test_ulp_and_gates():
    import numpy as np

    a = np.array([1.0, -2.0, 0.0], np.float32)
    b = np.nextafter(a, np.float32(10))
    assert compare.ulp_distance(a, b) == 1
    assert compare.ulp_distance(np.float32([-0.0]), np.float32([0.0])) == 0
    c = compare.compare("x", b, a, max_ulp=1, max_rel=None)
    assert c.passed and c.verdict == "within 1 ulp"
    assert not compare.compare("x", b, a, max_ulp=0, max_rel=None).passed
    assert not compare.compare("x", {"a": a}, {"b": a}).passed


def test_leak_harness_passes_and_can_fail(tiny_dir, tmp_path):
    import mlx.core as mx

    tiny_dir("gemma3")
    report = leak.run(
        DiagConfig(action="leak", model="tiny-gemma3", steps=40, warmup=10), verbose=False
    )
    assert report["passed"] and abs(report["slope_mb_per_step"]) < 0.01

    from mlxlab.data.batches import collate
    from mlxlab.data.datasets import Example
    from mlxlab.lora import apply as lora
    from mlxlab.models.zoo import load
    from mlxlab.train.trainer import full_backward

    model, _ = load("tiny-gemma3")
    lora.apply(model, lora.plan(model, LoraConfig()), seed=0)
    full = full_backward(model, compile=False)
    kept = []

    def leaky(model_, batch):  # keeps 2 MB alive per step, like a surrogate graph would
        kept.append(mx.zeros((512, 1024), mx.float32) + len(kept))
        mx.eval(kept[-1])
        return full(model_, batch)

    active, _ = leak.record_memory(model, leaky, collate([Example(list(range(2, 40)), 10)]), 30)
    assert leak.growth_mb_per_step(active, 5) > 1.0


@pytest.mark.slow  # one subprocess per mode
def test_memory_sweep_runs_each_mode_in_its_own_process(tiny_dir, tmp_path):
    tiny_dir("llama")
    report = memory.sweep(
        "tiny-llama",
        [64],
        ["full", "seg2", "checkpoint", "mlx_lm", "mlx_lm_gc"],
        progress=lambda _: None,
    )
    rows = report["results"]
    assert all("peak_gb" in rows[m]["64"] for m in rows), rows
    assert "full" in memory.table(report)
    assert memory.plot(report, tmp_path / "m.png").stat().st_size > 1000
    with pytest.raises(Exception, match="unknown memory mode"):
        memory.sweep("tiny-llama", [64], ["nope"])


@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_decode_profile_splits_a_step_into_its_op_groups(tiny_dir, family):
    from mlxlab.diag import decode
    from mlxlab.models.zoo import load

    model, _ = load(str(tiny_dir(family)))
    before = [type(m) for _, m in model.named_modules()]
    report = decode.profile(model, list(range(5, 37)), steps=3)
    assert [type(m) for _, m in model.named_modules()] == before  # the wrappers are gone
    groups = report["groups"]
    assert set(groups) == set(decode.GROUPS)
    for name in (
        "attn projections",
        "mlp projections",
        "lm head",
        "norms",
        "attention (cache, sdpa)",
    ):
        assert groups[name]["ms"] > 0, name
    # Bytes: every weight once (a tied head is the embedding), plus the K/V of 32 tokens.
    from mlx.utils import tree_flatten

    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    assert weights <= report["bytes_read_mb"] * 1e6 <= weights * 1.5
    assert groups["attention (cache, sdpa)"]["mb"] > 0
    assert report["step_ms"] > 0 and report["tok_per_s"] > 0


def test_decode_diag_reports_a_table_and_the_bound(tiny_dir, tmp_path):
    from mlxlab.diag import decode

    tiny_dir("gemma3")
    report = decode.run(DiagConfig(action="decode", model="tiny-gemma3", length=16, decode_steps=2))
    assert report["bandwidth"]["all_threads_gbps"] > 0
    assert 0 < report["fraction_of_bound"] and report["bound_ms"] > 0
    text = decode.table(report)
    assert "lm head" in text and "of the bound" in text


def test_decode_steps_must_be_positive():
    from mlxlab.errors import UserError

    with pytest.raises(UserError, match="decode_steps"):
        DiagConfig(action="decode", decode_steps=0)


@pytest.mark.parametrize("mode", ["segmented", "full"])
def test_training_profile_splits_a_step_into_phases(tiny_dir, mode):
    from mlxlab.diag import profile

    tiny_dir("gemma3")
    report = profile.run(
        DiagConfig(action="profile", model="tiny-gemma3", length=48, mode=mode, segment_size=2)
    )
    names = [r["phase"] for r in report["phases"]]
    assert names[-1] == "optimizer" and "loss head" in " ".join(names)
    if mode == "segmented":
        assert names[0] == "embed"
        assert {"segment 0 [0-1] forward", "segment 0 [0-1] vjp"} <= set(names)
        # the phases are the step's own evaluation points: they add up to (about) the step
        total = sum(r["seconds"] for r in report["phases"])
        assert 0.5 * report["step_s"] < total < 1.5 * report["step_s"]
    assert sum(r["share"] for r in report["phases"] if not r.get("part_of_above")) == pytest.approx(
        1
    )
    assert report["step_tflop"] > 0 and 0 < report["mfu"]
    inside = report["inside_layer"]
    assert set(inside) == {"layer 0 (sliding)", "layer 2 (global)"}
    parts = {r["part"] for r in inside["layer 0 (sliding)"]}
    assert parts == {"attention", "MLP", "norms, residual, other", "layer"}
    assert "MFU" in profile.table(report)


@pytest.mark.slow  # a CLI subprocess
def test_profile_cli_writes_report_and_png(tiny_dir, session_home, tmp_path):
    tiny_dir("llama")
    r = run_cli(
        "diag",
        "profile",
        "model=tiny-llama",
        "length=32",
        f"out={tmp_path / 'p'}",
        env={"MLXLAB_HOME": str(session_home)},
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "optimizer" in r.stdout
    assert (tmp_path / "p_profile.json").exists() and (tmp_path / "p_profile.png").exists()


def test_decode_diag_profiles_speculation(tiny_dir):
    from mlxlab.diag import decode
    from mlxlab.diag.config import DiagConfig

    tiny_dir("gemma3")
    cfg = DiagConfig(
        action="decode", model="tiny-gemma3", length=16, decode_steps=2, speculative="prompt_lookup"
    )
    report = decode.run(cfg)
    s = report["speculative"]
    assert set(s["verify_over_plain"]) >= {"1", "8"}
    v = s["verify_logits"]
    assert v["positions"] > 0 and v["disagreements"] - v["near_ties"] == 0
    assert s["repeat_text"]["same_tokens"] and s["repeat_text"]["drafted_tokens"] > 0
    assert "verify step" in decode.table(report)
