"""Speculative decoding on the batched lane: how many drafts a step verifies for the rows it
holds (`width`), the verify step itself (`verify_batch`) and the batch cache's per-row rollback.

The draft length. A verify step feeds every row 1 + k positions (rows with fewer drafts are
padded to the widest), so its cost is a function of (rows, positions) and is paid by every row,
drafting or not. On a CPU it grows with both (measured: `STEP_COST`), and a step of 4 rows x 9
positions costs far more than a plain step of 4 rows: with up to 8 drafts a row, prompt lookup
lost to plain batched decoding at 4 and 8 clients though 86% of its drafts were accepted
(experiments/speculative/README.md). So each step chooses the k that maximizes the tokens it
expects to write per unit of cost:

    gain(k) = sum over rows of E(row, k) / step_cost(rows, 1 + k)

where E(row, k) = 1 + p1 + p1 p2 + ... over the row's first min(k, its drafts) drafts, p = 1 for
a token the grammar forces and the row's acceptance rate (`Drafter.rate`, a running estimate
from its own verify steps, and for prompt lookup from its plain steps too) for the drafter's.
k = 0 is a plain step (mlx-lm's own, pipelined). The batch decoder asks before it evaluates the
rows' pending tokens whether any drafting can pay (each row's most drafts, a grammar's counted
as certain: an upper bound), caps a draft model's own drafts at the width its rates give (they
cost forward passes), and chooses k on the drafts the rows then have (prompt lookup often finds
fewer, or none; a grammar may force several).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mlxlab.decode.speculative import accepted, forward, process, rewind

STEP_COST: dict[int, dict[int, float]] = {
    1: {1: 1.0, 2: 1.12, 3: 1.32, 4: 1.36, 5: 1.54, 9: 2.94},
    2: {1: 1.0, 2: 1.42, 3: 1.70, 4: 1.87, 5: 2.17},
    4: {1: 1.0, 2: 1.63, 3: 2.05, 4: 2.42},
    8: {1: 1.0, 2: 1.87},
}
"""A verify step's time over a plain step of as many rows (mlx-lm's `GenerationBatch.next`), by
rows and positions per row: gemma3-270m on the 2-core CPU (AVX-512, up to 8 plain rows on the
kernel: `fastdecode.MAX_ROWS`), prompts of 320 tokens, medians of 3 interleaved rounds of
`PYTHONPATH=. python experiments/speculative/verify_cost.py --rows 1,2,4,8 --positions
1,2,3,4,5,9 --reps 3` (forward, each row's logprobs, argmax, a per-row rollback) on a nearly
idle machine (2026-12-06; plain steps of 1, 2, 4 and 8 rows took 76, 97, 132 and 202 ms).
`step_cost` reads it monotone in positions (each cell at least the one before it: more
positions never cost less), interpolated linearly between measured positions and past the last
in proportion; a row count not measured is interpolated between the measured counts around it,
and past the largest takes its ratios. Past the kernel's verify rows (`fastdecode.VERIFY_ROWS`:
rows x positions > 16) the products fall to BLAS's many-row path (measured: 4 rows x 5
positions 3.44x, 8 x 9 4.80x): such steps are never taken. The table is a CPU's: see
`step_cost` for other devices."""

GPU_POSITIONS = 16
"""Off the CPU (MLX on a GPU) the step cost is not measured: a verify step is taken to cost a
plain step while rows x positions <= GPU_POSITIONS and is never taken past it (the rule before
the CPU table: at most 16 // rows - 1 drafts a row), so a wide batch, where a draft model's
drafts are rows x k serial forward passes, takes plain steps until a GPU's costs are measured."""


def _cpu() -> bool:
    import mlx.core as mx

    return mx.default_device() == mx.cpu


def _between(points: dict[int, float], x: float) -> float:
    xs = sorted(points)
    if x <= xs[0]:
        return points[xs[0]] * x / xs[0]
    for lo, hi in zip(xs, xs[1:], strict=False):
        if x <= hi:
            return points[lo] + (points[hi] - points[lo]) * (x - lo) / (hi - lo)
    return points[xs[-1]] * x / xs[-1]


def _monotone(points: dict[int, float]) -> dict[int, float]:
    """The points with each value raised to the largest before it (a running max over x)."""
    out, top = {}, -math.inf
    for x in sorted(points):
        top = max(top, points[x])
        out[x] = top
    return out


def step_cost(rows: int, positions: int) -> float:
    """A step of `rows` rows x `positions` positions over a plain step of `rows`: on the CPU
    from `STEP_COST` (infinite past the kernel's verify rows); elsewhere 1 up to GPU_POSITIONS
    rows x positions and infinite past it."""
    from mlxlab.models import fastdecode

    if positions <= 1:
        return 1.0
    if not _cpu():
        return 1.0 if rows * positions <= GPU_POSITIONS else math.inf
    if rows * positions > fastdecode.VERIFY_ROWS:
        return math.inf
    counts = sorted(STEP_COST)
    lo = max((r for r in counts if r <= rows), default=counts[0])
    hi = min((r for r in counts if r >= rows), default=counts[-1])
    low = _between(_monotone(STEP_COST[lo]), positions)
    if hi == lo:  # measured, or past the largest measured count (its ratios)
        return low
    high = _between(_monotone(STEP_COST[hi]), positions)
    return low + (high - low) * (rows - lo) / (hi - lo)


def expected_tokens(rate: float, drafts: int, forced: int = 0) -> float:
    """Tokens a row expects to write in a verify step of `drafts` drafts (its first `forced`
    forced by its grammar, always accepted), each of the others accepted with probability `rate`
    once those before it are: 1 + the chance each draft is reached and accepted."""
    total, reach = 1.0, 1.0
    for j in range(drafts):
        reach *= 1.0 if j < forced else rate
        total += reach
    return total


def width(rows: list[tuple[float, int, int]]) -> int:
    """The drafts a step verifies per row (0: a plain step), for rows given as (acceptance rate,
    drafts it has, of which forced): the k that maximizes expected tokens written per cost."""
    n = len(rows)
    best_k, best = 0, n / step_cost(n, 1)
    for k in range(1, max((d for _, d, _ in rows), default=0) + 1):
        gain = sum(expected_tokens(a, min(d, k), min(f, k)) for a, d, f in rows)
        gain /= step_cost(n, 1 + k)
        if gain > best:
            best_k, best = k, gain
    return best_k


# --- the batch cache, rolled back per row ---------------------------------------------------


def temporal_rows(cache: list) -> None:
    """Put every rotated BatchRotatingKVCache of a batch cache in temporal order (what its own
    multi-token update does first), before a verify step builds its mask. mlx-lm's `make_mask`
    for several new tokens reckons the trim the update will make from the rotated buffer's
    index, while the update trims from the temporally ordered one: on a rotated cache the two
    differ and a left-padded row's mask is one slot off (it hides the row's first token). mlx-lm
    itself never feeds several tokens to a rotated batch cache; a verify step does."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchRotatingKVCache

    for c in cache:
        if isinstance(c, BatchRotatingKVCache) and c.rotated:
            (keys, values, offset, left, max_size, _offset, idx, _) = c.state
            keys, values = mx.roll(keys, -idx, axis=2), mx.roll(values, -idx, axis=2)
            c.state = (keys, values, offset, left, max_size, _offset, keys.shape[2], False)


def rollback_rows(cache: list, rejected: list[int]) -> None:
    """Per-row rollback of a batch cache right after a multi-token update (mlx-lm's BatchKVCache
    and BatchRotatingKVCache, whose own `trim` drops the same count from every row): every row
    loses min(rejected) tokens from the shared end, then each row with more rejected tokens is
    shifted right by the difference into its left padding (mlx-lm's own move for right-padded
    prompts, `dynamic_roll`), so every row's tokens end at the shared index again."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache, dynamic_roll

    low = min(rejected)
    shift = [r - low for r in rejected]
    extra = mx.array(shift) if any(shift) else None
    for c in cache:
        if isinstance(c, BatchRotatingKVCache):
            (keys, values, offset, left, max_size, _offset, idx, rotated) = c.state
            if rotated:
                raise ValueError("a rotated batch cache rolls back only after a multi-token update")
            keys, values = keys[..., : idx - low, :], values[..., : idx - low, :]
            idx, _offset, offset = idx - low, _offset - low, offset - low
            if extra is not None:
                keys = dynamic_roll(keys, extra[:, None], axis=2)
                values = dynamic_roll(values, extra[:, None], axis=2)
                left = mx.maximum(left, 0) + extra
                offset = offset - extra
            c.state = (keys, values, offset, left, max_size, _offset, idx, False)
        elif isinstance(c, BatchKVCache):
            c.trim(low)
            if extra is not None:
                c.keys = dynamic_roll(c.keys, extra[:, None], axis=2)
                c.values = dynamic_roll(c.values, extra[:, None], axis=2)
                c.left_padding = c.left_padding + extra
                c.offset = c.offset - extra
        else:
            raise ValueError(f"speculative decoding cannot roll back rows of a {type(c).__name__}")


# --- verify ----------------------------------------------------------------------------------


@dataclass
class Written:
    """What one row of a batched verify step wrote: (token, logprobs) in order, the finish
    reason mlx-lm's stop rules gave (max_tokens, a stop token) at the last of them, and its
    cache when it finished there (already cut to end at that token)."""

    tokens: list[tuple[int, object]]
    finish: str | None = None
    fed: int = 1
    """Tokens of this step now in the row's cache (its pending token and the accepted drafts,
    some of which may follow the finishing token)."""
    cache: list | None = None


def verify_batch(
    model, gen, drafts: list[list[int]], forced: list[int], drafters: list
) -> list[Written]:
    """One speculative step of mlx-lm's GenerationBatch `gen`: each row feeds its pending token
    (`gen._next_tokens`, sampled and not yet fed) and its drafts ([B, L], rows with fewer drafts
    padded; the padding is rejected like a wrong draft), samples every position with its own
    processors and sampler, keeps the drafts its samples confirm, rolls the rest back row by row
    (`rollback_rows`), and leaves `gen` as its own `next()` would have: the cache holding every
    token written, `tokens`, the processors' token buffers, the stop matchers and token counts
    advanced, and `_next_tokens` the rows' next pending tokens. Rows mlx-lm's rules finish are
    not filtered out here; the caller does that with its own finishes. Returns what each row
    wrote (its pending token first)."""
    import mlx.core as mx

    pending = gen._next_tokens.tolist()
    n = len(pending)
    width = 1 + max(len(d) for d in drafts)
    inputs = [[p] + d + [p] * (width - 1 - len(d)) for p, d in zip(pending, drafts, strict=True)]
    temporal_rows(gen.prompt_cache)
    logits = forward(model, inputs, gen.prompt_cache)
    procs = gen.logits_processors or [[] for _ in range(n)]
    logprobs = [
        process(logits[i, : 1 + len(drafts[i])], procs[i], gen.tokens[i], [pending[i]] + drafts[i])
        for i in range(n)
    ]
    samplers = [s or gen.fallback_sampler for s in (gen.samplers or [None] * n)]
    samples: list = [None] * n
    for s in {id(s): s for s in samplers}.values():  # one call per distinct sampler
        rows = [i for i in range(n) if samplers[i] is s]
        out = s(mx.concatenate([logprobs[i] for i in rows], axis=0))
        at = 0
        for i in rows:
            samples[i] = out[at : at + logprobs[i].shape[0]]
            at += logprobs[i].shape[0]
    mx.eval(samples)
    samples = [s.tolist() for s in samples]
    accepted_n = [accepted(samples[i], drafts[i]) for i in range(n)]
    rollback_rows(gen.prompt_cache, [width - 1 - a for a in accepted_n])

    results = []
    nxt, nxt_lp = [], []
    for i in range(n):
        a = accepted_n[i]
        rewind(procs[i], len(drafts[i]) - a)
        drafters[i].settle(len(drafts[i]), a, forced[i])
        written = [(pending[i], gen._next_logprobs[i])] + [
            (drafts[i][j], logprobs[i][j]) for j in range(a)
        ]
        tokens = [t for t, _ in written]
        gen.tokens[i].extend(tokens)
        gen._token_context[i].update_and_fetch(mx.array(tokens))
        finish = None
        fed = len(tokens)
        for j, t in enumerate(tokens):
            gen._num_tokens[i] += 1
            if gen._num_tokens[i] >= gen.max_tokens[i]:
                finish = "length"
            if gen._matchers[i].advance(t):
                finish = "stop"
            if finish is not None:
                written = written[: j + 1]
                break
        results.append(Written(written, finish, fed))
        nxt.append(samples[i][a])
        nxt_lp.append(logprobs[i][a])
    gen._next_tokens = mx.array(nxt)
    gen._next_logprobs = nxt_lp
    return results
