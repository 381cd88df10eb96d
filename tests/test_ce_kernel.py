"""The loss head's cross-entropy kernel (mlxlab/kernels/ce.cpp) against MLX's and float64."""

from __future__ import annotations

import re

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlxlab import kernels
from mlxlab.train import losses
from tests.helpers.kernel import REASON, UNBUILDABLE

pytestmark = [
    pytest.mark.skipif(mx.default_device() != mx.cpu, reason="a CPU kernel"),
    pytest.mark.skipif(UNBUILDABLE, reason=REASON),
]


def kernel():
    fn = kernels.cross_entropy()
    assert fn is not None, kernels.status()
    return fn


def reference(x: np.ndarray, labels: np.ndarray):
    """(ce, d sum(w * ce) / d x) in float64."""
    x = x.astype(np.float64)
    m = x.max(1, keepdims=True)
    e = np.exp(x - m)
    s = e.sum(1, keepdims=True)
    ce = np.log(s[:, 0]) + m[:, 0] - x[np.arange(len(x)), labels]
    p = e / s
    p[np.arange(len(x)), labels] -= 1
    return ce, p


@pytest.mark.parametrize("n,v", [(1, 1), (3, 5), (5, 16), (7, 33), (4, 1000), (2, 70001)])
def test_cross_entropy_and_its_gradient_match_float64(n, v):
    mx.random.seed(n * v)
    x = mx.random.normal((n, v)) * 4
    labels = mx.random.randint(0, v, (n,))
    w = mx.random.uniform(shape=(n,))
    ce, lse = kernel()(x, labels)
    ref_ce, ref_p = reference(np.array(x), np.array(labels))
    np.testing.assert_allclose(np.array(ce), ref_ce, rtol=2e-6, atol=2e-6)
    grad = mx.grad(lambda z: (kernel()(z, labels)[0] * w).sum())(x)
    np.testing.assert_allclose(np.array(grad), ref_p * np.array(w)[:, None], atol=1e-6)
    # and as MLX computes them (MLX's float32 sum over a large row is the less exact of the two)
    mlx_ce = nn.losses.cross_entropy(x, labels)
    np.testing.assert_allclose(np.array(ce), np.array(mlx_ce), rtol=1e-5, atol=1e-5)
    # lse is differentiable too: its gradient is the softmax
    g_lse = mx.grad(lambda z: (kernel()(z, labels)[1] * w).sum())(x)
    softmax = ref_p.copy()
    softmax[np.arange(n), np.array(labels)] += 1
    np.testing.assert_allclose(np.array(g_lse), softmax * np.array(w)[:, None], atol=1e-6)
    np.testing.assert_allclose(
        np.array(lse), ref_ce + np.array(x)[np.arange(n), np.array(labels)], rtol=2e-6, atol=2e-6
    )


def test_non_finite_logits_give_nan_not_a_number():
    x = mx.array([[1.0, float("nan"), 2.0], [1.0, 2.0, 3.0], [float("inf"), 0.0, 0.0]])
    ce = np.array(kernel()(x, mx.array([0, 1, 2]))[0])
    assert np.isnan(ce[0]) and np.isnan(ce[2]) and np.isfinite(ce[1])
    # out-of-range labels too (MLX's take would read out of bounds)
    assert np.isnan(np.array(kernel()(x[1:2], mx.array([3]))[0])).all()


def primitives(tmp_path, out: mx.array) -> set[str]:
    """The primitives of the graph that computes `out` (before it is evaluated), by name."""
    dot = tmp_path / "graph.dot"
    mx.export_to_dot(str(dot), out)
    return set(re.findall(r'label ="(\w+)"', dot.read_text()))


def test_token_ce_uses_the_kernel_and_falls_back(monkeypatch, tmp_path):
    x = mx.random.normal((6, 50))
    labels = mx.random.randint(0, 50, (6,))
    mx.eval(x, labels)
    fast = losses.token_ce(x, labels)
    assert "CrossEntropy" in primitives(tmp_path, fast)  # the kernel's primitive computes it
    mx.eval(fast)
    monkeypatch.setenv("MLXLAB_TRAIN_KERNELS", "off")
    assert kernels.cross_entropy() is None
    slow = losses.token_ce(x, labels)
    assert "CrossEntropy" not in primitives(tmp_path, slow)  # MLX's own ops
    np.testing.assert_allclose(np.array(fast), np.array(slow), rtol=1e-6, atol=1e-6)
    # other dtypes take MLX's path
    half = losses.token_ce(x.astype(mx.bfloat16), labels)
    assert half.shape == (6,)
