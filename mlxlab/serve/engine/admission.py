"""Memory admission: the longest context the memory budget can hold, computed before any work.

bytes(T) = weights + others + reserve + T * (full-attention KV per token + attention scores per token)
           + sum over sliding layers of min(T, window) * KV per token

KV bytes per token are measured per layer from mlx-lm's own cache after a one-token forward (so
every family, dtype and KV-sharing scheme is counted as it really allocates): full-attention
layers grow with the context, sliding-window layers stop at their window. The attention scores
of one prefill chunk (heads x chunk x T x 4 bytes) grow with T too. `weights` are the model's
parameters, its decode copies (models/fastdecode.py) and anything else it keeps resident (a
VLM's vision tower); `others` what the rest of the server holds: the other loaded models'
weights (serve `models.NAME=`, engine/models.py), so a model's ceiling shrinks while others are
loaded. A request whose prompt + max_tokens exceeds the ceiling is refused with 400 before it is
queued; the allocator is capped at the budget as a second line of defence (`mx.set_memory_limit`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

from mlxlab.runtime import total_memory_bytes

RESERVE_BYTES = 256 * 2**20  # interpreter, MLX buffers, one chunk's activations


def budget_bytes(memory_budget_gb: float | None) -> int:
    """The server's memory budget: `serve.memory_budget_gb`, else 75% of the machine's memory
    (every model's admission and the models' load plans read this one number)."""
    if memory_budget_gb:
        return int(memory_budget_gb * 1e9)
    return int(0.75 * total_memory_bytes())


def _nothing() -> int:
    return 0


@dataclass
class Admission:
    budget_bytes: int
    explicit_budget: bool
    weights_bytes: int
    full_kv_bytes_per_token: int
    sliding_kv_bytes_per_token: int
    sliding_window: int
    score_bytes_per_token: int
    model_context: int | None
    rejected: int = 0  # requests `check` refused

    def __post_init__(self):
        # What the rest of the server holds (bound by the engine: `bind`); not a field, so
        # `stats` sees only the model's own terms: bytes resident beside this model (the other
        # loaded or loading models' weights, engine/models.py).
        self.others: Callable[[], int] = _nothing

    def bind(self, others: Callable[[], int]) -> Admission:
        self.others = others
        return self

    def per_row_bytes(self, tokens: int) -> int:
        """KV and attention-score bytes of one row of `tokens` tokens."""
        return (
            tokens * (self.full_kv_bytes_per_token + self.score_bytes_per_token)
            + min(tokens, self.sliding_window) * self.sliding_kv_bytes_per_token
        )

    def kv_bytes(self, lengths: list[int], copies: int = 0) -> int:
        """KV bytes of a batch of rows that will reach these lengths, plus `copies` transient
        copies of a row's cache (a batch cache is padded to its longest row)."""
        if not lengths:
            return 0
        return (len(lengths) + copies) * self.per_row_bytes(max(lengths))

    def bytes_for(self, tokens: int) -> int:
        return self.bytes_for_rows([tokens])

    def bytes_for_rows(self, lengths: list[int], copies: int = 0) -> int:
        """Bytes in use with a batch of rows that will reach these lengths (prompt + max_tokens
        each) plus `copies` copies of a row's cache: the weights, everything else resident, the
        reserve and the rows' KV."""
        return self.resident_bytes() + RESERVE_BYTES + self.kv_bytes(lengths, copies)

    def resident_bytes(self) -> int:
        """This model's weights and the rest of the server's resident weights."""
        return self.weights_bytes + self.others()

    def fits_rows(self, lengths: list[int], copies: int = 0) -> bool:
        return self.bytes_for_rows(lengths, copies) <= self.budget_bytes

    @property
    def max_safe_context(self) -> int:
        """The longest context one request may have now: the largest T with bytes_for(T) within
        the budget (with every loaded model's weights counted), at most the model's own."""
        room = self.budget_bytes - self.resident_bytes() - RESERVE_BYTES
        lo, hi = 0, 1 << 24
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.per_row_bytes(mid) <= room else (lo, mid - 1)
        return min(lo, self.model_context) if self.model_context else lo

    def check(self, prompt_tokens: int, max_tokens: int) -> str | None:
        """None when the request fits, else the reason."""
        need = prompt_tokens + max_tokens
        ceiling = self.max_safe_context
        if need > ceiling:
            self.rejected += 1
            others = self.others()
            beside = (
                f" beside {others / 1e9:.2f} GB of other loaded models' weights" if others else ""
            )
            return (
                f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) = {need} exceeds the "
                f"max safe context of {ceiling} tokens under the memory budget of "
                f"{self.budget_bytes / 1e9:.2f} GB{beside}; lower max_tokens or shorten the prompt"
            )
        return None

    def stats(self) -> dict:
        d = asdict(self)
        d["max_safe_context"] = self.max_safe_context
        d["memory_budget_bytes"] = self.budget_bytes if self.explicit_budget else None
        d["other_models_bytes"] = self.others()
        d["usable_bytes"] = max(self.budget_bytes - self.resident_bytes() - RESERVE_BYTES, 0)
        return d


def measure(
    model, memory_budget_gb: float | None, prefill_step: int, kv=None, extra_bytes: int = 0
) -> Admission:
    """Measure the model's memory terms and solve for the max safe context under the budget
    (`budget_bytes(memory_budget_gb)`; `kv`: a KVQuant plan; `extra_bytes`: resident weights
    outside `model`, such as a VLM's vision tower)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache, make_prompt_cache

    from mlxlab.models.fastdecode import decode_copies

    # the parameters, the bf16 copies decode steps read beside them, and what else is resident
    params = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    weights = params + decode_copies(model)["copy_bytes"] + extra_bytes
    cache = kv.make_cache(model) if kv is not None else make_prompt_cache(model)
    model(mx.array([[0]]), cache=cache)
    mx.eval([c.state for c in cache])
    full = sliding = 0
    window = 0
    for c in cache:
        if not isinstance(c, (KVCache, RotatingKVCache, QuantizedKVCache)) or c.keys is None:
            continue
        parts = [*c.keys, *c.values] if isinstance(c.keys, tuple) else [c.keys, c.values]
        per_token = sum(a.nbytes for a in parts) // parts[0].shape[2]
        if isinstance(c, RotatingKVCache):
            sliding += per_token
            window = max(window, c.max_size)
        else:
            full += per_token
    args = getattr(model, "args", None)
    heads = getattr(args, "num_attention_heads", None) or 8
    score = heads * prefill_step * 4
    context = getattr(args, "max_position_embeddings", None)
    explicit = bool(memory_budget_gb)
    return Admission(
        budget_bytes(memory_budget_gb), explicit, weights, full, sliding, window, score, context
    )
