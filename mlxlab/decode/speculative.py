"""Speculative decoding: draft a few tokens cheaply, check them with one forward pass of the model.

A step feeds the token sampled last (the row's pending token, not yet in the KV cache) and k draft
tokens d1..dk in one forward pass ([B, k + 1] inputs; products on the CPU kernel,
`fastdecode.verifying`), which gives the model's distribution after each prefix. Position i's
distribution is sampled with the row's own processors and sampler; d(i+1) is accepted when that
sample equals it, and the first sample that differs (or the one after the last draft) becomes the
next pending token. The KV of rejected drafts is rolled back (`rollback`, `rollback_rows`), so
the cache holds exactly the tokens written, as a plain decode's does.

Why the distribution is unchanged: every draft here is a point mass q (prompt lookup, a forced
grammar token, a draft model's greedy token). The standard rule accepts d with probability
min(1, p(d) / q(d)) = p(d) and otherwise samples from the residual max(p - q, 0), which is p
without d, renormalized; sampling x ~ p and accepting when x == d does exactly that (x == d with
probability p(d); otherwise x is a draw from p restricted to x != d). So each written token is
a draw from the model's own (processed) distribution, and greedy decoding writes the model's
argmax at every position. Seeded sampling stays repeatable (one sampler call per verify step,
from the global generator), though not the same draw as a non-speculative decode's.

Drafts (`Drafter`): prompt lookup (`Lookup`: the tokens that followed the latest earlier
occurrence of the text's last 4..2 tokens, prompt and answer alike, no second model) or a draft
model (`DraftModel`: any model with the same tokenizer, greedy, its own KV cache). A row under a
grammar (`grammar.Constraint`) first takes the tokens the grammar forces (llguidance's fast-
forward: JSON keys, punctuation, a forced tool call's opening), then the drafter's, cut where the
grammar refuses one: forced tokens cost no decode step of their own, and no verify position is
spent on a token the grammar would mask.

A verify step's arithmetic is a plain step's for the products (the kernel sums each row in one
order whatever the rows) but not for attention over k + 1 queries, so a verified token's logits
may differ from a plain step's in the last bits: greedy tokens can then differ only where the top
two logits are within that rounding (tests count them).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from mlxlab.errors import UserError

log = logging.getLogger(__name__)

MODES = ("off", "prompt_lookup", "draft_model")
"""`speculative=`: off (one token a forward pass), prompt_lookup, draft_model."""

MAX_NGRAM = 4
MIN_NGRAM = 2
"""Prompt lookup matches the text's last MAX_NGRAM..MIN_NGRAM tokens (longest first). One token
matches too often in prose to be worth a verify position."""


def check_mode(mode: str, draft_model: str | None = None) -> None:
    """A one-line UserError for an unknown mode, or a draft model named without draft_model mode
    (and the reverse)."""
    if mode not in MODES:
        raise UserError(f"speculative must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "draft_model" and not draft_model:
        raise UserError(
            "speculative=draft_model needs draft_model= (a model with the same tokenizer)"
        )
    if draft_model and mode != "draft_model":
        raise UserError(f"draft_model={draft_model} is used only with speculative=draft_model")


@dataclass
class Counts:
    """Drafted and accepted tokens (a row's, a decoder's, a server's)."""

    steps: int = 0
    """Verify steps (forward passes that checked at least one draft token)."""
    drafted: int = 0
    accepted: int = 0
    forced: int = 0
    """Draft tokens the grammar forced (counted in drafted, and in accepted when written)."""

    def add(self, other: Counts) -> None:
        self.steps += other.steps
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.forced += other.forced

    def as_dict(self) -> dict:
        return {
            "verify_steps": self.steps,
            "drafted_tokens": self.drafted,
            "accepted_tokens": self.accepted,
            "forced_tokens": self.forced,
            "acceptance_rate": round(self.accepted / self.drafted, 4) if self.drafted else None,
        }


# --- drafts ------------------------------------------------------------------------------------


class Lookup:
    """Prompt lookup for one sequence: `draft(k)` is up to k tokens that followed the latest
    earlier occurrence of the sequence's last MAX_NGRAM..MIN_NGRAM tokens (longest first)."""

    def __init__(
        self, tokens: Sequence[int] = (), max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM
    ):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.seq: list[int] = []
        # n-gram -> the position that followed its latest occurrence (always < len(seq), so the
        # sequence's own suffix is never its own match)
        self.index: dict[tuple, int] = {}
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        seq, index = self.seq, self.index
        lo, hi = self.min_ngram, self.max_ngram
        for t in tokens:
            seq.append(int(t))
            end = len(seq) - 1  # the n-grams ending just before it now have a follower
            for n in range(lo, min(hi, end) + 1):
                index[tuple(seq[end - n : end])] = end

    def draft(self, k: int, after: Sequence[int] = ()) -> list[int]:
        """Up to k tokens to follow the sequence and then `after` (tokens not part of it yet)."""
        if k < 1:
            return []
        tail = (self.seq[-self.max_ngram :] + list(after))[-self.max_ngram :]
        for n in range(min(self.max_ngram, len(tail)), self.min_ngram - 1, -1):
            at = self.index.get(tuple(tail[-n:]))
            if at is not None:
                return self.seq[at : at + k]
        return []


class DraftModel:
    """Greedy drafts from a smaller model with the same tokenizer, for one sequence. Its KV cache
    (plain KVCache on every layer: trimmable, and a sliding layer's window is its mask) holds a
    prefix of the sequence; each `draft` rolls it back to what the sequence still shares with
    it, feeds the rest, and writes k tokens."""

    def __init__(self, model, prefill_step: int = 512):
        from mlx_lm.models.cache import KVCache

        self.model, self.prefill_step = model, prefill_step
        self.cache = [KVCache() for _ in range(_n_layers(model))]
        self.tokens: list[int] = []

    def draft(self, k: int, seq: Sequence[int]) -> list[int]:
        import mlx.core as mx

        if k < 1 or not seq:
            return []
        common = 0
        n = min(len(self.tokens), len(seq) - 1)  # the last token is always fed again
        while common < n and self.tokens[common] == seq[common]:
            common += 1
        if len(self.tokens) > common:
            for c in self.cache:
                c.trim(len(self.tokens) - common)
        todo = list(seq[common:])
        for at in range(0, len(todo) - 1, self.prefill_step):
            piece = todo[at : min(at + self.prefill_step, len(todo) - 1)]
            self.model(mx.array(piece)[None], cache=self.cache)
            mx.eval([c.state for c in self.cache])
        x = todo[-1]
        out: list[int] = []
        while True:
            logits = self.model(mx.array([[x]]), cache=self.cache)
            x = int(mx.argmax(logits[0, -1]).item())
            out.append(x)
            if len(out) == k:
                break
        self.tokens = list(seq) + out[:-1]
        return out


def _n_layers(model) -> int:
    layers = getattr(model, "layers", None)
    if layers is None:
        layers = model.model.layers
    return len(layers)


def self_draft(model, layers: int):
    """A draft made from `model` itself: its first `layers` decoder layers, its embedding, final
    norm and head (the same weights, nothing copied). For tests and benchmarks of draft-model
    mode: on a CPU, where the head is most of a small model's bytes, it does not pay."""
    import copy

    inner = model.model if hasattr(model, "model") else model
    total = len(inner.layers)
    if not 1 <= layers <= total:
        raise UserError(f"draft_model=self:{layers}: the model has {total} layers")
    pattern = getattr(inner, "sliding_window_pattern", 1) or 1
    if layers < pattern:
        raise UserError(
            f"draft_model=self:{layers}: this model's layers come in groups of {pattern} "
            f"(sliding and global attention); take at least {pattern}"
        )
    draft_inner = copy.copy(inner)
    draft_inner.layers = inner.layers[:layers]
    if hasattr(draft_inner, "num_hidden_layers"):
        draft_inner.num_hidden_layers = layers
    if inner is model:
        return draft_inner
    draft = copy.copy(model)
    draft.model = draft_inner
    return draft


def load_draft(spec: str, model, tokenizer, dtype: str = "auto"):
    """The draft model `spec` names: `self:N` (`self_draft`), or a model spec (zoo name,
    directory, .gguf, Hugging Face repo id) whose tokenizer must be the model's (a one-line UserError otherwise)."""
    if spec.startswith("self:"):
        try:
            n = int(spec.split(":", 1)[1])
        except ValueError:
            raise UserError(f"draft_model={spec}: give self:N, N the number of layers") from None
        return self_draft(model, n)
    from mlxlab.models.zoo import load

    draft, draft_tok = load(spec, dtype)
    mine, theirs = _vocab(tokenizer), _vocab(draft_tok)
    if mine != theirs:
        raise UserError(
            f"draft_model={spec} has another tokenizer ({len(theirs)} tokens, "
            f"{len(set(theirs.items()) ^ set(mine.items()))} entries differ from the model's "
            f"{len(mine)}): a draft model must share the model's vocabulary"
        )
    return draft


def _vocab(tokenizer) -> dict:
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    return dict(inner.get_vocab())


@dataclass
class Drafter:
    """One row's drafts: the grammar's forced tokens first (a processor with `draft`), then prompt
    lookup or the draft model's, cut where the grammar refuses one. The length adapts to what the
    row accepts: after a miss, one more than the drafter's tokens accepted; after a full accept,
    doubled (up to `limit`)."""

    limit: int
    lookup: Lookup | None = None
    model: DraftModel | None = None
    grammars: list = field(default_factory=list)
    counts: Counts = field(default_factory=Counts)
    k: int = 0

    def __post_init__(self):
        self.k = self.limit

    def extend(self, tokens: Sequence[int]) -> None:
        """Tokens written to the row (prompt at the start, then its answer)."""
        if self.lookup is not None:
            self.lookup.extend(tokens)

    def draft(
        self, ahead: Sequence[int], room: int, seq: Callable[[], list[int]]
    ) -> tuple[list[int], int]:
        """(drafts, forced) to follow the row's text and `ahead` (its pending token): at most
        `room`; `seq()` the row's whole text so far (for a draft model)."""
        k = min(self.k, room)
        if k < 1:
            return [], 0

        def propose(forced: list[int], n: int) -> list[int]:
            if n < 1:
                return []
            if self.lookup is not None:
                return self.lookup.draft(n, list(ahead) + forced)
            if self.model is not None:
                return self.model.draft(n, seq() + list(ahead) + forced)
            return []

        if not self.grammars:
            return propose([], k), 0
        out, forced = self.grammars[0].draft(list(ahead), k, propose)
        for g in self.grammars[1:]:
            n = g.allowed_prefix(list(ahead), out)
            out, forced = out[:n], min(forced, n)
        return out, forced

    def settle(self, drafted: int, accepted: int, forced: int) -> None:
        """A verify step's outcome: counted, and the next draft length adapted."""
        if drafted == 0:
            return
        c = self.counts
        c.steps += 1
        c.drafted += drafted
        c.accepted += accepted
        c.forced += min(forced, accepted)
        free = drafted - forced  # the drafter's own
        if free <= 0:
            return
        if accepted >= drafted:
            self.k = min(self.limit, self.k * 2)
        else:
            self.k = max(1, min(self.limit, max(accepted - forced, 0) + 1))


def make_drafter(
    mode: str,
    limit: int,
    processors,
    draft_model=None,
    prefill_step: int = 512,
):
    """A row's Drafter for `mode` (None when off); its text is handed to `extend`."""
    if mode == "off":
        return None
    grammars = [p for p in processors or [] if hasattr(p, "draft") and hasattr(p, "rewind")]
    if mode == "prompt_lookup":
        return Drafter(limit, lookup=Lookup(), grammars=grammars)
    if draft_model is None:
        raise UserError("speculative=draft_model needs a draft model")
    return Drafter(limit, model=DraftModel(draft_model, prefill_step), grammars=grammars)


# --- the KV cache, rolled back -----------------------------------------------------------------


def rollback(cache: list, n: int) -> None:
    """Drop the last n tokens of a one-row cache (mlx-lm's per-layer caches), right after a
    multi-token update wrote them. mlx-lm's RotatingKVCache trims only before it wraps: once a
    sliding layer has wrapped, its `trim` leaves the dropped tokens in the buffer. After a
    multi-token update its buffer is in temporal order (the window's last max_size - 1 tokens,
    then the new ones), so the rollback cuts its end through its `state`; what is left still
    holds a whole window, and the next update (in place or concatenated) works from it as from
    any other state."""
    from mlx_lm.models.cache import RotatingKVCache

    if n <= 0:
        return
    for c in cache:
        if isinstance(c, RotatingKVCache):
            keys, values, offset, keep, max_size, idx = c.state
            if keys is None or n > offset:
                raise ValueError(f"cannot roll back {n} tokens of a cache holding {offset}")
            if idx != keys.shape[2] and offset >= max_size:
                raise ValueError(
                    "a wrapped rotating cache rolls back only after a multi-token update"
                )
            c.state = (
                keys[..., : idx - n, :],
                values[..., : idx - n, :],
                offset - n,
                keep,
                max_size,
                idx - n,
            )
        elif c.is_trimmable():
            if c.trim(n) != n:
                raise ValueError(f"cannot roll back {n} tokens of {type(c).__name__}")
        else:
            raise ValueError(f"speculative decoding cannot roll back a {type(c).__name__}")


def compact(cache: list) -> list:
    """A one-row cache as a plain decode leaves it, for the prompt cache: a KVCache's buffer cut
    at its offset (a rollback only moves the offset back), a rotating cache's at its window (a
    multi-token update keeps max_size - 1 older tokens beside the new ones). The tokens a later
    request sees are the same either way; the stored entry's bytes are then the plain one's."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    for c in cache:
        if type(c) is KVCache and c.keys is not None and c.keys.shape[2] > c.offset:
            c.keys, c.values = c.keys[..., : c.offset, :], c.values[..., : c.offset, :]
        elif isinstance(c, RotatingKVCache) and c.keys is not None:
            keys, values, offset, keep, max_size, idx = c.state
            if idx == keys.shape[2] and keys.shape[2] > max_size and keep == 0:
                keys, values = keys[..., -max_size:, :], values[..., -max_size:, :]
                c.state = (keys, values, offset, keep, max_size, max_size)
    return cache


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


# --- verify ------------------------------------------------------------------------------------


def forward(model, inputs, cache):
    """The model over [B, L] inputs; products on the decode kernel when L > 1 (a verify step)."""
    import mlx.core as mx

    from mlxlab.models.fastdecode import verifying

    x = mx.array(inputs)
    if x.shape[1] > 1:
        with verifying():
            return model(x, cache=cache)
    return model(x, cache=cache)


def process(logits, processors, context: list[int], inputs: list[int]):
    """Logprobs [L, V] of one row's L positions after its processors: position i's context is
    `context` + inputs[: i + 1] (as mlx-lm's loops pass the tokens fed so far)."""
    import mlx.core as mx

    if processors:
        rows = []
        for i in range(logits.shape[0]):
            ctx = mx.array(context + inputs[: i + 1])
            row = logits[i : i + 1]
            for p in processors:
                row = p(ctx, row)
            rows.append(row)
        logits = mx.concatenate(rows, axis=0)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def accepted(samples: list[int], drafts: list[int]) -> int:
    """How many leading drafts equal the samples at their positions."""
    a = 0
    while a < len(drafts) and samples[a] == drafts[a]:
        a += 1
    return a


def rewind(processors, n: int) -> None:
    """Processors that keep state (a grammar's matcher) forget their last n calls' tokens."""
    if n > 0:
        for p in processors or []:
            if hasattr(p, "rewind"):
                p.rewind(n)


# --- the serial path ---------------------------------------------------------------------------


def run(model, row, kv, drafter: Drafter, last: int) -> str:
    """Decode `row` from `kv` (its prompt but `last`, the prompt's last token) speculatively until
    it finishes; returns its finish reason ("length" when max_tokens ended it). The row's tokens
    are appended and fed as in `run_serial`, and `kv` ends holding the prompt and exactly the
    tokens written (as generate_step's cache does)."""
    import mlx.core as mx
    from mlx_lm.generate import generation_stream

    sampler = row.sampler or (lambda lp: mx.argmax(lp, axis=-1))
    context: list[
        int
    ] = []  # the processors' tokens, as generate_step's: from the last prompt token
    head = last  # the certain token to feed: the prompt's last, then each step's pending one
    pending_lp = (
        None  # the logprobs the pending token was sampled from (None: head is the prompt's)
    )
    drafter.extend(row.prompt)
    with mx.stream(generation_stream):
        while True:
            writing = pending_lp is not None
            room = row.max_tokens - len(row.tokens) - writing
            drafts, forced = drafter.draft(
                [head] if writing else [], room, lambda: row.prompt + row.tokens
            )
            logits = forward(model, [[head] + drafts], kv)[0]
            logprobs = process(logits, row.processors, context, [head] + drafts)
            samples = sampler(logprobs)
            mx.eval(samples)
            samples = samples.tolist()
            a = accepted(samples, drafts)
            drafter.settle(len(drafts), a, forced)
            rollback(kv, len(drafts) - a)
            rewind(row.processors, len(drafts) - a)
            context += [head] + drafts[:a]
            written = ([(head, pending_lp)] if writing else []) + [
                (drafts[i], logprobs[i]) for i in range(a)
            ]
            for j, (token, lp) in enumerate(written):
                row.tokens.append(token)
                finish = row.feed(token, lp)
                if finish is None and len(row.tokens) >= row.max_tokens:
                    finish = "length"
                if finish is not None:
                    rollback(kv, len(written) - 1 - j)  # the cache ends at the finishing token
                    return finish
            drafter.extend([t for t, _ in written])
            head, pending_lp = samples[a], logprobs[a]


# --- the batched path --------------------------------------------------------------------------

BATCH_ROWS: int | None = None
"""Rows x tokens a batched verify step may hold; None: the decode kernel's verify rows
(`fastdecode.VERIFY_ROWS`). Past them the products go to BLAS's many-row path, which reads the
float32 weights at a fraction of the bandwidth, so the drafts are cut to fit: 2 rows verify up
to 7 drafts each, 4 rows 3, 8 rows 1, more rows none (plain steps). scripts/bench_speculative.py
lifts it to measure what wider verify steps would give."""


def batch_width(rows: int) -> int:
    """The most drafts each of `rows` rows may verify in one step."""
    from mlxlab.models import fastdecode

    limit = BATCH_ROWS if BATCH_ROWS is not None else fastdecode.VERIFY_ROWS
    return limit // max(rows, 1) - 1


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
