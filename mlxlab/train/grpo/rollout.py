"""Rollouts: `group_size` completions of each prompt, sampled on the batched decoder.

All of a batch's rows decode together on `decode.batch.BatchDecoder` (mlx-lm's batch classes,
continuous batching: a row that stops leaves, the others go on). With `share_prefill` each
prompt is prefilled once: the first row of every group is admitted alone and stores its prompt's
KV (all but the last token) in a prompt cache of this rollout; the group's other rows are added
once those are stored, start from a copy of it and run only the prompt's last token before they
sample. The cache lives for one rollout batch (the policy changes between batches).

Sampling draws from a key of its own (`KeyedSampler`: mlx-lm's top-p / top-k filters, then
`mx.random.categorical` with a key split off at every call), not MLX's global random state: the
key is part of the run's state (saved in checkpoints: data/prompts.py `PromptSampler`), so a
resumed run draws the completions the uninterrupted one drew.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

NAMESPACE = "grpo"
"""The prompt-cache namespace of a rollout's rows."""


class KeyedSampler:
    """A sampler (log-probs [B, V] -> tokens [B]) drawing with its own key: mlx-lm's top-p and
    top-k filters, then a categorical draw at `temperature`; every call splits the key."""

    def __init__(self, key: mx.array, temperature: float, top_p: float = 1.0, top_k: int = 0):
        self.key = key
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k

    def __call__(self, logprobs: mx.array) -> mx.array:
        from mlx_lm.sample_utils import apply_top_k, apply_top_p

        if 0 < self.top_p < 1.0:
            logprobs = apply_top_p(logprobs, self.top_p)
        if self.top_k > 0:
            logprobs = apply_top_k(logprobs, self.top_k)
        keys = mx.random.split(self.key)
        self.key = keys[0]
        return mx.random.categorical(logprobs * (1.0 / self.temperature), key=keys[1])


def step_key(key: list[int], rank: int = 0) -> tuple[list[int], mx.array]:
    """(the run's next key, this step's sampling key): the key is split once per rollout batch;
    a data-parallel rank folds its rank into the step's half, so ranks draw differently."""
    import numpy as np

    keys = mx.random.split(mx.array(np.asarray(key, np.uint32)))
    nxt, step = keys[0], keys[1]
    if rank:
        step = mx.random.split(step, rank + 1)[rank]
    mx.eval(nxt, step)
    return [int(x) for x in np.array(nxt)], step


@dataclass
class Completion:
    tokens: list[int]
    """What the policy generated, with the token that ended it (end-of-sequence or the one that
    completed a stop string): the trained tokens."""
    text: str
    """Its text for the rewards: without the end-of-sequence token, cut before a stop string."""
    finish: str
    """stop (end-of-sequence or a stop string) | length (max_tokens reached: truncated)."""


@dataclass
class RolloutStats:
    rows: int = 0
    prompts: int = 0
    prefill_tokens: int = 0
    """Prompt tokens run through the model (shared prefill: each prompt's once, plus its
    last token per row)."""
    completion_tokens: int = 0
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)


def _cut(text: str, stop: list[str]) -> tuple[str, bool]:
    at = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
    return (text[:at], True) if at >= 0 else (text, False)


def rollout(
    model,
    tokenizer,
    prompts: list[list[int]],
    group_size: int,
    max_tokens: int,
    sampler,
    stop: list[str] | tuple = (),
    share_prefill: bool = True,
    prefill_step: int | None = None,
    stats: RolloutStats | None = None,
) -> list[Completion]:
    """`group_size` completions of every prompt, prompt-major (prompt i's are at i * G ... i *
    G + G - 1). `sampler`: a KeyedSampler (or any mlx-lm sampler; greedy when None). The model
    decodes in eval mode (no dropout) and is put back as it was."""
    import time

    from mlxlab.decode.batch import BatchDecoder, Row
    from mlxlab.decode.offline import reuse_budget
    from mlxlab.decode.prompt_cache import PromptCache
    from mlxlab.decode.settings import PREFILL_STEP, DecodeSettings

    t0 = time.perf_counter()
    eos = set(tokenizer.eos_token_ids)
    stop = list(stop)
    n = len(prompts) * group_size
    settings = DecodeSettings(
        prefill_step=prefill_step or PREFILL_STEP, batch=max(n, 1), prefill_batch=max(n, 1)
    )
    out: list = [None] * n
    prefilled: list[int] = []  # prompt tokens each row ran (its prompt less what it found cached)
    cache = PromptCache(reuse_budget()) if share_prefill else None

    def row(i: int, j: int) -> Row:
        k = i * group_size + j
        text: list[str] = []

        def feed(token, _logprobs):
            if token in eos:
                return "stop"
            if stop:
                seen.append(token)
                text[:] = [tokenizer.decode(seen)]
                if _cut(text[0], stop)[1]:
                    return "stop"
            return None

        seen: list[int] = []

        def done(finish, tokens):
            body = tokens[:-1] if tokens and tokens[-1] in eos else tokens
            cut, _ = _cut(tokenizer.decode(body), stop) if stop else (tokenizer.decode(body), 0)
            out[k] = Completion(list(tokens), cut, "stop" if finish == "stop" else "length")

        return Row(
            list(prompts[i]),
            max_tokens,
            feed,
            done,
            sampler=sampler,
            namespace=NAMESPACE if share_prefill else None,
            store_completion=False,
            started=lambda cached, n=len(prompts[i]): prefilled.append(n - cached),
        )

    was_training = model.training
    model.eval()
    try:
        decoder = BatchDecoder(model, eos, settings, cache, evict=False)
        firsts = [decoder.add(row(i, 0)) for i in range(len(prompts))]
        rest = [(i, j) for i in range(len(prompts)) for j in range(1, group_size)]
        if share_prefill:
            # the groups' first rows read their prompts (and store them) before the others join
            def prefilling():
                busy = set(decoder.prompt_batch.uids) | {r.uid for r in decoder.waiting}
                return any(r.uid in busy for r in firsts)

            while prefilling():
                decoder.step()
        for i, j in rest:
            decoder.add(row(i, j))
        decoder.run()
    finally:
        model.train(was_training)
    if stats is not None:
        stats.rows += n
        stats.prompts += len(prompts)
        stats.prefill_tokens += sum(prefilled)
        stats.completion_tokens += sum(len(c.tokens) for c in out)
        stats.seconds += time.perf_counter() - t0
    return out
