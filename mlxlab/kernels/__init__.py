"""mlxlab's compiled part: CPU kernels built by `pip install` through MLX's documented
extension mechanism (setup.py, mlx.extension.CMakeBuild):

- decode: matvec.cpp, x @ w.T for a few rows (decode steps), at the memory bandwidth;
- train: ce.cpp, cross-entropy over a large vocabulary (the loss head); layer.cpp, the attention
  softmax and Gemma's gelu_approx(g) * u; each vectorized, on every core, with its vjp.

`matvec()` and `train()` return the kernels, or None when they cannot be used here: not built
(no C++ compiler at install time), built against another MLX than the one running (a C++
extension must match MLX's ABI exactly), or turned off (MLXLAB_DECODE_KERNEL=off,
MLXLAB_TRAIN_KERNELS=off, or `off("decode" | "train")` for a block). `status()` says which, for
`models info` and the logs; callers fall back to MLX's own ops.
"""

from __future__ import annotations

import contextlib
import functools
import os

_OFF = ("off", "0", "false")
_held_off: set[str] = set()  # groups turned off in this process by `off()`


@functools.cache
def _load():
    import mlx.core as mx

    try:
        from mlxlab.kernels import _kernels
    except ImportError as e:
        return None, f"not built ({e}); reinstall mlxlab with a C++ compiler and cmake present"
    if _kernels.built_against_mlx != mx.__version__:
        return None, (
            f"built against mlx {_kernels.built_against_mlx} but mlx {mx.__version__} is "
            "running; reinstall mlxlab (pip install --no-deps --force-reinstall) to rebuild it"
        )
    return _kernels, "loaded"


SWITCHES = {"decode": "MLXLAB_DECODE_KERNEL", "train": "MLXLAB_TRAIN_KERNELS"}


def _group(group: str):
    if group in _held_off or os.environ.get(SWITCHES[group], "").lower() in _OFF:
        return None
    return _load()[0]


def matvec():
    """The kernel's `matvec(x, w)` (x @ w.T for w stored [out, in]), or None."""
    module = _group("decode")
    return module.matvec if module is not None else None


def matvec_avx512() -> bool:
    """Whether the decode kernel runs its AVX-512 loops, which take 8 rows of x per pass over a
    weight row (its other loops, AVX2+FMA on x86-64, take 4): the kernel is loaded, the CPU has
    AVX-512 F and BW, and they were not turned off (`_kernels.matvec_avx512(0)`: tests and
    experiments/speculative/verify_cost.py compare the two)."""
    module = _load()[0]
    return module is not None and module.matvec_avx512()


def train():
    """The training kernels, or None: a module with `cross_entropy(logits, labels) -> [ce, lse]`
    (float32 [N, V] logits), `attention_softmax(scores, scale, window=0, starts=None, *,
    queries=0, q_offset=0, k_offset=0)` (a block of queries against the keys they see; see
    kernels.h) and `gelu_mul(g, u)`, each differentiable."""
    return _group("train")


def cross_entropy():
    """The kernel's `cross_entropy`, or None."""
    module = train()
    return module.cross_entropy if module is not None else None


@contextlib.contextmanager
def off(*groups: str):
    """Run a block on MLX's own ops instead of the named kernel groups ("decode", "train"):
    `diag parity` compares mlx-lm's numerics bit for bit that way, then the kernels with them."""
    unknown = set(groups) - set(SWITCHES)
    if unknown:
        raise ValueError(f"unknown kernel groups {sorted(unknown)}; known: {sorted(SWITCHES)}")
    added = set(groups) - _held_off
    _held_off.update(added)
    try:
        yield
    finally:
        _held_off.difference_update(added)


def status() -> str:
    reason = _load()[1]
    off = [s for s in SWITCHES.values() if os.environ.get(s, "").lower() in _OFF]
    return reason + (f" (turned off by {', '.join(off)})" if off and reason == "loaded" else "")
