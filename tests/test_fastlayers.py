"""Gemma 3's layers on mlxlab's training kernels (models/fastlayers.py, kernels/layer.cpp) equal
mlx-lm's own to float rounding, forward and backward, packed or not; the kernels alone match
MLX's ops."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.base import create_causal_mask

from mlxlab import kernels
from mlxlab.data import batches as B
from mlxlab.data import datasets as D
from mlxlab.models import fastlayers, runners, tiny
from mlxlab.train import trainer
from tests.helpers.kernel import REASON, UNBUILDABLE

pytestmark = [
    pytest.mark.skipif(mx.default_device() != mx.cpu, reason="CPU kernels"),
    pytest.mark.skipif(UNBUILDABLE, reason=REASON),
]


def train_kernels():
    k = kernels.train()
    assert k is not None, kernels.status()
    return k


def _reference_softmax(s, scale, window, segments=None):
    mask = create_causal_mask(s.shape[-1], 0, window_size=window or None)
    if segments is not None:
        mask = mask & (segments[:, :, None] == segments[:, None, :])[:, None]
    return mx.softmax(mx.where(mask, s * scale, -mx.inf), axis=-1, precise=True)


@pytest.mark.parametrize("length", [1, 7, 16, 37, 70])
@pytest.mark.parametrize("window", [0, 1, 5, 16])
def test_attention_softmax_matches_the_masked_softmax(length, window):
    mx.random.seed(length * 31 + window)
    s = mx.random.normal((2, 3, length, length)) * 3
    got = train_kernels().attention_softmax(s, 0.7, window)
    ref = _reference_softmax(s, 0.7, window)
    np.testing.assert_allclose(np.array(got), np.array(ref), atol=3e-7)
    assert (np.array(got)[np.array(ref) == 0] == 0).all()  # masked entries exactly zero
    ct = mx.random.normal(s.shape)
    g = mx.vjp(lambda z: train_kernels().attention_softmax(z, 0.7, window), [s], [ct])[1][0]
    r = mx.vjp(lambda z: _reference_softmax(z, 0.7, window), [s], [ct])[1][0]
    np.testing.assert_allclose(np.array(g), np.array(r), atol=1e-6)


def test_attention_softmax_with_packed_starts():
    seg = mx.array(np.array([[1] * 10 + [2] * 20 + [3] * 7, [1] * 30 + [0] * 7], np.int32))
    starts = fastlayers.example_starts(seg)
    assert starts.tolist()[0][:12] == [0] * 10 + [10, 10] and starts.tolist()[1][-1] == 30
    s = mx.random.normal((2, 4, 37, 37))
    got = train_kernels().attention_softmax(s, 0.5, 5, starts)
    np.testing.assert_allclose(
        np.array(got), np.array(_reference_softmax(s, 0.5, 5, seg)), atol=3e-7
    )


@pytest.mark.parametrize("window", [0, 6])
@pytest.mark.parametrize("packed", [False, True])
def test_attention_softmax_over_a_block_equals_those_rows_of_the_whole(window, packed):
    # a block of queries q0 .. q1 - 1 against keys k0 .. q1 - 1 (all it can see) gives the
    # whole L x L softmax's rows q0 .. q1 - 1, columns k0 .. q1 - 1, and its vjp likewise
    n, rep = 29, 3
    seg = mx.array(np.array([[1] * 11 + [2] * 18, [1] * 29], np.int32)) if packed else None
    starts = fastlayers.example_starts(seg) if packed else None
    s = mx.random.normal((2, 1, rep, n, n), key=mx.random.key(window + 7 * packed)) * 3
    k = train_kernels()
    whole = k.attention_softmax(s.reshape(2, 1, rep * n, n), 0.6, window, starts)
    whole = whole.reshape(s.shape)
    ct = mx.random.normal(s.shape, key=mx.random.key(3))
    g_whole = mx.vjp(
        lambda z: k.attention_softmax(z.reshape(2, 1, rep * n, n), 0.6, window, starts),
        [s],
        [ct.reshape(2, 1, rep * n, n)],
    )[1][0]
    for q0, q1, k0 in fastlayers._blocks(n, window, 8):
        blk = s[..., q0:q1, k0:q1].reshape(2, 1, rep * (q1 - q0), q1 - k0)

        def f(z, q0=q0, q1=q1, k0=k0):
            return k.attention_softmax(
                z, 0.6, window, starts, queries=q1 - q0, q_offset=q0, k_offset=k0
            )

        got = f(blk).reshape(2, 1, rep, q1 - q0, q1 - k0)
        np.testing.assert_allclose(
            np.array(got), np.array(whole[..., q0:q1, k0:q1]), rtol=1e-6, atol=1e-7
        )
        # nothing the block leaves out is seen by its queries
        assert float(mx.abs(whole[..., q0:q1, :k0]).max() if k0 else 0) == 0
        cb = ct[..., q0:q1, k0:q1].reshape(blk.shape)
        g = mx.vjp(f, [blk], [cb])[1][0].reshape(got.shape)
        np.testing.assert_allclose(
            np.array(g), np.array(g_whole[..., q0:q1, k0:q1]), rtol=1e-5, atol=1e-6
        )


def test_attention_softmax_refuses_a_block_that_misses_keys():
    k = train_kernels()
    s = mx.zeros((1, 1, 4, 10))
    k.attention_softmax(s, 1.0, 0, queries=4, q_offset=6, k_offset=0)  # causal block: fine
    with pytest.raises(ValueError, match="cover"):
        k.attention_softmax(s, 1.0, 0, queries=4, q_offset=8, k_offset=2)  # keys 0, 1 missing
    with pytest.raises(ValueError, match="cover"):
        k.attention_softmax(s, 1.0, 3, queries=4, q_offset=9, k_offset=0)  # query 12 > key 9
    k.attention_softmax(s, 1.0, 3, queries=4, q_offset=8, k_offset=2)  # window 3: 6 .. 11
    with pytest.raises(ValueError, match="cover"):
        k.attention_softmax(s, 1.0, 3, queries=4, q_offset=8, k_offset=7)  # key 6 missing
    with pytest.raises(ValueError, match="whole blocks"):
        k.attention_softmax(s, 1.0, 0, queries=3)
    with pytest.raises(ValueError, match="starts"):
        k.attention_softmax(
            s, 1.0, 3, mx.zeros((1, 11), mx.int32), queries=4, q_offset=8, k_offset=2
        )


def test_gelu_mul_matches_mlx():
    g = mx.random.normal((5, 203)) * 4
    u = mx.random.normal((5, 203))
    k = train_kernels()
    np.testing.assert_allclose(
        np.array(k.gelu_mul(g, u)), np.array(nn.gelu_approx(g) * u), rtol=2e-6, atol=1e-6
    )
    d = mx.random.normal(g.shape)
    got = mx.vjp(k.gelu_mul, [g, u], [d])[1]
    ref = mx.vjp(lambda a, b: nn.gelu_approx(a) * b, [g, u], [d])[1]
    for a, b in zip(got, ref, strict=True):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=2e-6)


def test_bad_inputs_are_refused():
    k = train_kernels()
    with pytest.raises(ValueError):
        k.attention_softmax(mx.zeros((2, 3, 4, 5)), 1.0)  # rows not whole blocks of 5 queries
    with pytest.raises(ValueError):
        k.gelu_mul(mx.zeros((2, 3)), mx.zeros((3, 2)))
    with pytest.raises(ValueError):
        k.attention_softmax(mx.zeros((1, 1, 4, 4), mx.bfloat16), 1.0)


@pytest.mark.parametrize("block", [256, 8])  # one block; blocks of 8 queries (the band)
@pytest.mark.parametrize("length", [9, 40])  # shorter and longer than the tiny sliding window
def test_fast_gemma3_layers_equal_mlx_lm(length, block, monkeypatch):
    monkeypatch.setattr(fastlayers, "QUERY_BLOCK", block)
    model, _, _ = tiny.build("gemma3")
    inputs = mx.random.randint(6, 500, (2, length), key=mx.random.key(length))
    runner = runners.runner_for(model)
    h, ctx = runner.embed(inputs)
    assert ctx.fast is not None  # float32 on the CPU: the kernels run
    got = runners.forward_hidden(runner, inputs)
    ref = model.model(inputs)
    # float rounding, amplified through 6 random-init layers (as an explicit mask array already
    # differs from mlx-lm's "causal" SDPA by ~3e-5 here: tests/test_pack.py)
    np.testing.assert_allclose(np.array(got), np.array(ref), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("block", [256, 8])
def test_fast_gemma3_gradients_equal_mlx_lm(block, monkeypatch):
    monkeypatch.setattr(fastlayers, "QUERY_BLOCK", block)
    from mlxlab.config import LoraConfig
    from mlxlab.lora import apply as lora

    model, _, _ = tiny.build("gemma3")
    plan = lora.plan(model, LoraConfig(targets=["q", "k", "v", "o", "gate", "up", "down"], rank=4))
    lora.apply(model, plan, seed=0)
    for _, m in lora.lora_modules(model):
        m.lora_b = 0.05 * mx.random.normal(m.lora_b.shape)
    rng = np.random.default_rng(0)
    batch = B.collate(
        [
            D.Example(ids=[2] + list(rng.integers(6, 500, n)), offset=o)
            for n, o in [(40, 10), (12, 0)]
        ]
    )
    loss, _, grads = trainer.full_backward(model, compile=False)(model, batch)
    with kernels.off("train"):
        ref_loss, _, ref = trainer.full_backward(model, compile=False)(model, batch)
    np.testing.assert_allclose(loss.item(), ref_loss.item(), rtol=1e-6)
    r = dict(tree_flatten(ref))
    for k, g in tree_flatten(grads):
        a, b = np.array(g), np.array(r[k])
        assert np.linalg.norm(a - b) <= 1e-4 * np.linalg.norm(b) + 1e-9, k


def test_query_blocks_cover_only_the_keys_each_block_sees():
    # gemma3-270m at 1152 tokens: a sliding layer (window 512) and a global one
    assert fastlayers._blocks(1152, 512, 256) == [
        (0, 256, 0),
        (256, 512, 0),
        (512, 768, 1),
        (768, 1024, 257),
        (1024, 1152, 513),
    ]
    assert fastlayers._blocks(600, None, 256) == [(0, 256, 0), (256, 512, 0), (512, 600, 0)]
    assert fastlayers._blocks(200, 512, 256) == [(0, 200, 0)]  # one block: the whole row
