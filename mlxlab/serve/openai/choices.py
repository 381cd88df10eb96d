"""OpenAI's `n`, and the legacy completions' list of prompts: several choices for one request,
each its own job on the engine (rows of one batch when the batched lane runs), answered as one
body or one stream. Prompt `p`'s choice `i` has index `p * n + i`, as OpenAI numbers them.

- Choice `i` samples with `seed + i` when the request gives a seed (so each is reproducible and
  they differ), with fresh randomness otherwise; at temperature 0 they are the same answer.
- Usage counts each prompt once and every choice's completion tokens, as OpenAI does.
- Not streamed: every choice is collected; one that fails fails the request (the others are
  cancelled). Streamed: the choices' chunks interleave as they come, each with its `index`;
  one usage chunk (`include_usage`) and one `[DONE]` end the stream; a client that leaves
  cancels them all.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable

from fastapi.responses import StreamingResponse

from mlxlab.serve import answer, pipeline
from mlxlab.serve.ask import Ask
from mlxlab.serve.engine.jobs import Done, Job
from mlxlab.serve.http import SSE_HEADERS
from mlxlab.serve.openai import encode


async def prepare(gateway, cfg, builds: list[Callable[[], Ask]], model, n: int) -> list[Job]:
    """`n` jobs for each of `builds` (one per prompt; `pipeline.prepare` each, choice i seeded
    `seed + i`), in index order; if one cannot be made, the leases of those made are given
    back."""
    jobs: list[Job] = []
    try:
        for build in builds:
            for i in range(n):

                def build_i(i=i, build=build):
                    ask = build()
                    seed = ask.sampling.seed
                    if seed is not None:
                        ask.sampling = dataclasses.replace(ask.sampling, seed=seed + i)
                    return ask

                jobs.append(await pipeline.prepare(gateway, cfg, build_i, model))
    except BaseException:
        for job in jobs:
            job.lease.release()
        raise
    return jobs


def _disconnects(receive) -> tuple[Callable, asyncio.Future]:
    """One reader of the request's ASGI `receive` for several watchers (`answer.run`): each gets
    `http.disconnect` once the client has left."""
    gone = asyncio.Event()

    async def reader():
        await answer.client_gone(receive)
        gone.set()

    async def each():
        await gone.wait()
        return {"type": "http.disconnect"}

    return each, asyncio.ensure_future(reader())


async def collect(gateway, jobs: list[Job], receive) -> list[answer.Collector]:
    """Every job run to the end (`answer.collect`); the first failure (a full queue, a failed
    job, the client gone) cancels the rest at once and is raised. (By the time one has failed,
    every task has run its first step, which submits its job or gives its lease back; a
    cancelled task's job is ended by the engine, which gives that lease back.)"""
    each, reader = _disconnects(receive)
    tasks = [asyncio.ensure_future(answer.collect(gateway, job, each)) for job in jobs]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        if all(t.done() and not t.cancelled() and t.exception() is None for t in tasks):
            return [t.result() for t in tasks]
        raise next(t.exception() for t in tasks if t.done() and not t.cancelled() and t.exception())
    finally:
        reader.cancel()
        for job, task in zip(jobs, tasks, strict=True):
            job.cancelled.set()  # a no-op for a finished job
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # every error read


def usage(dones: dict[int, Done], n: int) -> dict:
    """Each prompt once (its first finished choice's count; choice `index` answers prompt
    `index // n`), every choice's completion tokens. A prompt none of whose choices finished
    (a stream whose choices all failed) is not counted."""
    prompts: dict[int, Done] = {}
    for i in sorted(dones):
        prompts.setdefault(i // n, dones[i])
    prompt = sum(d.prompt_tokens for d in prompts.values())
    completion = sum(d.completion_tokens for d in dones.values())
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(d.cached_tokens for d in prompts.values())},
    }


def merged_body(bodies: list[dict], dones: list[Done], n: int) -> dict:
    """One response from each choice's own body (`encode.chat_body` / `completion_body`)."""
    out = {**bodies[0], "choices": [], "usage": usage(dict(enumerate(dones)), n)}
    for i, body in enumerate(bodies):
        out["choices"].append({**body["choices"][0], "index": i})
    return out


async def stream(
    gateway,
    jobs: list[Job],
    encoders: list[answer.Encoder],
    head: dict,
    usage_on,
    n: int,
    usage_extra: dict | None = None,
):
    """One server-sent-event stream of every job's chunks, each encoder writing its choice's
    (`index`); the usage chunk adds `usage_extra` (chat's audio_seconds). Every job is
    submitted before the response starts (a full queue is a 503 then), but no first token is
    awaited: on a serial lane choice 1 starts when choice 0 ends, and the headers and choice 0's
    tokens must not wait for that."""
    queues: list[asyncio.Queue] = []
    for k, job in enumerate(jobs):
        try:
            queues.append(answer.submit(gateway, job))
        except BaseException:  # (the refused job's lease is back: `answer.submit`)
            for submitted in jobs[:k]:
                submitted.cancelled.set()  # the engine ends it and gives its lease back
            for never in jobs[k + 1 :]:
                never.lease.release()
            raise

    async def chunks():
        merged: asyncio.Queue = asyncio.Queue()

        async def drain(i):
            try:
                async for ev in answer.read(jobs[i], queues[i]):
                    await merged.put((i, ev))
            finally:
                merged.put_nowait((i, None))

        tasks = [asyncio.ensure_future(drain(i)) for i in range(len(jobs))]
        dones: dict[int, Done] = {}
        try:
            for enc in encoders:
                for chunk in enc.start():
                    yield chunk
            left = len(tasks)
            while left:
                i, ev = await merged.get()
                if ev is None:
                    left -= 1
                    continue
                if isinstance(ev, Done):
                    dones[i] = ev
                for chunk in answer.feed(encoders[i], ev):
                    yield chunk
            if usage_on and dones:
                yield encode.sse(
                    {**head, "choices": [], "usage": {**usage(dones, n), **(usage_extra or {})}}
                )
            yield "data: [DONE]\n\n"
        finally:
            for job, task in zip(jobs, tasks, strict=True):
                job.cancelled.set()  # a no-op for a finished job
                task.cancel()

    # Started here, up to its first chunk: if the response is never sent (the client left
    # before it began), the started generator is closed when collected and its `finally`
    # cancels every choice; one never started would leave them all running.
    gen = chunks()
    first = await gen.__anext__()

    async def body():
        try:
            yield first
            async for chunk in gen:
                yield chunk
        finally:
            await gen.aclose()

    return StreamingResponse(body(), media_type="text/event-stream", headers=SSE_HEADERS)
