"""Decoding a list of prompts to the end, in batches: what a task's evaluation and GRPO's rollouts
call (`complete`), on the batched decoder (batch.py) or, one prompt at a time, the serial path
(serial.py)."""

from __future__ import annotations

import time
from collections.abc import Callable

from mlxlab.decode.batch import BatchDecoder, Row
from mlxlab.decode.prompt_cache import PromptCache
from mlxlab.decode.serial import run_serial
from mlxlab.decode.settings import DecodeSettings

HEARTBEAT_S = 60.0
"""A batched group still calls `progress` at least this often (its rows finished so far), so a
long evaluation prints a line a minute."""

NAMESPACE = "offline"
"""The prompt-cache namespace of `complete`'s rows (one model, no per-row adapters)."""


def reuse_budget() -> int:
    """The bytes of prompt KV worth keeping for a second decode of the same prompts: a quarter
    of the machine's memory, at most 4 GiB. gemma3-270m holds at most ~37 KB per prompt token in
    float32 (18 layers, one KV head of 256; prefilled in steps, its sliding-window layers keep at
    most their window plus a step of it)."""
    from mlxlab.runtime import total_memory_bytes

    return min(4 << 30, total_memory_bytes() // 4)


def complete(
    model,
    tokenizer,
    prompts: list[list[int]],
    max_tokens: int,
    batch_size: int,
    progress: Callable[[int, int], None] | None = None,
    processors: Callable[[int], list] | None = None,
    sampler=None,
    cache: PromptCache | None = None,
    prefill_step: int | None = None,
    tokens: bool = False,
    speculative: str = "off",
    draft_tokens: int = 8,
    draft_model=None,
    counts=None,
) -> list:
    """Completions of token-id prompts, in order (texts; with `tokens`, the token ids): greedy,
    or drawn by `sampler` (mlx-lm's `make_sampler`; seed MLX's generator first for a repeatable
    draw).

    batch_size > 1 decodes groups of `batch_size` prompts of similar length together on the
    batched decoder (mlx-lm's `BatchGenerator` schedule: prefill 8 rows at a time, right-padded,
    so a text can differ from its unbatched decode in rare near-ties); batch_size = 1 runs the
    serial path one prompt at a time. `processors(i)`, when given, returns prompt i's logits
    processors (fresh ones: a constraint holds its sequence's state), made when its group
    starts. `cache`: each prompt's KV but its last token is stored there as it is prefilled
    (never evicting: every decode walks the prompts in the same order, so the first ones stored
    stay and are reused by every decode after), and a prompt found there starts from it: a
    second decode of the same prompts skips their prefill. `speculative` (off | prompt_lookup |
    draft_model, with `draft_model` the model) drafts up to `draft_tokens` tokens a step and
    verifies them in one forward pass (decode/speculative.py); `counts` (a
    `speculative.Counts`), when given, adds up the drafted and accepted tokens. The model
    decodes in eval mode (no dropout) and is put back as it was."""
    from mlxlab.decode.settings import PREFILL_STEP

    settings = DecodeSettings(
        prefill_step=prefill_step or PREFILL_STEP,
        batch=max(batch_size, 1),
        prefill_batch=8,
        speculative=speculative,
        draft_tokens=draft_tokens,
    )
    eos = set(tokenizer.eos_token_ids)
    out: list = [None] * len(prompts)
    was_training = model.training
    model.eval()
    try:
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        done = 0
        for at in range(0, len(order), settings.batch):
            group = order[at : at + settings.batch]
            rows = [_row(prompts[i], max_tokens, i, out, eos, sampler, processors) for i in group]
            if batch_size == 1:
                run_serial(model, rows[0], settings, cache, evict=False, draft_model=draft_model)
            else:
                decoder = BatchDecoder(
                    model, eos, settings, cache, evict=False, draft_model=draft_model
                )
                for row in rows:
                    decoder.add(row)
                beat = time.monotonic()
                while decoder.active:
                    decoder.step()
                    if progress and time.monotonic() - beat >= HEARTBEAT_S:
                        beat = time.monotonic()
                        progress(done + len(group) - len(decoder.rows), len(prompts))
            if counts is not None:
                for row in rows:
                    if row.speculation is not None:
                        counts.add(row.speculation)
            done += len(group)
            if progress:
                progress(done, len(prompts))
    finally:
        model.train(was_training)
    return out if tokens else [tokenizer.decode(t) for t in out]


def _row(prompt, max_tokens, i, out, eos, sampler, processors) -> Row:
    def feed(token, logprobs):
        return "stop" if token in eos else None

    def done(finish, tokens):  # without the end-of-sequence token, as mlx-lm's batch_generate
        out[i] = list(tokens[:-1] if finish == "stop" and tokens and tokens[-1] in eos else tokens)

    return Row(
        list(prompt),
        max_tokens,
        feed,
        done,
        sampler=sampler,
        processors=processors(i) if processors else [],
        namespace=NAMESPACE,
        store_completion=False,
    )
