"""`python -m mlxlab diag`'s config (registered here: mlxlab/registry.py imports this provider)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from mlxlab import registry
from mlxlab.config import (
    BACKWARD_MODES,
    DECODE_HEADS,
    DEFAULT_MODEL,
    DTYPES,
    DPOConfig,
    ORPOConfig,
)
from mlxlab.errors import UserError
from mlxlab.schema import check_choice

MEMORY_MODES = (
    "full",
    "checkpoint",
    "segN",
    "segNhC",
    "auto",
    "mlx_lm",
    "mlx_lm_gc",
    "dpo-MODE",
    "orpo-MODE",
)
"""`diag memory` modes; segN is seg1, seg2, ... (segments of N layers); dpo-MODE / orpo-MODE:
a preference step (one pair, each side as long as the length) in mlxlab's MODE."""


def is_memory_mode(mode) -> bool:
    """Whether `mode` is one of MEMORY_MODES (segN: seg1, seg2, ...; segNhC: the loss head in
    chunks of C positions, e.g. seg2h256; dpo-seg4, orpo-full: a preference step)."""
    if isinstance(mode, str) and mode.startswith(("dpo-", "orpo-")):
        mode = mode.split("-", 1)[1]
        if mode.startswith("mlx_lm"):
            return False
    return isinstance(mode, str) and (
        mode in ("full", "checkpoint", "auto", "mlx_lm", "mlx_lm_gc")
        or re.fullmatch(r"seg[1-9]\d*(h[1-9]\d*)?", mode) is not None
    )


@dataclass
class DiagConfig:
    """`python -m mlxlab diag parity|leak|memory|decode|profile`: numerics, memory and speed
    harnesses."""

    action: str = "parity"
    """parity | leak | memory | decode | profile."""
    model: str = DEFAULT_MODEL
    """Zoo name, mlx-lm model directory, or .gguf file."""
    dtype: str = "auto"
    """Compute dtype for both sides: auto, float32, bfloat16, float16."""
    adapter: str | None = None
    """parity: adapter to compare (default: a seeded random one, saved in mlx-lm's layout);
    decode: an adapter to profile the step with."""
    length: int = 64
    """Tokens per test sequence (parity, leak, profile); decode: tokens of context before the
    steps."""
    batch_size: int = 2
    """profile: rows in the profiled training batch."""
    trained: float = 0.25
    """profile: the trained (response) fraction of each row, at its end."""
    steps_timed: int = 2
    """profile: timed runs of the step and of each part (the median is reported)."""
    segment_sizes: list[int] = field(default_factory=lambda: [1, 2, 4])
    """parity: segment sizes checked against the full backward."""
    max_ulp: int = 0
    """parity gate: pass when within this many ulps (0: bit-exact only)."""
    max_rel: float = 1e-6
    """parity gate: or when ||ours - theirs|| / ||theirs|| is at most this."""
    perturb_grads: float = 0.0
    """parity self-test: add this relative noise to our gradients (the gate must then fail)."""
    mode: str = "segmented"
    """leak, profile: backward mode (full | checkpoint | segmented)."""
    segment_size: int = 4
    """leak, profile: layers per segment."""
    steps: int = 120
    """leak: optimizer steps."""
    warmup: int = 20
    """leak: steps ignored before fitting the slope."""
    threshold_mb: float = 1.0
    """leak: fail when active memory grows faster than this (MB/step)."""
    lengths: list[int] = field(default_factory=lambda: [256, 512])
    """memory: sequence lengths to sweep."""
    modes: list[str] = field(
        default_factory=lambda: ["full", "checkpoint", "seg1", "seg4", "mlx_lm", "mlx_lm_gc"]
    )
    """memory: modes (full checkpoint segN auto mlx_lm mlx_lm_gc)."""
    decode_steps: int = 16
    """decode: steps timed (the median is reported)."""
    speculative: str = "off"
    """decode: with prompt_lookup, also profile speculative decoding: a verify step's cost by
    draft length against a plain step's, its logits against the plain steps' (top-1 agreement,
    near ties), and a decode of a text that repeats itself (tok/s, drafted and accepted)."""
    draft_tokens: int = 8
    """decode: the longest draft verified (speculative)."""
    decode_head: str = "auto"
    """decode: what the LM head reads at decode on the CPU: auto (a bf16 copy, read with float32 sums,
    when that is lossless, as for zoo models: half the bytes of the step's largest read, for
    half the head's size in memory), exact (the weight), or bfloat16 (the copy even where it
    rounds: opt-in, approximate; `diag decode decode_head=bfloat16` measures it)."""
    lora_type: str = "lora"
    """parity, memory: lora | dora | full (what is trained: mlx-lm's LoRALinear, its
    DoRALinear, or the projections' own weights; parity's random adapter is of this kind)."""
    objective: str = "sft"
    """parity: the loss checked: sft (against mlx-lm's default_loss), dpo or orpo (on one pair,
    against a straightforward implementation on mlx-lm's model: per-token log-probs from its
    __call__, the published formulas, mx.value_and_grad)."""
    dpo: DPOConfig = field(default_factory=DPOConfig)
    orpo: ORPOConfig = field(default_factory=ORPOConfig)
    out: str = "diag"
    """Report path prefix: <out>_<action>.json (and .png); an existing directory:
    <out>/<action>.json. Checked before the run."""

    def __post_init__(self):
        check_choice(
            "action", self.action, ("parity", "leak", "memory", "decode", "profile"), "diag action"
        )
        check_choice("objective", self.objective, ("sft", "dpo", "orpo"))
        check_choice("lora_type", self.lora_type, ("lora", "dora", "full"))
        if self.batch_size < 1 or self.steps_timed < 1:
            raise UserError("batch_size and steps_timed must be >= 1")
        if not 0.0 < self.trained <= 1.0:
            raise UserError(f"trained must be in (0, 1], got {self.trained}")
        check_choice("decode_head", self.decode_head, DECODE_HEADS)
        check_choice("dtype", self.dtype, DTYPES)
        check_choice("mode", self.mode, BACKWARD_MODES)
        for mode in self.modes:
            if not is_memory_mode(mode):
                check_choice("modes", mode, MEMORY_MODES, "memory mode")
        if self.length < 4:
            raise UserError(f"length must be >= 4, got {self.length}")
        if self.decode_steps < 1:
            raise UserError(f"decode_steps must be >= 1, got {self.decode_steps}")
        check_choice("speculative", self.speculative, ("off", "prompt_lookup"))
        if not 1 <= self.draft_tokens <= 15:
            raise UserError(f"draft_tokens must be in [1, 15], got {self.draft_tokens}")
        if self.steps <= self.warmup + 2:
            raise UserError(f"steps ({self.steps}) must exceed warmup ({self.warmup}) by 3 or more")


registry.command("diag", DiagConfig)
