"""Layer-range runners reproduce each family's own forward bit for bit (on MLX's own ops; the
fast layers on mlxlab's kernels are held to float tolerance in tests/test_fastlayers.py)."""

from __future__ import annotations

import pytest

import mlxlab  # noqa: F401
from mlxlab import kernels
from mlxlab.config import UserError
from mlxlab.models import runners, tiny


@pytest.mark.parametrize("family", tiny.FAMILIES)
@pytest.mark.parametrize("length", [9, 40])  # shorter and longer than the tiny sliding window (16)
def test_runner_matches_the_model(family, length):
    import mlx.core as mx

    model, _, _ = tiny.build(family)
    inputs = mx.random.randint(6, 500, (2, length), key=mx.random.key(length))
    expected = model.model(inputs)
    with kernels.off("train"):
        got = runners.forward_hidden(runners.runner_for(model), inputs)
    assert mx.array_equal(expected, got).item()


def test_gemma4_donors_and_global_layers():
    model, _, _ = tiny.build("gemma4")
    r = runners.runner_for(model)
    assert r.kv_donors() == {4: 3, 5: 2}
    assert [r.is_global(i) for i in range(6)] == [False, False, True, False, False, True]


def test_unsupported_family_is_named():
    class Fake:
        model_type = "mamba"

    with pytest.raises(UserError, match="'mamba'; supported: gemma3_text, gemma4_text, llama"):
        runners.runner_for(Fake())
