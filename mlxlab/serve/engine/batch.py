"""The batched lane: continuous batching over mlx-lm's `PromptProcessingBatch` and `GenerationBatch`.

`serve.batch=N` (N > 1) turns it on. Each call to `step()` does what one `BatchGenerator.next()`
does, in the same order: one decode step for every generating row, then admit waiting rows into
the prompt batch, move rows whose prompt is done into the generation batch, and prefill one
chunk (`serve.prefill_step`) of every prompt still being read. Rows join and leave between
steps. Keeping mlx-lm's order and its batch classes (padding, batch KV caches, per-row samplers,
its stop-token matcher) is what makes greedy tokens equal `BatchGenerator`'s
(tests/test_serve_batch.py). What the lane adds:

- the prompt cache: a row starts, when it is admitted, from the longest cached prefix of its
  (model, adapter) namespace (so it can reuse what rows admitted before it stored), and stores the same checkpoints as the serial lane (end of the system prompt, end
  of the prompt, prompt + completion when it finishes), so batched and serial requests share
  one cache;
- per-row adapters: before every forward pass the lane sets one adapter spec per batch row
  (`lora.multi.Selection.set_rows`), so rows with different LoRA adapters decode in the same batch;
- aggregate memory admission: a waiting row is admitted only when every row, each grown to
  prompt + max_tokens and padded to the longest, plus a copy of each row still prefilling, fits
  the memory budget together (`Admission.fits_rows`); otherwise it waits for rows to finish (a
  row alone is always admitted: one that cannot fit alone was refused with 400 before queueing);
- per-row output (`RowOutput`): stop strings, tool and reasoning parsing, logprobs,
  cancellation, exactly as on the serial lane.

At most `serve.batch` rows are in the prompt and generation batches together (mlx-lm's
`completion_batch_size` is a soft limit; this one is hard, so memory admission means something).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from mlxlab.serve.engine.jobs import AdapterSpec, Done, Job
from mlxlab.serve.engine.loaded import Loaded
from mlxlab.serve.engine.rows import (
    RowOutput,
    cache_namespace,
    claim_adapters,
    make_sampling,
    prompt_segments,
)
from mlxlab.serve.engine.settings import EngineSettings

log = logging.getLogger(__name__)


def batchable(job: Job) -> bool:
    """Whether a job can join a batch: its sampling must not need a seeded RNG or a token history,
    and it has no images (those run through mlx-vlm on the serial lane)."""
    s = job.sampling
    return (
        job.vision is None
        and s.seed is None
        and not s.repetition_penalty
        and not s.presence_penalty
        and not s.frequency_penalty
    )


@dataclass
class Segment:
    tokens: list[int]
    end: int  # prompt position where the segment ends
    kind: str | None  # prompt-cache checkpoint to store at its end (system | user), or None


@dataclass
class Row:
    uid: int
    job: Job
    ids: AdapterSpec
    out: RowOutput
    cache: list | None
    segments: list[Segment] = field(default_factory=list)
    sampler: Callable | None = None
    processors: list = field(default_factory=list)

    @property
    def length(self) -> int:
        return len(self.job.prompt) + self.job.max_tokens


class BatchLane:
    def __init__(
        self,
        loaded: Loaded,
        cfg: EngineSettings,
        finished: Callable[[Job, Done | None, str | None], None],
    ):
        from mlx_lm.generate import StopSequences
        from mlx_lm.sample_utils import make_sampler

        self.m, self.cfg = loaded, cfg
        self.size = cfg.decode.batch
        self.prefill_size = min(cfg.decode.prefill_batch, cfg.decode.batch)
        self.finished = finished  # (job, done, error) -> None, for the gateway's counters
        self._fallback = make_sampler(temp=0.0)
        self._stop = StopSequences([[t] for t in sorted(loaded.eos)])
        self._uid = 0
        self._samplers: dict[tuple, Callable] = {}
        self.waiting: deque[Row] = deque()
        self.rows: dict[int, Row] = {}
        self._empty_batches()
        self.steps = 0
        self.rows_served = 0
        self.peak_rows = 0
        self.memory_waits = 0
        self._waited: set[int] = set()

    # --- rows in and out ---------------------------------------------------------------------

    @property
    def active(self) -> int:
        """Rows waiting, prefilling or decoding."""
        return len(self.waiting) + len(self.prompt_batch) + len(self.gen)

    @property
    def running(self) -> int:
        return len(self.prompt_batch) + len(self.gen)

    def add(self, job: Job) -> None:
        """Queue a job as a row (raises JobError when its adapter is gone)."""
        m = self.m
        ids = claim_adapters(m, job)
        row = Row(self._uid, job, ids, RowOutput(m, job), None)
        self._uid += 1
        row.sampler, row.processors = make_sampling(m, job)
        # Rows with the same sampling share one sampler object: mlx-lm then samples the whole batch
        # in one call instead of one call per row.
        key = (job.sampling.temperature, job.sampling.top_p, job.sampling.top_k, job.sampling.min_p)
        if len(self._samplers) > 64:
            self._samplers.clear()
        row.sampler = self._samplers.setdefault(key, row.sampler)
        self.rows[row.uid] = row
        self.waiting.append(row)

    def _start(self, row: Row) -> None:
        """At admission: the longest cached prefix (so a row admitted after another with the same
        system prompt reuses its checkpoint), then the pieces of the prompt still to run."""
        from mlx_lm.models.cache import make_prompt_cache

        m, job = self.m, row.job
        cache, cached = m.cache.fetch(cache_namespace(m, row.ids), job.prompt)
        row.cache = cache if cache is not None else make_prompt_cache(m.model)
        job.cached_tokens = cached
        row.segments = [
            Segment(job.prompt[a:b], b, kind) for a, b, kind in prompt_segments(job, cached)
        ]

    def _close(self, row: Row, finish: str, cache=None) -> None:
        """The row leaves: its Done is sent, then (not cancelled) prompt + completion is cached."""
        del self.rows[row.uid]
        self._waited.discard(row.uid)
        done = row.out.close(finish)
        self.rows_served += 1
        self.finished(row.job, done, None)
        if cache is not None and finish != "cancelled":
            try:  # the answer is out: a failed cache insert must not touch it
                self.m.cache.insert(
                    cache_namespace(self.m, row.ids),
                    row.job.prompt + row.out.tokens,
                    cache,
                    copy_cache=False,
                )
            except Exception:  # noqa: BLE001
                log.exception("mlxlab serve: storing a finished row in the prompt cache failed")

    def _prompt_batch_of(self, rows: list[Row]):
        """A prompt batch of newly admitted rows (their caches merged into one batch cache)."""
        from mlx_lm.generate import PromptProcessingBatch

        return PromptProcessingBatch(
            model=self.m.model,
            uids=[r.uid for r in rows],
            caches=[r.cache for r in rows],
            tokens=[list(r.job.prompt[: r.job.cached_tokens]) for r in rows],
            prefill_step_size=self.cfg.decode.prefill_step,
            samplers=[r.sampler for r in rows],
            fallback_sampler=self._fallback,
            logits_processors=[r.processors for r in rows],
            stop_sequences=[self._stop] * len(rows),
            max_tokens=[r.job.max_tokens for r in rows],
        )

    def _empty_batches(self) -> None:
        from mlx_lm.generate import GenerationBatch, PromptProcessingBatch

        self.prompt_batch = PromptProcessingBatch.empty(
            self.m.model, self._fallback, self.cfg.decode.prefill_step
        )
        self.gen = GenerationBatch.empty(self.m.model, self._fallback)

    def fail_all(self, message: str) -> None:
        """A forward pass failed: every row fails, the batches start empty."""
        for row in list(self.rows.values()):
            self.finished(row.job, None, message)
        self.rows.clear()
        self.waiting.clear()
        self._waited.clear()
        self._empty_batches()
        self.m.adapters.selection.clear()

    # --- one scheduler step ------------------------------------------------------------------

    def _select(self, uids: list[int]) -> None:
        self.m.adapters.selection.set_rows([self.rows[u].ids for u in uids])

    def step(self) -> None:
        import mlx.core as mx
        from mlx_lm.generate import generation_stream

        with mx.stream(generation_stream):
            try:
                self._drop_cancelled()
                if len(self.gen):
                    self._decode()
                if len(self.gen) >= self.size:
                    return
                self._admit()
                self._prefill()
            finally:
                self.m.adapters.selection.clear()
                self.peak_rows = max(self.peak_rows, self.running)

    def _drop_cancelled(self) -> None:
        for row in [r for r in self.waiting if r.job.cancelled.is_set()]:
            self.waiting.remove(row)
            self._close(row, "cancelled")
        gone = [
            i for i, u in enumerate(self.prompt_batch.uids) if self.rows[u].job.cancelled.is_set()
        ]
        if gone:
            rows = [self.rows[self.prompt_batch.uids[i]] for i in gone]
            self.prompt_batch.filter([i for i in range(len(self.prompt_batch)) if i not in gone])
            for row in rows:
                self._close(row, "cancelled")
        # decoding rows see their cancellation in RowOutput.feed, at the next token

    def _decode(self) -> None:
        import mlx.core as mx

        self._select(self.gen.uids)
        responses = self.gen.next()  # rows mlx-lm finished (eos, max_tokens) leave with their cache
        self.steps += 1
        if self.steps % 512 == 0:
            mx.clear_cache()
        leaving = []
        for r in responses:
            row = self.rows[r.uid]
            finish = row.out.feed(int(r.token), r.logprobs) or r.finish_reason
            if finish is None:
                continue
            if (
                r.finish_reason is None
            ):  # our stop (stop string, tool end, cancel): still in the batch
                idx = self.gen.uids.index(r.uid)
                leaving.append(idx)
                keep = finish != "cancelled" and self.m.cache.enabled
                cache = self.gen.extract_cache(idx) if keep else None
            else:
                cache = r.prompt_cache
            self._close(row, finish, cache)
        if leaving:
            self.gen.filter([i for i in range(len(self.gen)) if i not in leaving])

    def _admit(self) -> None:
        room = min(self.prefill_size - len(self.prompt_batch), self.size - self.running)
        admitted = []
        lengths = [self.rows[u].length for u in self.prompt_batch.uids + self.gen.uids]
        while self.waiting and len(admitted) < room:
            row = self.waiting[0]
            # Rows being prefilled are counted twice: moving to generation copies their cache. A row
            # alone is always admitted: it passed the single-request ceiling before it was queued.
            copies = len(self.prompt_batch) + len(admitted) + 1
            if lengths and not self.m.admission.fits_rows(lengths + [row.length], copies):
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
            if len(self.rows[u].segments) == 1 and len(self.rows[u].segments[0].tokens) == 1
        ]
        if ready:
            uids = [pb.uids[i] for i in ready]
            self._select(uids)
            self.gen.extend(
                pb.split(ready).generate([self.rows[u].segments[0].tokens for u in uids])
            )
            for u in uids:
                self.rows[u].segments.clear()
        if not len(pb):
            return
        chunks, ended = [], []
        for u in pb.uids:
            seg = self.rows[u].segments[0]
            n = min(len(seg.tokens), self.cfg.decode.prefill_step)
            chunks.append(seg.tokens[:n])
            seg.tokens = seg.tokens[n:]
            if not seg.tokens:
                self.rows[u].segments.pop(0)
                ended.append((u, seg))
        self._select(pb.uids)
        pb.prompt(chunks)
        for u, seg in ended:
            if seg.kind is not None and self.m.cache.enabled:
                row = self.rows[u]
                self.m.cache.insert(
                    cache_namespace(self.m, row.ids),
                    row.job.prompt[: seg.end],
                    pb.extract_cache(pb.uids.index(u)),
                    kind=seg.kind,
                    copy_cache=False,
                )

    def stats(self) -> dict:
        return {
            "configured": self.size,
            "batched": True,
            "active_rows": self.running,
            "waiting_rows": len(self.waiting),
            "prefilling_rows": len(self.prompt_batch),
            "decoding_rows": len(self.gen),
            "peak_rows": self.peak_rows,
            "rows_served": self.rows_served,
            "decode_steps": self.steps,
            "memory_waits": self.memory_waits,
        }
