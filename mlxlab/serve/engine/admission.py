"""Memory admission: the longest context the memory budget can hold, computed before any work.

bytes(T) = weights + reserve + T * (full-attention KV per token + attention scores per token)
           + sum over sliding layers of min(T, window) * KV per token

KV bytes per token are measured per layer from mlx-lm's own cache after a one-token forward (so
every family, dtype and KV-sharing scheme is counted as it really allocates): full-attention
layers grow with the context, sliding-window layers stop at their window. The attention scores
of one prefill chunk (heads x chunk x T x 4 bytes) grow with T too. A request whose prompt +
max_tokens exceeds the ceiling is refused with 400 before it is queued; the allocator is capped
at the budget as a second line of defence (`mx.set_memory_limit`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from mlxlab.runtime import total_memory_bytes

RESERVE_BYTES = 256 * 2**20  # interpreter, MLX buffers, one chunk's activations


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
    max_safe_context: int
    rejected: int = 0  # requests `check` refused

    def bytes_for(self, tokens: int) -> int:
        return self.bytes_for_rows([tokens])

    def bytes_for_rows(self, lengths: list[int], copies: int = 0) -> int:
        """Bytes for a batch of rows that will reach these lengths (prompt + max_tokens each), plus
        `copies` transient copies of a row's cache (a batch cache is padded to its longest row)."""
        t = max(lengths, default=0)
        per_row = (
            t * (self.full_kv_bytes_per_token + self.score_bytes_per_token)
            + min(t, self.sliding_window) * self.sliding_kv_bytes_per_token
        )
        return self.weights_bytes + RESERVE_BYTES + (len(lengths) + copies) * per_row

    def fits_rows(self, lengths: list[int], copies: int = 0) -> bool:
        return self.bytes_for_rows(lengths, copies) <= self.budget_bytes

    def check(self, prompt_tokens: int, max_tokens: int) -> str | None:
        """None when the request fits, else the reason."""
        need = prompt_tokens + max_tokens
        if need > self.max_safe_context:
            self.rejected += 1
            return (
                f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) = {need} exceeds the "
                f"max safe context of {self.max_safe_context} tokens under the memory budget of "
                f"{self.budget_bytes / 1e9:.2f} GB; lower max_tokens or shorten the prompt"
            )
        return None

    def stats(self) -> dict:
        d = asdict(self)
        d["memory_budget_bytes"] = self.budget_bytes if self.explicit_budget else None
        d["usable_bytes"] = max(self.budget_bytes - self.weights_bytes - RESERVE_BYTES, 0)
        return d


def measure(
    model, budget_bytes: int | None, prefill_step: int, kv=None, extra_bytes: int = 0
) -> Admission:
    """Measure the model's memory terms and solve for the max safe context (`kv`: a KVQuant plan;
    `extra_bytes`: resident weights outside `model`, such as a VLM's vision tower)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache, make_prompt_cache

    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters())) + extra_bytes
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
    explicit = budget_bytes is not None
    budget = int(budget_bytes if explicit else 0.75 * total_memory_bytes())
    adm = Admission(budget, explicit, weights, full, sliding, window, score, context, 0)
    lo, hi = 0, 1 << 24
    while lo < hi:  # the largest T with bytes_for(T) <= budget
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if adm.bytes_for(mid) <= budget else (lo, mid - 1)
    adm.max_safe_context = min(lo, context) if context else lo
    return adm
