"""The batched lane: the server's jobs as rows of the batched decoder (mlxlab/decode/batch.py).

`serve.batch=N` (N > 1) turns it on. Each call to `step()` is one step of the decoder (one decode
step for every generating row, then admit, then prefill one chunk), in mlx-lm's
`BatchGenerator` order, so greedy tokens equal `BatchGenerator`'s (tests/test_serve_batch.py).
What the lane adds to the decoder is the server's side of a row:

- its adapters, claimed when it is queued (an adapter unmounted meanwhile fails the job) and
  selected per row before every forward pass (`lora.multi.Selection.set_rows`), so rows with
  different LoRA adapters decode in the same batch;
- the prompt cache namespace of its (model, adapter spec) and its checkpoint at the end of the
  system prompt, so batched and serial requests share one cache;
- memory admission (`Admission.fits_rows`: every row grown to prompt + max_tokens, padded to the
  longest, plus a copy of each row still prefilling; a request that cannot fit alone got a 400
  before it was queued);
- its output (`RowOutput`): stop strings, tool and reasoning parsing, logprobs, cancellation,
  exactly as on the serial lane;
- rows with the same sampling share one sampler object, so mlx-lm samples the batch in one call.
"""

from __future__ import annotations

from collections.abc import Callable

from mlxlab.decode.batch import BatchDecoder, Row
from mlxlab.serve.engine.jobs import Done, Job
from mlxlab.serve.engine.loaded import Loaded
from mlxlab.serve.engine.rows import RowOutput, cache_namespace, claim_adapters, make_sampling
from mlxlab.serve.engine.settings import EngineSettings


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


class BatchLane:
    def __init__(
        self,
        loaded: Loaded,
        cfg: EngineSettings,
        finished: Callable[[Job, Done | None, str | None], None],
    ):
        self.m = loaded
        self.size = cfg.decode.batch
        self.finished = finished  # (job, done, error) -> None, for the gateway's counters
        self._samplers: dict[tuple, Callable] = {}
        self._jobs: dict[int, Job] = {}  # row uid -> its job
        self.decoder = BatchDecoder(
            loaded.model,
            loaded.eos,
            cfg.decode,
            cache=loaded.cache,
            selection=loaded.adapters.selection,
            fits=loaded.admission.fits_rows,
            draft_model=loaded.draft,
        )

    @property
    def active(self) -> int:
        """Rows waiting, prefilling or decoding."""
        return self.decoder.active

    @property
    def running(self) -> int:
        return self.decoder.running

    @property
    def peak_rows(self) -> int:
        return self.decoder.peak_rows

    @property
    def rows_served(self) -> int:
        return self.decoder.rows_served

    def add(self, job: Job) -> None:
        """Queue a job as a row (raises JobError when its adapter is gone)."""
        m = self.m
        ids = claim_adapters(m, job)
        out = RowOutput(m, job)
        sampler, processors = make_sampling(m, job)
        key = (job.sampling.temperature, job.sampling.top_p, job.sampling.top_k, job.sampling.min_p)
        if len(self._samplers) > 64:
            self._samplers.clear()
        sampler = self._samplers.setdefault(key, sampler)
        row = Row(
            list(job.prompt),
            job.max_tokens,
            out.feed,
            lambda finish, _tokens: None,
            sampler=sampler,
            processors=processors,
            adapter=ids,
            namespace=cache_namespace(m, ids),
            checkpoint=job.checkpoint or 0,
            cancelled=job.cancelled.is_set,
            started=lambda cached: setattr(job, "cached_tokens", cached),
        )

        def done(finish: str, _tokens: list[int]) -> None:
            self._jobs.pop(row.uid, None)
            out.speculation = row.speculation
            self.finished(job, out.close(finish), None)

        row.done = done
        self.decoder.add(row)
        self._jobs[row.uid] = job

    def step(self) -> None:
        self.decoder.step()

    def fail_all(self, message: str) -> None:
        """A forward pass failed: every row fails, the batches start empty."""
        for row in self.decoder.drop_all():
            job = self._jobs.pop(row.uid, None)
            if job is not None:
                self.finished(job, None, message)

    def stats(self) -> dict:
        return self.decoder.stats()
