"""The batched decoder: continuous batching over mlx-lm's `PromptProcessingBatch` and
`GenerationBatch`, with a logits-processor list, a sampler and an adapter per row, prefill in
steps, and prompt-KV reuse through a `PromptCache`.

Each `step()` does what one `BatchGenerator.next()` does, in the same order: one decode step for
every generating row, then admit waiting rows into the prompt batch, move rows whose prompt is
done into the generation batch, and prefill one chunk (`DecodeSettings.prefill_step`) of every
prompt still being read. Rows join and leave between steps. Keeping mlx-lm's order and its batch
classes (padding, batch KV caches, per-row samplers, its stop-token matcher) is what makes greedy
tokens equal `BatchGenerator`'s (tests/test_decode.py, tests/test_serve_batch.py). What the
decoder adds to mlx-lm's:

- the prompt cache: a row starts, when it is admitted, from the longest cached prefix of its
  namespace (so it can reuse what rows admitted before it stored), and stores checkpoints (the
  end of its `checkpoint` piece, the end of its prompt but the last token, prompt + completion
  when it finishes), so rows of later requests, decodes and lanes share one cache;
- per-row adapters: before every forward pass the decoder hands `selection.set_rows` one
  adapter spec per batch row (`lora.multi.Selection`), so rows with different LoRA adapters
  decode in the same batch;
- admission: a waiting row is admitted only when `fits(lengths, copies)` says every row, each
  grown to prompt + max_tokens, plus a copy of each row still prefilling, fits together
  (otherwise it waits for rows to finish; a row alone is always admitted);
- cancellation: a waiting or prefilling row whose `cancelled()` is true leaves before the next
  prefill chunk; a generating row stops when its `feed` returns a finish reason.

At most `DecodeSettings.batch` rows are in the prompt and generation batches together (mlx-lm's
`completion_batch_size` is a soft limit; this one is hard, so admission means something).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from mlxlab.decode import speculative, speculative_batch
from mlxlab.decode.prompt_cache import PromptCache
from mlxlab.decode.settings import DecodeSettings

log = logging.getLogger(__name__)


def prompt_pieces(prompt: list[int], cached: int, checkpoint: int = 0):
    """The pieces of `prompt` still to run after its first `cached` tokens, as (start, end,
    prompt-cache checkpoint kind): up to `checkpoint` ("system": the end of a system prompt,
    shared by every conversation with it), up to the last token ("user": the prefix of the next
    turn even when the answer does not re-tokenize the same way), then the last token alone
    (None: generation starts from it)."""
    end = len(prompt) - 1
    pieces, at = [], cached
    if checkpoint and at < checkpoint < end:
        pieces.append((at, checkpoint, "system"))
        at = checkpoint
    if at < end:
        pieces.append((at, end, "user"))
    pieces.append((end, len(prompt), None))
    return pieces


@dataclass
class Row:
    """One sequence to decode. The caller's callbacks: `feed(token, logprobs)` for every
    generated token (a finish reason stops the row there), `done(finish, tokens)` once when the
    row leaves (stop | length | cancelled | what `feed` returned), `cancelled()` polled while it
    waits or prefills."""

    prompt: list[int]
    max_tokens: int
    feed: Callable[[int, object], str | None]
    done: Callable[[str, list[int]], None]
    sampler: Callable | None = None
    processors: list = field(default_factory=list)
    adapter: Hashable = ()
    """Handed to `selection.set_rows` with the other rows of each forward pass."""
    namespace: Hashable | None = None
    """The prompt-cache namespace of its KV; None: the row neither reads nor stores any."""
    checkpoint: int = 0
    """A prompt position whose KV is stored too (the end of a system prompt); 0: none."""
    store_completion: bool = True
    """Store prompt + completion when it finishes (the next turn of a chat starts with it);
    false: only the prompt's checkpoints (a decode of the same prompts again needs no more)."""
    cancelled: Callable[[], bool] = lambda: False
    started: Callable[[int], None] | None = None
    """Called once its prompt-cache lookup is done, with the prompt tokens it found there."""
    logprobs: bool = True
    """Whether `feed` reads its logprobs argument; false lets the serial path skip computing
    them for a greedy row (`feed` then gets None; serial.py `_greedy_steps`)."""
    # the decoder's own
    uid: int = -1
    tokens: list[int] = field(default_factory=list)
    cached: int = 0
    """Prompt tokens that came from the prompt cache."""
    cache: list | None = None
    pieces: list[list] = field(default_factory=list)  # [tokens, end, kind] still to run
    speculation: object | None = None
    """Its drafted and accepted tokens (`speculative.Counts`) when it was decoded speculatively."""

    @property
    def length(self) -> int:
        return len(self.prompt) + self.max_tokens


