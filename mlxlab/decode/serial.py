"""The serial path: one row at a time on mlx-lm's `generate_step`, with the prompt cache.

It prefills all but the last prompt token itself, in steps, so it can store prompt-cache
checkpoints (the row's `checkpoint`, the end of its prompt) and stop a cancelled row within a
step, then hands the last token to `generate_step`. A finished row also stores prompt +
completion (the cache then holds exactly those tokens: `generate_step` feeds each token as it
computes the next).

Why a second path beside the batched decoder (batch.py): it serves what a batch cannot. An
explicit seed needs the global random state to itself; repetition, presence and frequency
penalties read a token history, which here is the row's own tokens (in a batch it starts with
the cached prompt); a quantized KV cache cannot be merged into a batch; and mlx-vlm's image
requests run its own `generate_step` on this path (serve/engine/vision.py). It is also mlx-lm's
reference loop, the one the batched decoder's tokens are held to.
"""

from __future__ import annotations

from mlxlab.decode import speculative
from mlxlab.decode.batch import Row, prompt_pieces
from mlxlab.decode.prompt_cache import PromptCache, prefill
from mlxlab.decode.settings import DecodeSettings


def run_serial(
    model,
    row: Row,
    settings: DecodeSettings,
    cache: PromptCache | None = None,
    make_cache=None,
    evict: bool = True,
    draft_model=None,
) -> str:
    """Decode `row` to its end; its `done` is called with the finish reason, which is returned.
    `make_cache(model)`: the row's KV cache when the prompt cache has none (a quantized one);
    default mlx-lm's `make_prompt_cache`. With `settings.speculative` on, the tokens after the
    prompt come from `speculative.run` (drafts verified k at a time; `draft_model` for
    speculative=draft_model) instead of generate_step, the row's `speculation` counting them."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    cache = cache if cache is not None and cache.enabled and row.namespace is not None else None
    kv, cached = cache.fetch(row.namespace, row.prompt) if cache is not None else (None, 0)
    if kv is None:
        kv = (make_cache or make_prompt_cache)(model)
    row.cached = cached
    if row.started is not None:
        row.started(cached)
    *pieces, (end, _, _) = prompt_pieces(row.prompt, cached, row.checkpoint)
    for start, stop, kind in pieces:
        if not prefill(model, kv, row.prompt[start:stop], settings.prefill_step, row.cancelled):
            row.done("cancelled", row.tokens)
            return "cancelled"
        if cache is not None:
            cache.insert(row.namespace, row.prompt[:stop], kv, kind=kind, evict=evict)
    if row.cancelled():
        row.done("cancelled", row.tokens)
        return "cancelled"
    if settings.speculative != "off":
        drafter = speculative.make_drafter(
            settings.speculative,
            settings.draft_tokens,
            row.processors,
            draft_model,
            settings.prefill_step,
        )
        row.speculation = drafter.counts
        finish = speculative.run(model, row, kv, drafter, row.prompt[end])
        return _finish(row, finish, cache, speculative.compact(kv), evict)
    steps = generate_step(
        mx.array(row.prompt[end:]),
        model,
        max_tokens=row.max_tokens,
        sampler=row.sampler,
        logits_processors=row.processors,
        prompt_cache=kv,
        prefill_step_size=settings.prefill_step,
    )
    finish = None
    for token, logprobs in steps:
        row.tokens.append(int(token))  # in the cache already (one ahead)
        finish = row.feed(int(token), logprobs)
        if finish:
            break
    steps.close()
    finish = finish or "length"  # generate_step ended the loop at max_tokens
    return _finish(row, finish, cache, kv, evict)


def _finish(row: Row, finish: str, cache, kv, evict: bool) -> str:
    row.done(finish, row.tokens)
    if finish != "cancelled" and cache is not None and row.store_completion:
        # The cache holds prompt + every token generated (each was fed as the next was computed).
        cache.insert(row.namespace, row.prompt + row.tokens, kv, copy_cache=False, evict=evict)
    return finish
