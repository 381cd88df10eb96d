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
bits (~1e-6 relative) and greedy tokens match (tests); up to MAX_ROWS rows, each row's result
does not depend on how many rows are decoded together (past it, BLAS's does).

The LM head, two thirds of gemma3-270m's bytes, may be read from a bfloat16 copy
(`use_head_dtype`, `decode_head=` on `generate`, `serve` and `diag decode`): by default only
when that is lossless, as it is for every zoo model (their weights are stored in bf16 and cast
up), so the logits stay bit-identical; forced (`decode_head=bfloat16`), it is the one
approximate option, opt-in, and `diag decode` measures its logit KL and top-1 agreement. Every
other decode linear reads a bf16 copy too wherever that is lossless (not under `exact`): a
gemma3-270m step then reads ~536 MB instead of ~750 with bit-identical logits, for ~536 MB of
copies held beside the float32 weights (which prefill and training keep reading).

Compiling the RMS norms of a decode step (`mx.compile`, ~4x faster per norm in isolation) was
tried and measured no faster end to end: the compiled call's Python overhead eats the gain.
"""

from __future__ import annotations

import contextlib
import logging

import mlx.core as mx
import mlx.nn as nn

from mlxlab import kernels

log = logging.getLogger(__name__)

MAX_ROWS = 8 if kernels.matvec_avx512() else 4
"""Decode rows up to which products go to the kernel: the rows it takes in one pass over a
weight row, so a batch of that many reads the (bf16 copies of the) weights once, as one row
does. 8 where it runs its AVX-512 loops (`kernels.matvec_avx512`, read at import), 4 with its
other loops (AVX2+FMA): past a pass the weights would be read again, and the 8-row win below was
measured with AVX-512 only. Measured 2026-12-06 on the 2-core box (AVX-512) while other jobs
loaded it (experiments/grpo/README.md, "Rollout step profile"): GRPO's rollout of 8 rows ran
5.7x faster with up to 8 rows on the kernel than with up to 4 (BLAS then taking the 8-row
steps: the float32 head and OpenBLAS's threads, which stall when the cores are
oversubscribed), 2.95x against the serial path instead of 0.52x. Earlier, on a quiet box with
float32 weights and before the 8-row pass, a 2048 x 640 projection at 8 rows took 0.55 ms on
BLAS against 1.22 on the kernel: re-measure quiet before raising this further."""


VERIFY_ROWS = 16
"""Rows (tokens, over every row of the batch) up to which a verify step's products go to the
kernel (`verifying`): a speculative step checks k draft tokens per row in one forward pass, and
BLAS's many-row path for those few rows reads the weights at a fraction of the bandwidth. The
kernel's AVX-512 loops take 8 rows per pass over a weight row (its AVX2 loops 4). Measured on
the 2-core box, nearly idle (`experiments/speculative/verify_cost.py`), a step still grows with
its rows: one row x 5 tokens ~1.5x a plain step, 4 rows x 4 tokens ~2.4x, and just past this
bound (4 x 5) ~3.4x; the batched lane's draft length weighs those costs
(`decode/speculative_batch.py` `STEP_COST`)."""

_verify_rows = 0  # > 0 inside `verifying`


@contextlib.contextmanager
def verifying(rows: int | None = None):
    """Within the block, products of up to `rows` rows go to the kernel whatever their tokens per
    row (a verify step's [B, k + 1] inputs); outside, only one token per row does. The kernel's
    sum for each row is the same whatever rows it is computed with, so a verified token's
    products equal a plain step's bit for bit."""
    global _verify_rows
    before, _verify_rows = _verify_rows, rows or VERIFY_ROWS
    try:
        yield
    finally:
        _verify_rows = before


def _one_token_rows(x: mx.array) -> bool:
    if x.ndim < 3 or x.shape[-1] == 0 or mx.default_device() != mx.cpu:
        return False
    rows = x.size // x.shape[-1]
    if x.shape[-2] == 1 and rows <= MAX_ROWS:
        return True
    return rows <= _verify_rows


def _kernel_applies(x: mx.array, w: mx.array):
    matvec = kernels.matvec()
    if (
        matvec is not None
        and x.dtype == mx.float32
        and w.dtype in (mx.float32, mx.bfloat16)
        and _one_token_rows(x)
    ):
        return matvec
    return None


class _DecodeWeight:
    """Mixed into the decode modules: the weight a decode-step product reads. That is the
    module's own weight unless `use_head_dtype` gave it a bf16 copy; the copy is dropped when
    the weight it was made from is replaced (a new array, as `load_weights`/`update` set; an
    in-place `w[...] = v` on the weight is not seen: call `use_head_dtype` again after one)."""

    def _decode_weight(self) -> mx.array:
        w = self["weight"]
        copy = self.__dict__.get("_decode_copy")
        if copy is not None:
            if copy[0] is w:
                return copy[1]
            object.__setattr__(self, "_decode_copy", None)
        return w

    def _set_copy(self, copy) -> None:
        object.__setattr__(self, "_decode_copy", copy)


class DecodeLinear(_DecodeWeight, nn.Linear):
    """nn.Linear whose decode-step products go through the CPU kernel."""

    def __call__(self, x):
        w = self._decode_weight()
        if matvec := _kernel_applies(x, w):
            y = matvec(x, w)
            return y + self["bias"] if "bias" in self else y
        return super().__call__(x)


class DecodeEmbedding(_DecodeWeight, nn.Embedding):
    """nn.Embedding whose use as a tied LM head goes through the CPU kernel at decode."""

    def as_linear(self, x):
        w = self._decode_weight()
        if matvec := _kernel_applies(x, w):
            return matvec(x, w)
        return super().as_linear(x)


HEAD_MODES = ("auto", "exact", "bfloat16")


def lm_head(model):
    """The module whose weight is the LM head (`lm_head`, or else the tied `embed_tokens`,
    wherever they sit in the model), or None for a model that names them otherwise."""
    modules = dict(model.named_modules())
    for suffix in ("lm_head", "embed_tokens"):
        for name, module in modules.items():
            if name == suffix or name.endswith("." + suffix):
                return module
    return None


def _fits_bfloat16(w: mx.array, rows: int = 16384) -> bool:
    """Every value of `w` is a bfloat16 value (true of float32 weights upcast from bf16)."""
    for at in range(0, w.shape[0], rows):
        part = w[at : at + rows]
        if not mx.array_equal(part, part.astype(mx.bfloat16).astype(w.dtype)).item():
            return False
    return True


def _decode_copy(w: mx.array, rounded: bool):
    """(whether `w` is lossless in bfloat16, (w, its evaluated bfloat16 copy) or None): a copy
    when lossless, or when `rounded` (the head under decode_head=bfloat16)."""
    lossless = _fits_bfloat16(w)
    if not (lossless or rounded):
        return lossless, None
    copy = w.astype(mx.bfloat16)
    mx.eval(copy)
    return lossless, (w, copy)


def bf16_sources(model) -> dict[str, mx.array]:
    """Before a model is cast up to float32 (`set_dtype`): name -> weight of each module that
    gets a decode copy (`use_head_dtype`: every exact nn.Linear, and the LM head, `lm_head`, a
    tied nn.Embedding included) whose weight is stored in bfloat16. An embedding that is not
    the head (a model with an untied `lm_head`) gets no copy, so its array is not kept here: it
    would stay alive until the load returns, and an unpaced load would read it, for nothing
    (vocabulary x hidden size x 2 bytes). Handed to `use_head_dtype` (`sources`), each is the
    module's decode copy as it is: its float32 weight is this array cast up, so the copy is
    lossless by construction (no check), and evaluated with the weights it costs no cast
    (measured on gemma3-270m's paced load: the check and the cast were 2.6 s of the engine
    thread's 3.9 s; experiments/serving/several_models.md)."""
    head = lm_head(model)
    return {
        name: module["weight"]
        for name, module in model.named_modules()
        if (type(module) is nn.Linear or (module is head and type(module) is nn.Embedding))
        and "weight" in module
        and module["weight"].dtype == mx.bfloat16
    }


def use_head_dtype(model, mode: str, pace=None, sources: dict | None = None) -> str:
    """What the decode-step products read: each module's own weight, or a bfloat16 copy that the
    kernel reads with float32 sums. The float32 weights stay for prefill, the embedding and
    training, so a copy costs half its weight's size in memory (`decode_copies` says how much).

    The LM head:
    - `exact`: the weight itself.
    - `auto`: the copy when it is lossless (every weight is a bf16 value, as in a float32 model
      cast from bf16 weights: then the logits are bit-identical to the weight's), else the weight.
    - `bfloat16`: the copy whatever it rounds (opt-in, approximate; `diag decode` measures it).

    Every other decode linear (the projections) reads a copy under `auto` and `bfloat16` where
    that copy is lossless, never a rounded one: for a zoo model the step then reads bf16 bytes
    throughout with bit-identical logits (gemma3-270m: ~750 -> ~540 MB a step).

    Returns the head's: "exact", "bfloat16 (lossless)" or "bfloat16 (rounded)"; "exact" also
    when the kernel is not in use. `pace`: runs each module's check and copy (`pace(fn)`, a
    paced load: zoo.load) where MLX may evaluate; without it they run here. `sources`: name ->
    the bfloat16 array a module's float32 weight was cast up from (`bf16_sources`): that array
    is its copy, lossless without a check."""
    if mode not in HEAD_MODES:
        raise ValueError(f"unknown decode head {mode!r}; choose one of {', '.join(HEAD_MODES)}")
    # On a GPU the kernel never runs (mlx-lm's path does), so a copy would only cost memory.
    on_cpu = mx.default_device() == mx.cpu
    head = lm_head(model)
    used = "exact"
    sources = sources or {}
    sourced = []  # the copies taken from `sources`
    for name, module in model.named_modules():
        # an embedding that is not the head keeps no copy (its lookups read a row)
        if not isinstance(module, _DecodeWeight) or (
            module is not head and not isinstance(module, DecodeLinear)
        ):
            continue
        w = module["weight"]
        copy = None
        if mode != "exact" and on_cpu and w.dtype == mx.float32:
            rounded = mode == "bfloat16" and module is head
            source = sources.get(name)
            if source is not None and source.shape == w.shape:
                lossless, copy = True, (w, source)  # evaluated below, all at once
                sourced.append(source)
            else:
                work = lambda w=w, rounded=rounded: _decode_copy(w, rounded)  # noqa: E731
                lossless, copy = pace(work) if pace is not None else work()
            if copy is not None and module is head:
                used = "bfloat16 (lossless)" if lossless else "bfloat16 (rounded)"
        if module is head:
            object.__setattr__(module, "_head_mode", used)
            module._set_copy(copy)
        elif isinstance(module, DecodeLinear):
            module._set_copy(copy)
    if sourced:  # read with the weights already in a paced load: one slice, no work left
        work = lambda: mx.eval(sourced)  # noqa: E731
        pace(work) if pace is not None else work()
    return used


def head_reads(model) -> str:
    """What `model`'s LM head reads at decode now (see `use_head_dtype`)."""
    module = lm_head(model)
    if not isinstance(module, _DecodeWeight) or module._decode_weight() is module["weight"]:
        return "exact"
    return module.__dict__.get("_head_mode", "exact")


def decode_copies(model) -> dict:
    """The bf16 copies decode steps read now: how many modules (`head`: whether the LM head is
    one of them), the bytes they hold beside the float32 weights (their memory cost), and the
    bytes a decode step reads from weights (a tied head counted once as the head; an embedding
    lookup reads a row, not counted)."""
    head = lm_head(model)
    n, extra, step = 0, 0, 0
    for _, module in model.named_modules():
        if not isinstance(module, _DecodeWeight):
            continue
        read = module._decode_weight()
        if read is not module["weight"]:
            n += 1
            extra += read.nbytes
        if isinstance(module, DecodeLinear) or module is head:
            step += read.nbytes
    return {
        "copies": n,
        "head": head is not None and head_reads(model) != "exact",
        "copy_bytes": extra,
        "step_weight_bytes": step,
    }


def accelerate(model) -> int:
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