class BatchDecoder:
    def __init__(
        self,
        model,
        eos: set[int],
        settings: DecodeSettings,
        cache: PromptCache | None = None,
        selection=None,
        fits: Callable[[list[int], int], bool] | None = None,
        evict: bool = True,
        draft_model=None,
    ):
        """`selection`: per-row adapters (`lora.multi.Selection`: set_rows, clear), None when the
        model holds none; `fits(lengths, copies)`: memory admission, None: any batch fits;
        `evict`: whether storing in the cache may evict (an evaluation that decodes the same
        prompts again keeps what it stored first); `draft_model`: the drafts' model under
        `settings.speculative == "draft_model"`."""
        from mlx_lm.generate import StopSequences
        from mlx_lm.sample_utils import make_sampler

        self.model, self.settings = model, settings
        self.cache = cache if cache is not None and cache.enabled else None
        self.selection, self.fits, self.evict = selection, fits, evict
        self.eos = set(eos)
        self.draft_model = draft_model
        self.drafters: dict[int, speculative.Drafter] = {}  # generating rows', when speculative
        self.speculation = speculative.Counts()  # rows that left
        self._fallback = make_sampler(temp=0.0)
        self._stop = StopSequences([[t] for t in sorted(eos)])
        self._uid = 0
        self.waiting: deque[Row] = deque()
        self.rows: dict[int, Row] = {}
        self._empty_batches()
        self.steps = self.rows_served = self.peak_rows = self.memory_waits = 0
        self._waited: set[int] = set()

    # --- rows in and out ---------------------------------------------------------------------

    @property
    def active(self) -> int:
        """Rows waiting, prefilling or decoding."""
        return len(self.waiting) + len(self.prompt_batch) + len(self.gen)

    @property
    def running(self) -> int:
        return len(self.prompt_batch) + len(self.gen)

    def add(self, row: Row) -> Row:
        """Queue a row; it is admitted at a later step."""
        if not row.prompt or row.max_tokens < 1:
            raise ValueError("a row needs a prompt and max_tokens >= 1")
        row.uid, self._uid = self._uid, self._uid + 1
        self.rows[row.uid] = row
        self.waiting.append(row)
        return row

    def _start(self, row: Row) -> None:
        """At admission: the longest cached prefix (so a row admitted after another with the same
        system prompt reuses its checkpoint), then the pieces of the prompt still to run."""
        from mlx_lm.models.cache import make_prompt_cache

        cache, cached = None, 0
        if self.cache is not None and row.namespace is not None:
            cache, cached = self.cache.fetch(row.namespace, row.prompt)
        row.cache = cache if cache is not None else make_prompt_cache(self.model)
        row.cached = cached
        if row.started is not None:
            row.started(cached)
        row.pieces = [
            [row.prompt[a:b], b, kind]
            for a, b, kind in prompt_pieces(row.prompt, cached, row.checkpoint)
        ]

    def _store(self, row: Row, tokens: list[int], cache, kind: str) -> None:
        self.cache.store(
            row.namespace, tokens, cache, kind=kind, copy_cache=False, evict=self.evict
        )

    def _close(self, row: Row, finish: str, cache=None) -> None:
        """The row leaves: its `done` is called, then (not cancelled) prompt + completion is
        cached."""
        del self.rows[row.uid]
        self._waited.discard(row.uid)
        if self.drafters.pop(row.uid, None) is not None:
            self.speculation.add(row.speculation)
        self.rows_served += 1
        row.done(finish, row.tokens)
        if (
            cache is not None
            and finish != "cancelled"
            and row.store_completion
            and self._caches(row)
        ):
            self._store(row, row.prompt + row.tokens, cache, "assistant")

    def _caches(self, row: Row) -> bool:
        return self.cache is not None and row.namespace is not None

    def _prompt_batch_of(self, rows: list[Row]):
        """A prompt batch of newly admitted rows (their caches merged into one batch cache)."""
        from mlx_lm.generate import PromptProcessingBatch

        return PromptProcessingBatch(
            model=self.model,
            uids=[r.uid for r in rows],
            caches=[r.cache for r in rows],
            tokens=[list(r.prompt[: r.cached]) for r in rows],
            prefill_step_size=self.settings.prefill_step,
            samplers=[r.sampler for r in rows],
            fallback_sampler=self._fallback,
            logits_processors=[r.processors for r in rows],
            stop_sequences=[self._stop] * len(rows),
            max_tokens=[r.max_tokens for r in rows],
        )

    def _empty_batches(self) -> None:
        from mlx_lm.generate import GenerationBatch, PromptProcessingBatch

        self.prompt_batch = PromptProcessingBatch.empty(
            self.model, self._fallback, self.settings.prefill_step
        )
        self.gen = GenerationBatch.empty(self.model, self._fallback)

    def drop_all(self) -> list[Row]:
        """A forward pass failed: every row leaves without `done`, the batches start empty;
        the rows are returned (the caller fails them)."""
        rows = list(self.rows.values())
        self.rows.clear()
        self.drafters.clear()
        self.waiting.clear()
        self._waited.clear()
        self._empty_batches()
        if self.selection is not None:
            self.selection.clear()
        return rows

    # --- one scheduler step ------------------------------------------------------------------

    def _select(self, uids: list[int]) -> None:
        if self.selection is not None:
            self.selection.set_rows([self.rows[u].adapter for u in uids])

    def step(self) -> None:
        import mlx.core as mx
        from mlx_lm.generate import generation_stream

        with mx.stream(generation_stream):
            try:
                self._drop_cancelled()
                if len(self.gen):
                    self._decode()
                if len(self.gen) >= self.settings.batch:
                    return
                self._admit()
                self._prefill()
            finally:
                if self.selection is not None:
                    self.selection.clear()
                self.peak_rows = max(self.peak_rows, self.running)

    def run(self) -> None:
        """Step until every row has left."""
        while self.active:
            self.step()

    def _drop_cancelled(self) -> None:
        for row in [r for r in self.waiting if r.cancelled()]:
            self.waiting.remove(row)
            self._close(row, "cancelled")
        gone = [i for i, u in enumerate(self.prompt_batch.uids) if self.rows[u].cancelled()]
        if gone:
            rows = [self.rows[self.prompt_batch.uids[i]] for i in gone]
            self.prompt_batch.filter([i for i in range(len(self.prompt_batch)) if i not in gone])
            for row in rows:
                self._close(row, "cancelled")
        # decoding rows see their cancellation in their `feed`, at the next token

    def _decode(self) -> None:
        import mlx.core as mx

        gen = self.gen
        uids = list(gen.uids)
        self._select(uids)
        plan = self._drafts() if self.drafters else None
        verified = plan is not None and any(d for d, _ in plan)
        if verified:
            drafters = [self.drafters[u] for u in uids]
            results = speculative_batch.verify_batch(
                self.model, gen, [d for d, _ in plan], [f for _, f in plan], drafters
            )
            written = [(u, w, True) for u, w in zip(uids, results, strict=True)]
        else:
            # rows mlx-lm finished (eos, max_tokens) leave with their cache
            written = [
                (
                    r.uid,
                    speculative_batch.Written(
                        [(int(r.token), r.logprobs)], r.finish_reason, 1, r.prompt_cache
                    ),
                    r.finish_reason is None,
                )
                for r in gen.next()
            ]
        self.steps += 1
        if self.steps % 512 == 0:
            mx.clear_cache()
        leaving = []
        for uid, w, in_gen in written:
            row = self.rows[uid]
            finish, kept = None, 0
            for token, lp in w.tokens:
                row.tokens.append(token)
                kept += 1
                finish = row.feed(token, lp)
                if finish is not None:
                    break
            finish = finish or (w.finish if kept == len(w.tokens) else None)
            if uid in self.drafters:  # a plain step's tokens check prompt lookup's rate
                self.drafters[uid].extend([t for t, _ in w.tokens[:kept]], shadow=not verified)
            if finish is None:
                continue
            cache = w.cache
            if in_gen:  # the caller's stop (stop string, tool end, cancel), or a verify step's
                idx = gen.uids.index(uid)
                leaving.append(idx)
                keep = finish != "cancelled" and row.store_completion and self._caches(row)
                cache = gen.extract_cache(idx) if keep else None
                if cache is not None and uid in self.drafters:  # it ends at its last token
                    speculative.rollback(cache, w.fed - kept)
                    speculative.compact(cache)
            self._close(row, finish, cache)
        if leaving:
            gen.filter([i for i in range(len(gen)) if i not in leaving])

    def _drafts(self) -> list[tuple[list[int], int]] | None:
        """Each generating row's drafts to follow its pending token (none after an end token,
        nor past max_tokens), cut to the step's width (`speculative_batch.width`), and how many
        of them its grammar forced; None for a plain step. Whether any drafting can pay is asked
        before the pending tokens are evaluated, on each row's most drafts at its rate (a row
        under a grammar's as certain: it may force them all), an upper bound: where none can,
        the step is mlx-lm's own, pipelined. A draft model's own drafts (forward passes each)
        are capped at the width the rates give; prompt lookup's and a grammar's cost nothing, so
        the width is chosen on the drafts the rows then have."""
        import mlx.core as mx

        gen = self.gen
        drafters = [self.drafters[u] for u in gen.uids]
        rooms = [
            max(min(gen.max_tokens[i] - gen._num_tokens[i] - 1, d.k), 0)
            for i, d in enumerate(drafters)
        ]
        rates = [d.rate for d in drafters]
        bound = [
            (1.0 if d.grammars else a, r, 0) for d, a, r in zip(drafters, rates, rooms, strict=True)
        ]
        if speculative_batch.width(bound) < 1:  # no drafts can pay: a plain, pipelined step
            return None
        own = None
        if self.draft_model is not None:
            own = speculative_batch.width([(a, r, 0) for a, r in zip(rates, rooms, strict=True)])
        mx.eval(gen._next_tokens)
        plan = []
        tokens = gen._next_tokens.tolist()
        for uid, drafter, token, room in zip(gen.uids, drafters, tokens, rooms, strict=True):
            if room < 1 or token in self.eos:
                plan.append(([], 0))
                continue
            row = self.rows[uid]
            if self.draft_model is not None:  # a draft sharing the model's adapters: the row's
                self._select([uid])
            plan.append(drafter.draft([token], room, lambda r=row: r.prompt + r.tokens, own))
        if self.draft_model is not None:
            self._select(gen.uids)
        k = speculative_batch.width([(a, len(d), f) for a, (d, f) in zip(rates, plan, strict=True)])
        if k < 1:
            return None
        return [(d[:k], min(f, k)) for d, f in plan]

    def _admit(self) -> None:
        room = min(
            self.settings.prefill_batch - len(self.prompt_batch), self.settings.batch - self.running
        )
        admitted = []
        lengths = [self.rows[u].length for u in self.prompt_batch.uids + self.gen.uids]
        while self.waiting and len(admitted) < room:
            row = self.waiting[0]
            # Rows being prefilled are counted twice: moving to generation copies their cache. A row
            # alone is always admitted.
            copies = len(self.prompt_batch) + len(admitted) + 1
            if lengths and self.fits is not None and not self.fits(lengths + [row.length], copies):
                if row.uid not in self._waited:  # counted once per row
                    self._waited.add(row.uid)
                    self.memory_waits += 1
                break
            self.waiting.popleft()
            self._waited.discard(row.uid)
            self._start(row)
            admitted.append(row)
            lengths.append(row.length)
        if admitted:
            self.prompt_batch.extend(self._prompt_batch_of(admitted))
            for row in admitted:
                row.cache = None  # merged into the batch cache

    def _prefill(self) -> None:
        pb = self.prompt_batch
        # Rows with only the last prompt token left start generating (it is their first input).
        ready = [
            i
            for i, u in enumerate(pb.uids)
            if len(self.rows[u].pieces) == 1 and len(self.rows[u].pieces[0][0]) == 1
        ]
        if ready:
            uids = [pb.uids[i] for i in ready]
            self._select(uids)
            self.gen.extend(pb.split(ready).generate([self.rows[u].pieces[0][0] for u in uids]))
            for u in uids:
                self.rows[u].pieces.clear()
                self._drafter(self.rows[u])
        if not len(pb):
            return
        chunks, ended = [], []
        for u in pb.uids:
            piece = self.rows[u].pieces[0]
            n = min(len(piece[0]), self.settings.prefill_step)
            chunks.append(piece[0][:n])
            piece[0] = piece[0][n:]
            if not piece[0]:
                self.rows[u].pieces.pop(0)
                ended.append((u, piece))
        self._select(pb.uids)
        pb.prompt(chunks)
        for u, (_, end, kind) in ended:
            row = self.rows[u]
            if kind is not None and self._caches(row):
                self._store(row, row.prompt[:end], pb.extract_cache(pb.uids.index(u)), kind)

    def _drafter(self, row: Row) -> None:
        s = self.settings
        drafter = speculative.make_drafter(
            s.speculative, s.draft_tokens, row.processors, self.draft_model, s.prefill_step
        )
        if drafter is not None:
            drafter.extend(row.prompt)
            row.speculation = drafter.counts
            self.drafters[row.uid] = drafter

    def speculation_counts(self) -> speculative.Counts:
        """Drafted and accepted tokens of every row so far (left or still generating); /stats
        reads it on another thread, so the generating rows are a copy of the engine's dict."""
        total = speculative.Counts()
        total.add(self.speculation)
        for d in list(self.drafters.values()):
            total.add(d.counts)
        return total

    def stats(self) -> dict:
        return {
            "configured": self.settings.batch,
            "batched": True,
            "active_rows": self.running,
            "waiting_rows": len(self.waiting),
            "prefilling_rows": len(self.prompt_batch),
            "decoding_rows": len(self.gen),
            "peak_rows": self.peak_rows,
            "rows_served": self.rows_served,
            "decode_steps": self.steps,
            "memory_waits": self.memory_waits,
            "speculative": self.settings.speculative,
            **self.speculation_counts().as_dict(),
        }
