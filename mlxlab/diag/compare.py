"""Comparing two arrays (or trees of arrays) the way a parity report needs: exact, ulps, norms."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np


@dataclass
class Comparison:
    name: str
    bit_exact: bool
    max_ulp: int  # largest distance in units in the last place (of the compared dtype)
    max_abs: float
    rel_norm: float  # ||a - b|| / ||b||
    passed: bool = True
    note: str = ""

    @property
    def verdict(self) -> str:
        if self.bit_exact:
            return "BIT-EXACT"
        if self.max_ulp <= 1024:
            return f"within {self.max_ulp} ulp"
        return f"rel-norm {self.rel_norm:.2e}"

    def to_dict(self) -> dict:
        return {**asdict(self), "verdict": self.verdict}


def _ordered_ints(x: np.ndarray) -> np.ndarray:
    """Map floats to integers whose difference counts representable values between them."""
    if x.dtype == np.float32:
        i = x.view(np.int32).astype(np.int64)
        return np.where(i < 0, np.int64(-(2**31)) - i, i)
    if x.dtype == np.float16:
        i = x.view(np.int16).astype(np.int64)
        return np.where(i < 0, np.int64(-(2**15)) - i, i)
    raise TypeError(f"ulp distance needs float32 or float16, got {x.dtype}")


def _to_numpy(a) -> np.ndarray:
    import mlx.core as mx

    if isinstance(a, mx.array):
        if a.dtype == mx.bfloat16:  # bf16 is the top half of a float32: compare it there
            a = a.astype(mx.float32)
        return np.array(a)
    return np.asarray(a)


def ulp_distance(a, b) -> int:
    a, b = _to_numpy(a), _to_numpy(b)
    if a.size == 0:
        return 0
    return int(np.abs(_ordered_ints(a) - _ordered_ints(b)).max())


def compare(
    name: str, ours, theirs, max_ulp: int | None = None, max_rel: float | None = None
) -> Comparison:
    """Compare arrays (or flat dicts of arrays) and apply the gates (None: not gated)."""
    if isinstance(ours, dict):
        if ours.keys() != theirs.keys():
            missing = sorted(set(ours) ^ set(theirs))
            return Comparison(
                name,
                False,
                2**31,
                float("inf"),
                float("inf"),
                False,
                f"different tensors: {missing[:5]}",
            )
        a = [_to_numpy(ours[k]).ravel() for k in sorted(ours)]
        b = [_to_numpy(theirs[k]).ravel() for k in sorted(ours)]
        a, b = np.concatenate(a), np.concatenate(b)
    else:
        a, b = _to_numpy(ours), _to_numpy(theirs)
    if a.shape != b.shape:
        return Comparison(
            name, False, 2**31, float("inf"), float("inf"), False, f"shapes {a.shape} vs {b.shape}"
        )
    exact = bool(np.array_equal(a, b))
    diff = a.astype(np.float64) - b.astype(np.float64)
    max_abs = float(np.abs(diff).max()) if diff.size else 0.0
    denom = float(np.linalg.norm(b.astype(np.float64)))
    rel = float(np.linalg.norm(diff)) / denom if denom else (0.0 if exact else float("inf"))
    ulp = 0 if exact else ulp_distance(a, b)
    passed = exact or (
        (max_ulp is not None and ulp <= max_ulp) or (max_rel is not None and rel <= max_rel)
    )
    return Comparison(name, exact, ulp, max_abs, rel, passed)
