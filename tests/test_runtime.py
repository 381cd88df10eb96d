"""The optimized BLAS is loaded before MLX, reported honestly, and its absence is survivable."""

from __future__ import annotations

import subprocess
import sys

import pytest

import mlxlab  # noqa: F401
from mlxlab import runtime

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux BLAS swap")


@linux_only
def test_blas_is_loaded_and_mapped():
    report = runtime.blas_report(measure=False)
    assert report["status"] == "loaded", report
    assert report["mlxlab_loaded"] in report["mapped_blas_libraries"]
    assert report["live"] == report["mlxlab_loaded"]


def _python(code: str, **env) -> subprocess.CompletedProcess:
    import os

    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=120,
    )


@linux_only
@pytest.mark.slow  # a fresh interpreter
def test_disabled_blas_says_so():
    r = _python(
        "import mlxlab; from mlxlab import runtime; "
        "print(runtime.blas_report(measure=False)['status'])",
        MLXLAB_BLAS="off",
    )
    assert r.returncode == 0 and r.stdout.strip() == "disabled by MLXLAB_BLAS"


@linux_only
@pytest.mark.slow  # a fresh interpreter
def test_mlx_imported_first_warns_once_and_carries_on():
    r = _python(
        "import mlx.core as mx; import mlxlab; import mlxlab.runtime as rt; rt.load_blas(); "
        "print((mx.ones(3) @ mx.ones(3)).item())"
    )
    assert r.returncode == 0 and r.stdout.strip() == "3.0"
    assert r.stderr.count("mlx.core was imported before mlxlab") == 1


@linux_only
@pytest.mark.slow  # a fresh interpreter
def test_unloadable_blas_path_warns_and_carries_on(tmp_path):
    bogus = tmp_path / "libnot.so"
    bogus.write_text("not a library")
    r = _python(
        "import mlxlab, mlx.core as mx; print((mx.ones(2) @ mx.ones(2)).item())",
        MLXLAB_BLAS=str(bogus),
    )
    assert r.returncode == 0 and r.stdout.strip() == "2.0"
    assert "no optimized BLAS loaded" in r.stderr


def test_dtype_policy():
    import mlx.core as mx

    expected = mx.bfloat16 if runtime.on_gpu() else mx.float32
    assert runtime.resolve_dtype("auto") == expected
    assert runtime.resolve_dtype("bfloat16") == mx.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        runtime.resolve_dtype("int8")


@linux_only
@pytest.mark.slow  # probes in child interpreters
def test_a_blas_that_crashes_the_probe_is_not_loaded(tmp_path, monkeypatch):
    """A library whose test matmul kills the child (SIGILL, as AVX-512 kernels on a CPU without
    AVX-512 do) is refused, and the verdict is cached; a healthy one passes."""
    monkeypatch.setenv("MLXLAB_HOME", str(tmp_path))
    lib = tmp_path / "libfake.so"
    lib.write_bytes(b"not really a library")
    monkeypatch.setattr(runtime, "_PROBE", "import os, signal; os.kill(os.getpid(), signal.SIGILL)")
    verdict = runtime._probe(lib)
    assert "crashed a test matmul" in verdict
    with pytest.raises(OSError, match="crashed"):
        runtime._checked(lib, relink=False)
    monkeypatch.setattr(runtime, "_PROBE", "print('ok')")
    assert runtime._probe(lib) == verdict  # cached per library and CPU
    real = runtime._loaded
    assert real and runtime._probe(runtime.Path(real)) == "ok"
