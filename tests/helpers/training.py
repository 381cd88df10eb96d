"""What the training tests share: the bundled quickstart data, examples of given (length,
response offset) shapes, the bit-for-bit check of two backward results, and the losses a run
logged."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from mlxlab.data import datasets as D
from tests.helpers.cli import REPO

QUICKSTART = REPO / "mlxlab" / "data" / "quickstart"


def examples(shapes, seed: int = 0) -> list[D.Example]:
    """examples[i] has shapes[i] = (tokens after BOS, response offset); random ids in [6, 500)."""
    rng = np.random.default_rng(seed)
    return [D.Example(ids=[2] + rng.integers(6, 500, n).tolist(), offset=o) for n, o in shapes]


def assert_same(got, ref) -> None:
    """Two backward results (loss, tokens, gradients[, metrics]) equal bit for bit in their loss,
    tokens and gradients (a pair objective's metrics are the caller's to compare)."""
    from mlx.utils import tree_flatten

    assert got[0].item() == ref[0].item() and got[1].item() == ref[1].item()
    g, r = dict(tree_flatten(got[2])), dict(tree_flatten(ref[2]))
    assert g.keys() == r.keys() and r
    for k in r:
        assert g[k].shape == r[k].shape, k
        assert np.array_equal(np.array(g[k]), np.array(r[k])), k  # bit for bit


def run_losses(run_dir: Path) -> dict[int, float]:
    """step -> loss from a run's metrics.jsonl (a resumed run's later record wins)."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "loss" in rec:
            out[rec["step"]] = rec["loss"]
    return out
