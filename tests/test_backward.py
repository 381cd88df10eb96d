"""Segmented and checkpointed backward give the full backward's gradients; memory stays flat."""

from __future__ import annotations

import numpy as np
import pytest
from mlx.utils import tree_flatten

import mlxlab  # noqa: F401
from mlxlab.config import BackwardConfig, LoraConfig, UserError
from mlxlab.data import batches as B
from mlxlab.data import datasets as D
from mlxlab.lora import apply as lora
from mlxlab.models import runners, tiny
from mlxlab.train import backward as bw
from mlxlab.train import trainer
from tests.helpers.lora_model import lora_model
from tests.helpers.training import assert_same


def _setup(family, seed=0):
    # 40 > the tiny sliding window (16): sliding layers get real window masks.
    model, examples = lora_model(family, [(40, 10), (30, 3), (12, 0)], seed)
    return model, B.collate(examples)


@pytest.mark.parametrize("family", tiny.FAMILIES)
@pytest.mark.parametrize("size", [1, 2, 4, 5])  # 5: an uneven cut (4 or 6 layers)
def test_segmented_gradients_are_bit_exact(family, size):
    model, batch = _setup(family)
    ref = trainer.full_backward(model, compile=False)(model, batch)
    plan = bw.plan_by_size(len(model.layers), size)
    assert_same(bw.segmented_backward(model, plan)(model, batch), ref)


@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_checkpointed_gradients_are_bit_exact(family):
    model, batch = _setup(family)
    ref = trainer.full_backward(model, compile=False)(model, batch)
    assert_same(bw.checkpointed_backward(model)(model, batch), ref)


def test_gemma4_cut_between_donor_and_sharers():
    """Layers 2 and 3 donate K/V to 5 and 4; cuts at 3|4 and 4|5 carry both streams."""
    model, batch = _setup("gemma4")
    ref = trainer.full_backward(model, compile=False)(model, batch)
    plan = bw.Plan(((0, 1, 2), (3,), (4,), (5,)))
    assert_same(bw.segmented_backward(model, plan)(model, batch), ref)
    # The donors' own k/v LoRA gradients depend on the sharers' cotangents: dropping the K/V
    # stream would change them, so the check above is a real one.
    names = [k for k, _ in tree_flatten(ref[2]) if "layers.3.self_attn.k_proj" in k]
    assert names and all(
        float(np.abs(np.array(dict(tree_flatten(ref[2]))[n])).max()) > 0 for n in names
    )


def test_plans():
    model, _, _ = tiny.build("gemma3")
    runner = runners.runner_for(model)
    assert bw.plan_by_size(6, 4).segments == ((0, 1, 2, 3), (4, 5))
    auto = bw.plan_auto(runner, {"sliding": 1.0, "global": 5.0}, budget=2.0)
    assert auto.segments == ((0, 1), (2,), (3, 4), (5,))  # global layers 2 and 5 alone
    assert "[2:G]" in auto.describe(runner)
    with pytest.raises(UserError, match="segment_size must be >= 1"):
        bw.plan_by_size(6, 0)
    with pytest.raises(UserError, match="needs backward.memory_target_gb"):
        BackwardConfig(mode="segmented", plan="auto")


def test_auto_plan_measures_layer_costs():
    import mlx.core as mx

    model, _, _ = tiny.build("gemma3")
    costs = bw.measure_layer_costs(model, mx.zeros((2, 64), mx.int32))
    assert costs["sliding"] > 0 and costs["global"] > 0
    plan = bw.make_plan(
        model, BackwardConfig(mode="segmented", plan="auto", memory_target_gb=100.0), (2, 64)
    )
    assert [s for s in plan.segments if len(s) == 1 and runners.runner_for(model).is_global(s[0])]


@pytest.mark.slow  # a soak: 120 optimizer steps per mode (12-15 s each here, idle; 40-110 s under load)
@pytest.mark.parametrize("mode", ["segmented", "checkpoint", "full"])
def test_active_memory_is_flat_over_many_steps(mode):
    """120 optimizer steps; active memory after warm-up must not grow (the predecessor's first
    segmented version leaked ~32 MB per segment per step)."""
    import mlx.core as mx

    from mlxlab.config import OptimConfig

    model, batch = _setup("gemma3")
    grad_fn, _ = bw.make_grad_fn(
        model, BackwardConfig(mode=mode, segment_size=2), (3, 64), compile=False
    )
    optimizer = trainer.make_optimizer(OptimConfig(lr=1e-4), 120)
    active = []
    for step in range(1, 121):
        trainer.train_step(model, optimizer, grad_fn, [batch], 1.0, step)
        mx.synchronize()
        active.append(mx.get_active_memory())
    tail = np.array(active[20:], dtype=np.float64)
    slope = np.polyfit(np.arange(len(tail)), tail, 1)[0]
    assert abs(slope) < 1024, f"{mode}: active memory grows {slope:.0f} bytes/step"
    assert tail.max() - tail.min() < 64 * 1024


