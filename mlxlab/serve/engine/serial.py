"""The serial lane: one request at a time on the decoder's serial path (mlxlab/decode/serial.py),
with the prompt cache; image requests on mlx-vlm's (engine/vision.py). A cancelled job (its
client gone, or the server aborting it) stops before the next prefill chunk or the next token.
"""

from __future__ import annotations

from mlxlab.decode.batch import Row
from mlxlab.decode.serial import run_serial
from mlxlab.serve.engine.jobs import AdapterSpec, Done, Job
from mlxlab.serve.engine.loaded import Loaded
from mlxlab.serve.engine.rows import RowOutput, cache_namespace, claim_adapters, make_sampling
from mlxlab.serve.engine.settings import EngineSettings
from mlxlab.serve.engine.vision import run as run_vision


class SerialLane:
    """`between`: run before each token is handed out (the gateway's tasks between decode steps:
    a load's slices, so a long serial job does not hold them up)."""

    def __init__(self, loaded: Loaded, cfg: EngineSettings, between=None):
        self.m, self.cfg, self.between = loaded, cfg, between

    def run(self, job: Job) -> Done:
        if job.vision is not None:  # images: mlx-vlm's model, no prompt cache (engine/vision.py)
            return run_vision(self.m, self.cfg, job)
        m = self.m
        ids = claim_adapters(m, job)
        m.adapters.selection.ids = ids
        try:
            return self._run(job, ids)
        finally:
            m.adapters.selection.clear()

    def _run(self, job: Job, ids: AdapterSpec) -> Done:
        import mlx.core as mx

        m = self.m
        out = RowOutput(m, job)
        if job.sampling.seed is not None:
            mx.random.seed(job.sampling.seed)
        sampler, processors = make_sampling(m, job)
        closed: list[Done] = []

        def done(finish: str, _tokens: list[int]) -> None:
            out.speculation = row.speculation
            closed.append(out.close(finish))

        feed = out.feed
        if self.between is not None:

            def feed(token, logprobs):
                self.between()
                return out.feed(token, logprobs)

        row = Row(
            list(job.prompt),
            job.max_tokens,
            feed,
            done,
            sampler=sampler,
            processors=processors,
            namespace=cache_namespace(m, ids),
            checkpoint=job.checkpoint or 0,
            cancelled=job.cancelled.is_set,
            started=lambda cached: setattr(job, "cached_tokens", cached),
            logprobs=bool(job.logprobs),  # RowOutput.feed reads them only then
        )
        run_serial(
            m.model,
            row,
            self.cfg.decode,
            m.cache,
            make_cache=m.kv.make_cache,
            draft_model=m.draft,
        )
        return closed[0]
