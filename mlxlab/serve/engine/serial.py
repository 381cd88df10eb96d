"""The serial lane: one request at a time, with the prompt cache.

It prefills all but the last prompt token itself, so it can store prompt-cache checkpoints (end
of the system prompt, end of the prompt), then hands the last token to mlx-lm's `generate_step`.
A cancelled job (its client gone, or the server aborting it) stops before the next prefill chunk
or the next token.
A finished request also stores prompt + completion (the cache then holds exactly those tokens:
`generate_step` feeds each token as it computes the next).
"""

from __future__ import annotations

from mlxlab.config import ServeConfig
from mlxlab.serve.engine.jobs import AdapterSpec, Done, Job
from mlxlab.serve.engine.loaded import Loaded
from mlxlab.serve.engine.prompt_cache import prefill
from mlxlab.serve.engine.rows import (
    RowOutput,
    cache_namespace,
    claim_adapters,
    make_sampling,
    prompt_segments,
)
from mlxlab.serve.engine.vision import run as run_vision


class SerialLane:
    def __init__(self, loaded: Loaded, cfg: ServeConfig):
        self.m, self.cfg = loaded, cfg

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
        from mlx_lm.generate import generate_step

        m = self.m
        out = RowOutput(m, job)
        namespace = cache_namespace(m, ids)
        cache, cached = m.cache.fetch(namespace, job.prompt)
        if cache is None:
            cache = m.kv.make_cache(m.model)
        job.cached_tokens = cached
        *pieces, (end, _, _) = prompt_segments(job, cached)
        for start, stop, kind in pieces:
            # a client gone during a long prompt stops it within a chunk (serve.prefill_step)
            if not prefill(
                m.model, cache, job.prompt[start:stop], self.cfg.prefill_step, job.cancelled
            ):
                return out.close("cancelled")
            m.cache.insert(namespace, job.prompt[:stop], cache, kind=kind)
        if job.cancelled.is_set():
            return out.close("cancelled")
        if job.sampling.seed is not None:
            mx.random.seed(job.sampling.seed)
        sampler, processors = make_sampling(m, job)
        steps = generate_step(
            mx.array(job.prompt[end:]),
            m.model,
            max_tokens=job.max_tokens,
            sampler=sampler,
            logits_processors=processors,
            prompt_cache=cache,
            prefill_step_size=self.cfg.prefill_step,
        )
        finish = None
        for token, logprobs in steps:
            finish = out.feed(int(token), logprobs)  # the token is in the cache already (one ahead)
            if finish:
                break
        steps.close()
        done = out.close(finish or "length")  # "length": generate_step ended the loop at max_tokens
        if done.finish_reason != "cancelled":
            # The cache holds prompt + every token generated (each was fed as the next one was computed).
            m.cache.insert(namespace, job.prompt + out.tokens, cache, copy_cache=False)
        return done
