"""Whether this machine could have built the CPU kernels at install time.

With a C++ compiler on PATH the kernel must be built and loaded (the tests that use it fail
otherwise; CI installs one). Without one, `pip install` warns and mlxlab decodes with MLX's
matmul: the kernel's own tests are skipped with that reason, and the rest of the suite runs the
fallback path."""

from __future__ import annotations

import shutil

from mlxlab import kernels

HAS_COMPILER = any(shutil.which(c) for c in ("c++", "g++", "clang++"))
UNBUILDABLE = kernels.matvec() is None and not HAS_COMPILER
REASON = f"no C++ compiler here, so no CPU kernels ({kernels.status()})"
