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
        if cache is not None:  # best effort (`store`): a failed checkpoint costs a later hit
            cache.store(row.namespace, row.prompt[:stop], kv, kind=kind, evict=evict)
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
    if _greedy_without_logprobs(row, kv):
        steps = _greedy_steps(model, row.prompt[end:], kv, row.max_tokens)
    else:
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
        # Best effort (`store`): the answer is whole and its `done` called.
        cache.store(row.namespace, row.prompt + row.tokens, kv, copy_cache=False, evict=evict)
    return finish


# --- greedy rows that ask for no logprobs -------------------------------------------------------


def _greedy_without_logprobs(row: Row, kv) -> bool:
    """Whether `_greedy_steps` may decode `row`: greedy (mlx-lm's `greedy_sampler`), no logits
    processors, a feed that reads no logprobs, and a KV cache of mlx-lm's trimmable kinds (the
    one-token undo of `_greedy_steps`)."""
    from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache
    from mlx_lm.sample_utils import greedy_sampler

    return (
        (row.sampler is None or row.sampler is greedy_sampler)
        and not row.processors
        and not row.logprobs
        and all(type(c) in (KVCache, RotatingKVCache, QuantizedKVCache) for c in kv)
    )


SAFE_MARGIN = 2.0
"""A step's argmax(logits) is taken as its greedy token when its logit is >= ln(V) + this."""


def _argmax(logits):
    import mlx.core as mx

    return mx.argmax(logits, axis=-1)


def _greedy_steps(model, last: list[int], kv, max_tokens: int):
    """mlx-lm's `generate_step` for a greedy row without logits processors whose logprobs nobody
    reads: the same forward passes in the same order (each step queued before the previous
    token is read, the cache ending with the same tokens), yielding (token, None), the token
    taken as argmax(logits) instead of argmax(logits - logsumexp(logits)).

    The logsumexp is a pass of exp over the vocabulary (~3 ms a token for gemma3-270m's 262,144
    on the 2-core box, MLX's CPU exp being scalar), which greedy decoding needs only for its
    rounding: argmax over fl(x - c) equals argmax over x whenever the top logit m is finite and
    m >= ln(V) + 2 with every logit finite. (c = logsumexp lies in [m, m + ln V + tiny], so
    c / 2 < m: by Sterbenz x - c is exact for every x in [c / 2, m], so those keep their order
    and their ties; any x < c / 2 gives fl(x - c) <= -c / 2 < m - c. The set of maximal
    positions is the same, hence the argmax.) Each step checks that condition with its token;
    a step that fails it takes the exact token from its logits, and from then on every step of
    the row is computed as generate_step computes it. If the exact token differs from the one
    the next step was already queued with, that step is undone (its cache entry trimmed: a
    one-token update only moved the offset and wrote one slot, which the redone step writes
    again) and queued again with the exact token."""
    import math

    import mlx.core as mx
    from mlx_lm.generate import generation_stream

    exact = False

    def step(tokens: mx.array):
        logits = model(tokens[None], cache=kv)[:, -1, :]
        if exact or logits.dtype != mx.float32:
            logprobs = logits - mx.logsumexp(logits, keepdims=True)
            return mx.argmax(logprobs, axis=-1), None
        token = _argmax(logits)
        top = mx.take_along_axis(logits, token[:, None], axis=-1)
        safe = (top >= math.log(logits.shape[-1]) + SAFE_MARGIN) & mx.isfinite(mx.sum(logits))
        return token, (logits, safe)

    def queue(tokens: mx.array):
        y, check = step(tokens)
        mx.async_eval(y, *(() if check is None else (check[1],)))
        return y, check

    with mx.stream(generation_stream):
        y, check = queue(mx.array(last))
        n = 0
        while True:
            if n != max_tokens:
                next_y, next_check = queue(y)
            if n == max_tokens:
                break
            token = y.item()
            if check is not None and not check[1].item():
                exact = True
                logits = check[0]
                logprobs = logits - mx.logsumexp(logits, keepdims=True)
                sure = mx.argmax(logprobs, axis=-1).item()
                if sure != token:  # the queued step read the wrong token: undo, redo
                    mx.eval(next_y)
                    for c in kv:
                        c.trim(1)
                    token, y = sure, mx.array([sure])
                    next_y, next_check = queue(y)
            yield token, None
            if n % 256 == 0:
                mx.clear_cache()
            y, check = next_y, next_check
            n += 1
