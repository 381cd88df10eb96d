"""mlxlab's compiled part: CPU kernels built by `pip install` through MLX's documented
extension mechanism (setup.py, mlx.extension.CMakeBuild):

- matvec.cpp: x @ w.T for a few rows (decode steps), at the memory bandwidth;
- ce.cpp: cross-entropy over a large vocabulary (the loss head), vectorized and on every core.

`matvec()` and `cross_entropy()` return the kernel's function, or None when it cannot be used
here: not built (no C++ compiler at install time), built against another MLX than the one
running (a C++ extension must match MLX's ABI exactly), or turned off (MLXLAB_DECODE_KERNEL=off,
MLXLAB_CE_KERNEL=off). `status()` says which, for `models info` and the logs; callers fall back
to MLX's own ops.
"""

from __future__ import annotations

import contextlib
import functools
import os

_OFF = ("off", "0", "false")
_held_off: set[str] = set()  # names turned off in this process by `off()`


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


def _kernel(name: str, switch: str):
    if name in _held_off or os.environ.get(switch, "").lower() in _OFF:
        return None
    module = _load()[0]
    return getattr(module, name) if module is not None else None


def matvec():
    """The kernel's `matvec(x, w)` (x @ w.T for w stored [out, in]), or None."""
    return _kernel("matvec", "MLXLAB_DECODE_KERNEL")


def cross_entropy():
    """The kernel's `cross_entropy(logits, labels) -> [ce, lse]` (float32 [N, V] logits, per-row
    results, differentiable in the logits), or None."""
    return _kernel("cross_entropy", "MLXLAB_CE_KERNEL")


@contextlib.contextmanager
def off(*names: str):
    """Run a block on MLX's own ops instead of the named kernels (`diag parity` compares
    mlx-lm's numerics bit for bit that way, then the kernels against them)."""
    added = set(names) - _held_off
    _held_off.update(added)
    try:
        yield
    finally:
        _held_off.difference_update(added)


def status() -> str:
    reason = _load()[1]
    off = [
        s
        for s in ("MLXLAB_DECODE_KERNEL", "MLXLAB_CE_KERNEL")
        if os.environ.get(s, "").lower() in _OFF
    ]
    return reason + (f" (turned off by {', '.join(off)})" if off and reason == "loaded" else "")