@pytest.mark.parametrize("mode", ["segmented", "checkpoint"])
def test_dropout_masks_match_between_forward_and_recompute(mode):
    """With dropout, each segment's (layer's) recomputation must see its first run's masks: the
    gradients equal autodiff through one forward that seeds each segment the same way."""
    import mlx.core as mx
    import mlx.nn as nn

    model, _, _ = tiny.build("gemma3")
    lplan = lora.plan(model, LoraConfig(targets=["q", "v", "down"], rank=4, dropout=0.5))
    lora.apply(model, lplan, seed=0)
    for _, m in lora.lora_modules(model):  # non-zero B, or dropout on the LoRA input shows nowhere
        m.lora_b = 0.05 * mx.random.normal(m.lora_b.shape)
    model.train()
    rng = np.random.default_rng(1)
    batch = B.collate([D.Example(ids=[2] + list(rng.integers(6, 500, 30)), offset=5)])
    # checkpoint mode seeds per layer: the same as segments of one layer
    plan = bw.plan_by_size(6, 2 if mode == "segmented" else 1)
    runner = runners.runner_for(model)
    grad_fn = (
        bw.segmented_backward(model, plan)
        if mode == "segmented"
        else bw.checkpointed_backward(model)
    )

    mx.random.seed(7)
    loss, _, grads = grad_fn(model, batch)

    def reference(inputs, positions, labels, weights):
        base = int(mx.random.randint(0, 2**30, ()).item())
        h, ctx = runner.embed(inputs)
        for s, seg in enumerate(plan.segments):
            mx.random.seed(base + s)
            for i in seg:
                h, _ = runner.layer(i, h, ctx)
        return bw.head_loss(runner, h, positions, labels, weights)

    mx.random.seed(7)
    (ref_loss, _), ref_grads = nn.value_and_grad(model, reference)(*batch.arrays())
    assert loss.item() == ref_loss.item()
    g, r = dict(tree_flatten(grads)), dict(tree_flatten(ref_grads))
    assert all(np.array_equal(np.array(g[k]), np.array(r[k])) for k in r)
    mx.random.seed(8)
    other, _, _ = grad_fn(model, batch)
    assert other.item() != loss.item()  # dropout is really on


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_chunked_loss_head_gives_the_same_loss_and_gradients(family):
    """backward.head_chunk: each chunk's logits recomputed in the backward; every mode the same."""
    from mlxlab.config import BackwardConfig

    model, batch = _setup(family)
    ref = trainer.full_backward(model, compile=False)(model, batch)
    chunked = {}
    for mode in ("full", "checkpoint", "segmented"):
        cfg = BackwardConfig(mode=mode, segment_size=2, head_chunk=7)
        fn, how = bw.make_grad_fn(model, cfg, tuple(batch.inputs.shape), compile=False)
        assert "chunks of 7" in how
        chunked[mode] = fn(model, batch)
    loss, ntoks, grads = chunked["full"]
    assert ntoks.item() == ref[1].item()
    np.testing.assert_allclose(loss.item(), ref[0].item(), rtol=1e-6)
    r = dict(tree_flatten(ref[2]))
    for k, g in tree_flatten(grads):
        a, b = np.array(g), np.array(r[k])
        assert np.linalg.norm(a - b) <= 1e-5 * np.linalg.norm(b) + 1e-9, k
    for mode in ("checkpoint", "segmented"):  # the modes agree with each other bit for bit
        assert_same(chunked[mode], chunked["full"])


def test_a_chunked_head_refuses_a_trainable_head():
    from mlxlab.config import BackwardConfig

    model, batch = _setup("llama")
    fn, _ = bw.make_grad_fn(model, BackwardConfig(head_chunk=7), (1, 8), compile=False)
    head = model.lm_head if "lm_head" in model else model.model.embed_tokens
    head.unfreeze()
    with pytest.raises(UserError, match="head_chunk"):
        fn(model, batch)
