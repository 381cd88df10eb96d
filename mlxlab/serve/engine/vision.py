"""A job with images, on the serial lane: mlx-vlm's `generate_step` over the processor's inputs
(vision tower, projector, the family's embedding merge and positions), sampled by the row's
sampler and logits processors (`rows.make_sampling`: temperature, top-p/k, min-p, logit bias,
penalties, the grammar of a structured answer), its tokens through the same `RowOutput` as every
other job (stops, tool markup, reasoning, logprobs, streaming). The prompt cache is bypassed:
nothing is fetched for the prompt and nothing stored after it (`cached_tokens` is 0)."""

from __future__ import annotations

from mlxlab.serve.engine.jobs import Done, Job, JobError
from mlxlab.serve.engine.loaded import Loaded
from mlxlab.serve.engine.rows import RowOutput, make_sampling
from mlxlab.serve.engine.settings import EngineSettings


def run(m: Loaded, cfg: EngineSettings, job: Job) -> Done:
    import mlx.core as mx

    if m.vision is None:  # make_job refuses this before queueing; a guard, not a path
        raise JobError("this model has no vision", "model_has_no_vision")
    out = RowOutput(m, job)
    job.cached_tokens = 0
    if job.sampling.seed is not None:
        mx.random.seed(job.sampling.seed)
    sampler, processors = make_sampling(m, job)
    steps = m.vision.steps(job.vision, sampler, processors, job.max_tokens, cfg.decode.prefill_step)
    finish = None
    try:
        for token, logprobs in steps:
            finish = out.feed(int(token), logprobs)
            if finish:
                break
    finally:
        steps.close()
    return out.close(finish or "length")
