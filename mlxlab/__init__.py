"""mlxlab: LoRA research on MLX, from training to serving.

Importing mlxlab first makes MLX's CPU backend use an optimized BLAS (see mlxlab/runtime.py).
"""

from mlxlab import runtime as _runtime

_runtime.load_blas()

__version__ = "0.1.0"
