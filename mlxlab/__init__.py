"""mlxlab: LoRA research on MLX, from training to serving.

Importing mlxlab first makes MLX's CPU backend use an optimized BLAS (see mlxlab/runtime.py).
"""

import os as _os

from mlxlab import runtime as _runtime

# mlxlab uses transformers for tokenizers only; its "PyTorch was not found" advice is noise here.
_os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

_runtime.load_blas()

__version__ = "0.1.0"
