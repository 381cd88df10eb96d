"""Decode-step products through mlxlab's CPU kernel (mlxlab/kernels), for every caller of
`zoo.load` (generate, both serving lanes, the chunk evaluation).

Measured with `python -m mlxlab diag decode` on the 2-core box: a float32 decode step of
gemma3-270m spent ~70% of its time in vector x matrix products. MLX's CPU matmul hands every
product to `cblas_sgemm` with a transposed weight (how nn.Linear and a tied LM head multiply),
which OpenBLAS runs at ~7 GB/s for one row against the ~17-19 GB/s this machine reads; the
kernel reads each weight row once in its stored layout, at the bandwidth.

`accelerate(model)` switches the model's `nn.Linear` layers and a tied embedding used as the
LM head to subclasses that send decode-shaped products to the kernel and everything else to
mlx-lm's own code. It changes the instances' class only: weights, parameter names, LoRA
wrapping and saving are untouched. Decode-shaped: float32 on the CPU, inputs [..., 1, d] (one
token per row) with at most MAX_ROWS rows. Prefill, training and the loss head (many-row
products) keep BLAS, so their numbers are bit for bit what they were. The kernel's float32
sums run in a fixed order of its own, so a decode step's logits differ from BLAS's in the last
bits (~1e-6 relative) and greedy tokens match (tests); each row's result does not depend on
how many rows are decoded together.

Compiling the RMS norms of a decode step (`mx.compile`, ~4x faster per norm in isolation) was
tried and measured no faster end to end: the compiled call's Python overhead eats the gain.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import mlx.nn as nn

from mlxlab import kernels

log = logging.getLogger(__name__)

MAX_ROWS = 4
"""Decode rows up to which products go to the kernel. Measured on the 2-core box (median ms,
BLAS vs kernel): the 262144 x 640 head at 1/2/4/8 rows 97/114/113/116 vs 43/53/63/98, a
2048 x 640 projection 0.52/0.61/0.59/0.55 vs 0.33/0.42/0.63/1.22: past 4 rows BLAS's blocking
wins."""


def _one_token_rows(x: mx.array, max_rows: int | None = None) -> bool:
    return (
        x.ndim >= 3
        and x.shape[-2] == 1
        and (max_rows is None or x.size // x.shape[-1] <= max_rows)
        and mx.default_device() == mx.cpu
    )


def _kernel_applies(x: mx.array, w: mx.array):
    matvec = kernels.matvec()
    if (
        matvec is not None
        and x.dtype == mx.float32
        and w.dtype == mx.float32
        and _one_token_rows(x, MAX_ROWS)
    ):
        return matvec
    return None


class DecodeLinear(nn.Linear):
    """nn.Linear whose decode-step products go through the CPU kernel."""

    def __call__(self, x):
        w = self["weight"]
        if matvec := _kernel_applies(x, w):
            y = matvec(x, w)
            return y + self["bias"] if "bias" in self else y
        return super().__call__(x)


class DecodeEmbedding(nn.Embedding):
    """nn.Embedding whose use as a tied LM head goes through the CPU kernel at decode."""

    def as_linear(self, x):
        w = self["weight"]
        if matvec := _kernel_applies(x, w):
            return matvec(x, w)
        return super().as_linear(x)


def accelerate(model) -> dict:
    """Route `model`'s decode-step products through the kernel (see the module docstring);
    returns how many modules now do (0 when the kernel is unavailable: `kernels.status()`)."""
    if kernels.matvec() is None:
        log.info("mlxlab: the CPU decode kernel is unavailable: %s", kernels.status())
        return 0
    n = 0
    for _, module in model.named_modules():
        # Exact types only: a subclass (mlx-lm's or ours) has its own __call__ to keep.
        if type(module) is nn.Linear:
            module.__class__ = DecodeLinear
            n += 1
        elif type(module) is nn.Embedding:
            module.__class__ = DecodeEmbedding
            n += 1
    return n
