"""mlxlab's compiled part: the CPU decode kernel (matvec.cpp), built by `pip install` through
MLX's documented extension mechanism (setup.py, mlx.extension.CMakeBuild).

`matvec()` is the kernel's function, or None when it cannot be used here: not built (no C++
compiler at install time), built against another MLX than the one running (a C++ extension
must match MLX's ABI exactly), or turned off with MLXLAB_DECODE_KERNEL=off. `status()` says
which, for `models info` and the logs; callers fall back to MLX's own matmul.
"""

from __future__ import annotations

import functools
import os


@functools.cache
def _load():
    import mlx.core as mx

    if os.environ.get("MLXLAB_DECODE_KERNEL", "").lower() in ("off", "0", "false"):
        return None, "turned off by MLXLAB_DECODE_KERNEL"
    try:
        from mlxlab.kernels import _matvec
    except ImportError as e:
        return None, f"not built ({e}); reinstall mlxlab with a C++ compiler and cmake present"
    if _matvec.built_against_mlx != mx.__version__:
        return None, (
            f"built against mlx {_matvec.built_against_mlx} but mlx {mx.__version__} is running; "
            "reinstall mlxlab (pip install --no-deps --force-reinstall) to rebuild it"
        )
    return _matvec.matvec, "loaded"


def matvec():
    """The kernel's `matvec(x, w)` (x @ w.T for w stored [out, in]), or None."""
    return _load()[0]


def status() -> str:
    return _load()[1]
