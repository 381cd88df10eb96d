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

This module holds the drafts, the verify step's pieces and the serial path (`run`); the batched
lane's verify step, its per-row rollback and the draft length it picks for the rows it holds
are `speculative_batch.py`'s.
"""

from __future__ import annotations

import logging
import threading
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
    """Drafted and accepted tokens (a row's, a decoder's, a server's). Changed only through
    `record` and `add`, which hold its lock, as `values` and `as_dict` do: a reader on another
    thread (/stats, /metrics) sees whole verify steps and whole rows, never half of one."""

    steps: int = 0
    """Verify steps (forward passes that checked at least one draft token)."""
    drafted: int = 0
    accepted: int = 0
    forced: int = 0
    """Draft tokens the grammar forced (counted in drafted, and in accepted when written)."""
    _lock: threading.Lock = field(
        default_factory=threading.Lock, init=False, repr=False, compare=False
    )

    def record(self, steps: int, drafted: int, accepted: int, forced: int) -> None:
        with self._lock:
            self.steps += steps
            self.drafted += drafted
            self.accepted += accepted
            self.forced += forced

    def add(self, other: Counts) -> None:
        self.record(*other.values())

    def values(self) -> tuple[int, int, int, int]:
        """(steps, drafted, accepted, forced), read together."""
        with self._lock:
            return self.steps, self.drafted, self.accepted, self.forced

    def as_dict(self) -> dict:
        steps, drafted, accepted, forced = self.values()
        return {
            "verify_steps": steps,
            "drafted_tokens": drafted,
            "accepted_tokens": accepted,
            "forced_tokens": forced,
            "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
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


RATE_PRIOR = 0.75
"""A row's acceptance rate before its first verify step: the share of prompt-lookup drafts
accepted over the copy-heavy benchmark's requests (81-86%, experiments/speculative/README.md),
rounded down. It counts as RATE_WEIGHT drafts; each verify step after (and each plain step's
shadow check, `Drafter.extend`) weighs RATE_DECAY times the one before, so the estimate follows a
row whose text turns from copying to free prose, and back."""
RATE_WEIGHT = 2.0
RATE_DECAY = 0.8


@dataclass
class Drafter:
    """One row's drafts: the grammar's forced tokens first (a processor with `draft`), then prompt
    lookup or the draft model's, cut where the grammar refuses one. The length adapts to what the
    row accepts: after a miss, one more than the drafter's tokens accepted; after a full accept,
    doubled (up to `limit`). `rate` estimates the chance that the drafter's next token is accepted
    once those before it are (the batched lane's draft length weighs it, speculative_batch.py):
    from verify steps (`settle`), and for prompt lookup from plain steps too (`extend`), so a row
    whose drafts stopped paying gets speculation back when its text turns to copying."""

    limit: int
    lookup: Lookup | None = None
    model: DraftModel | None = None
    grammars: list = field(default_factory=list)
    counts: Counts = field(default_factory=Counts)
    k: int = 0
    kept: float = RATE_PRIOR * RATE_WEIGHT
    """The drafter's tokens accepted, and `tried` those checked (an accepted one, or the first
    rejected), each step's weighed RATE_DECAY times the next's."""
    tried: float = RATE_WEIGHT

    def __post_init__(self):
        self.k = self.limit

    @property
    def rate(self) -> float:
        return self.kept / self.tried

    def extend(self, tokens: Sequence[int], shadow: bool = False) -> None:
        """Tokens written to the row (prompt at the start, then its answer). `shadow`: they were
        written by a plain step, which verified no draft: before each token, prompt lookup's
        would-be first draft (free to make) is checked against it and `rate` updated as by a
        one-draft verify step (no draft: nothing learnt). Tokens a grammar forced are counted as
        the lookup's here (the check does not ask the grammar). A draft model's rate is not
        shadowed (its drafts cost forward passes)."""
        if self.lookup is None:
            return
        if not shadow:
            self.lookup.extend(tokens)
            return
        for t in tokens:
            guess = self.lookup.draft(1)
            if guess:
                hit = guess[0] == int(t)
                self._observe(int(hit), not hit)
            self.lookup.extend([t])

    def draft(
        self,
        ahead: Sequence[int],
        room: int,
        seq: Callable[[], list[int]],
        own: int | None = None,
    ) -> tuple[list[int], int]:
        """(drafts, forced) to follow the row's text and `ahead` (its pending token): at most
        `room`, of which at most `own` (None: no other bound) the drafter's after the grammar's
        forced ones; `seq()` the row's whole text so far (for a draft model)."""
        k = min(self.k, room)
        if k < 1:
            return [], 0

        def propose(forced: list[int], n: int) -> list[int]:
            n = n if own is None else min(n, own)
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
        """A verify step's outcome: counted, the next draft length adapted, `rate` updated."""
        if drafted == 0:
            return
        self.counts.record(1, drafted, accepted, min(forced, accepted))
        free = drafted - forced  # the drafter's own
        if free <= 0:
            return
        self._observe(max(accepted - forced, 0), accepted < drafted)
        if accepted >= drafted:
            self.k = min(self.limit, self.k * 2)
        else:
            self.k = max(1, min(self.limit, max(accepted - forced, 0) + 1))

    def _observe(self, kept: int, missed: bool) -> None:
        """The drafter's tokens checked in one step: `kept` accepted, then one rejected if
        `missed`; the earlier steps' weigh RATE_DECAY times less."""
        self.kept = RATE_DECAY * self.kept + kept
        self.tried = RATE_DECAY * self.tried + kept + missed


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
