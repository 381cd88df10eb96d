"""Sequence packing: a packed batch trains exactly what the same examples do one per row."""

from __future__ import annotations

import numpy as np
import pytest
from mlx.utils import tree_flatten

import mlxlab  # noqa: F401
from mlxlab.data import batches as B
from mlxlab.data import datasets as D
from mlxlab.models import runners, tiny
from mlxlab.train import backward as bw
from mlxlab.train import trainer
from tests.helpers.lora_model import lora_model

# (length, offset): 40 > the tiny sliding window (16), so sliding layers see real windows
# inside packed examples too; offsets 0 train the whole example.
SHAPES = [(40, 10), (30, 3), (12, 0), (25, 20), (9, 1)]


def _setup(family, seed=0):
    return lora_model(family, SHAPES, seed)


def _grad_fn(model, mode):
    if mode == "full":
        return trainer.full_backward(model, compile=False)
    if mode == "checkpoint":
        return bw.checkpointed_backward(model)
    return bw.segmented_backward(model, bw.plan_by_size(len(model.layers), 2))


def _assert_close(got, ref, rtol=1e-4):
    # float tolerance: even unpacked, an explicit mask array rounds differently from mlx-lm's
    # "causal" mask in SDPA (~1e-5 relative on the gemma families, 1e-6 on the others)
    loss, ntoks, grads = got
    assert ntoks.item() == ref[1].item()
    np.testing.assert_allclose(loss.item(), ref[0].item(), rtol=rtol)
    g, r = dict(tree_flatten(grads)), dict(tree_flatten(ref[2]))
    assert g.keys() == r.keys() and len(r) > 0
    for k in r:
        a, b = np.array(g[k]), np.array(r[k])
        assert np.linalg.norm(a - b) <= rtol * np.linalg.norm(b) + 1e-9, k


@pytest.mark.parametrize("family", tiny.FAMILIES)
@pytest.mark.parametrize("mode", ["full", "checkpoint", "segmented"])
def test_packed_loss_and_gradients_equal_unpacked(family, mode):
    model, examples = _setup(family)
    unpacked = B.collate(examples)
    # rows of 3, 2 examples: every example after the first starts mid-row
    packed = B.collate_rows([examples[:3], examples[3:]])
    assert packed.inputs.shape[0] == 2 and packed.ntoks == unpacked.ntoks
    ref = _grad_fn(model, mode)(model, unpacked)
    _assert_close(_grad_fn(model, mode)(model, packed), ref)


@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_packed_modes_agree_bit_for_bit(family):
    """The segmented and checkpointed backward on packed rows equal the full one exactly."""
    model, examples = _setup(family)
    packed = B.collate_rows([examples[:3], examples[3:]])
    ref = trainer.full_backward(model, compile=False)(model, packed)
    for mode in ("checkpoint", "segmented"):
        loss, _, grads = _grad_fn(model, mode)(model, packed)
        assert loss.item() == ref[0].item()
        for k, v in tree_flatten(ref[2]):
            assert np.array_equal(np.array(dict(tree_flatten(grads))[k]), np.array(v)), (mode, k)


@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_packed_hidden_states_equal_each_example_alone(family):
    import mlx.core as mx

    model, examples = _setup(family)
    model.eval()
    packed = B.collate_rows([examples[:3]])
    runner = runners.runner_for(model)
    h = runners.forward_hidden(runner, packed.inputs, packed.segments)
    start = 0
    for ex in examples[:3]:
        n = len(ex.ids) - 1
        alone = model.model(mx.array(np.array(ex.ids[:-1], np.int32))[None])
        np.testing.assert_allclose(
            np.array(h[0, start : start + n]), np.array(alone[0]), rtol=1e-4, atol=1e-4
        )
        start += n


def test_pack_rows_fills_rows_first_fit_decreasing():
    lengths = [5, 9, 3, 7, 2, 8, 1]
    rows = B.pack_rows(lengths, 10)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= 10 for row in rows)
    assert rows == [[1, 6], [5, 4], [3, 2], [0]]  # 9+1, 8+2, 7+3, 5
    assert B.pack_rows([10, 10], 10) == [[0], [1]]


def test_packed_sampler_pads_less_and_resumes():
    rng = np.random.default_rng(0)
    examples = [
        D.Example(ids=list(rng.integers(6, 500, int(n))), offset=1)
        for n in rng.integers(10, 120, 60)
    ]
    plain = B.BatchSampler(examples, 2, seed=1)
    packed = B.BatchSampler(examples, 2, seed=1, pack_length=128)
    assert packed.padding() < plain.padding()
    assert len(packed) < len(plain)
    assert packed.examples_per_epoch() <= len(examples)
    b = packed.next()
    assert b.segments is not None and b.inputs.shape[1] <= 128
    assert b.padding == pytest.approx(1 - sum(b.lengths) / b.inputs.size)
    state = packed.state()
    after = [packed.next().inputs.tolist() for _ in range(3)]
    again = B.BatchSampler(examples, 2, seed=1, pack_length=128)
    again.restore(state)
    assert [again.next().inputs.tolist() for _ in range(3)] == after


def test_resuming_with_other_packing_is_refused():
    from mlxlab.errors import UserError

    rng = np.random.default_rng(1)
    examples = [
        D.Example(ids=list(rng.integers(6, 500, int(n))), offset=1)
        for n in rng.integers(10, 120, 40)
    ]
    packed = B.BatchSampler(examples, 2, seed=1, pack_length=128)
    packed.next()
    with pytest.raises(UserError, match="data.pack"):
        B.BatchSampler(examples, 2, seed=1).restore(packed.state())
    # a checkpoint written before packing existed resumes an unpacked sampler
    legacy = {"epoch": 0, "index": 3, "seed": 1}
    plain = B.BatchSampler(examples, 2, seed=1)
    plain.restore(legacy)
    assert plain.index == 3


@pytest.mark.parametrize("mode", ["full", "segmented"])
def test_packed_rows_in_query_blocks(mode, monkeypatch):
    """Gemma 3's attention in blocks of queries (models/fastlayers.py) on packed rows: the same
    loss and gradients as one block, and every mode still bit-exact with the full backward."""
    from mlxlab.models import fastlayers

    model, examples = _setup("gemma3")
    packed = B.collate_rows([examples[:3], examples[3:]])
    ref = _grad_fn(model, mode)(model, packed)
    monkeypatch.setattr(fastlayers, "QUERY_BLOCK", 8)
    got = _grad_fn(model, mode)(model, packed)
    _assert_close(got, ref)
    full = trainer.full_backward(model, compile=False)(model, packed)
    assert got[0].item() == full[0].item()
    for k, v in tree_flatten(full[2]):
        assert np.array_equal(np.array(dict(tree_flatten(got[2]))[k]), np.array(v)), k
