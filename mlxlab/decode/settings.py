"""The decoder's own settings (what `serve` and the tasks' evaluations set, each from their own
config)."""

from __future__ import annotations

from dataclasses import dataclass

from mlxlab.errors import UserError

PREFILL_STEP = 512
"""Prompt tokens per forward pass of a prefill, by default. Measured on the 2-core CPU,
gemma3-270m, random 1,400-token prompts: one row 326 tok/s at 512 against 230 at mlx-lm's 2048
(1,000 tokens: 294 against 267); 32 rows batched 232 against 183, the decode steps after it
unchanged (650 ms at 32 rows)."""


@dataclass(frozen=True)
class DecodeSettings:
    prefill_step: int = PREFILL_STEP
    """Prompt tokens per prefill forward pass."""
    batch: int = 1
    """Rows decoded together at most (1: the serial path, one row at a time)."""
    prefill_batch: int = 8
    """Rows whose prompts are prefilled together at most (mlx-lm's prefill_batch_size)."""
    speculative: str = "off"
    """off | prompt_lookup | draft_model: draft tokens and verify them in one forward pass
    (decode/speculative.py); a draft model is handed to the decoder beside these settings."""
    draft_tokens: int = 8
    """Draft tokens verified in one forward pass at most."""

    def __post_init__(self):
        from mlxlab.decode.speculative import MODES

        if self.speculative not in MODES:
            raise UserError(
                f"speculative must be one of {', '.join(MODES)}, got {self.speculative!r}"
            )
        if not 1 <= self.draft_tokens <= 15:
            raise UserError(f"draft_tokens must be in [1, 15], got {self.draft_tokens}")
        if self.prefill_step < 1 or self.batch < 1 or self.prefill_batch < 1:
            raise UserError(
                "prefill_step, batch and prefill_batch must be >= 1, got "
                f"{self.prefill_step}, {self.batch} and {self.prefill_batch}"
            )
