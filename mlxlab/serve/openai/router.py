"""OpenAI `POST /v1/chat/completions` and `POST /v1/completions`; errors in the OpenAI shape."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request

from mlxlab.serve import answer, pipeline
from mlxlab.serve.http import STREAMED, protocol_route
from mlxlab.serve.openai import audio, choices, encode
from mlxlab.serve.openai.protocol import ChatRequest, CompletionRequest, OpenAIError, error_shape

router = APIRouter(route_class=protocol_route(error_shape, OpenAIError))


def _example(body: dict) -> dict:
    """A request the schema shows (and schema-driven clients and fuzzers start from)."""
    return {"requestBody": {"content": {"application/json": {"example": body}}}}


CHAT_EXAMPLE = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}
COMPLETION_EXAMPLE = {"prompt": "Once upon a time", "max_tokens": 8}


@router.post("/v1/chat/completions", responses=STREAMED, openapi_extra=_example(CHAT_EXAMPLE))
async def chat(body: ChatRequest, request: Request):
    gateway, cfg = request.app.state.gateway, request.app.state.cfg
    heard = await audio.transcribe_parts(request, body)  # input_audio parts -> their transcripts
    if (body.n or 1) > 1:
        return await _chat_choices(body, request, heard)
    job = await pipeline.prepare(gateway, cfg, body.to_ask, body.model)
    job.id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
    head = {"id": job.id, "created": int(time.time()), "model": job.lease.asked}
    if body.stream:
        stream = audio.chat_stream(head, body.include_usage(), heard)
        return await answer.stream(gateway, job, stream)
    got = await answer.collect(gateway, job, request.receive)
    return audio.with_usage(encode.chat_body(head, got, bool(body.logprobs)), heard)


@router.post("/v1/completions", responses=STREAMED, openapi_extra=_example(COMPLETION_EXAMPLE))
async def completions(body: CompletionRequest, request: Request):
    gateway, cfg = request.app.state.gateway, request.app.state.cfg
    prompts = body.prompts()
    if len(prompts) > 1 or (body.n or 1) > 1:
        return await _completion_choices(body, request, prompts)
    job = await pipeline.prepare(gateway, cfg, lambda: body.to_ask(prompts[0]), body.model)
    job.id = f"cmpl-{uuid.uuid4().hex[:24]}"
    head = {
        "id": job.id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": job.lease.asked,
    }
    (echo,) = await _echoes(body, [job], prompts)
    if body.stream:
        return await answer.stream(
            gateway, job, encode.CompletionStream(head, body.include_usage(), echo=echo)
        )
    got = await answer.collect(gateway, job, request.receive)
    return encode.completion_body(head, got, echo)


async def _echoes(body: CompletionRequest, jobs: list, prompts: list) -> list[str]:
    """Each job's echo (job k answers prompt k // n): the prompt as text when the request asks
    for `echo` (token ids decoded once per prompt on the render thread, special tokens such as
    BOS left out), else "". If decoding fails, the jobs' leases are given back."""
    if not body.echo:
        return [""] * len(jobs)
    n = len(jobs) // len(prompts)

    def texts():
        tokenizer = jobs[0].lease.loaded.tokenizer
        return [
            p if isinstance(p, str) else tokenizer.decode(p, skip_special_tokens=True)
            for p in prompts
        ]

    try:
        decoded = await pipeline.off_loop(texts)
    except BaseException:
        for job in jobs:
            job.lease.release()
        raise
    return [decoded[k // n] for k in range(len(jobs))]


async def _jobs(body, request, prefix: str, builds):
    gateway, cfg = request.app.state.gateway, request.app.state.cfg
    jobs = await choices.prepare(gateway, cfg, builds, body.model, body.n or 1)
    rid = f"{prefix}-{uuid.uuid4().hex[:24]}"
    for job in jobs:
        job.id = rid
    return gateway, jobs, {"id": rid, "created": int(time.time()), "model": jobs[0].lease.asked}


async def _chat_choices(body: ChatRequest, request: Request, heard):
    gateway, jobs, head = await _jobs(body, request, "chatcmpl", [body.to_ask])
    n = body.n or 1
    if body.stream:
        encoders = [encode.ChatStream(head, False, i) for i in range(len(jobs))]
        chunk_head = {**head, "object": "chat.completion.chunk"}
        return await choices.stream(
            gateway, jobs, encoders, chunk_head, body.include_usage(), n, audio.usage_extra(heard)
        )
    gots = await choices.collect(gateway, jobs, request.receive)
    bodies = [encode.chat_body(head, got, bool(body.logprobs)) for got in gots]
    return audio.with_usage(choices.merged_body(bodies, [g.finished for g in gots], n), heard)


async def _completion_choices(body: CompletionRequest, request: Request, prompts):
    builds = [lambda p=p: body.to_ask(p) for p in prompts]
    gateway, jobs, head = await _jobs(body, request, "cmpl", builds)
    head = {**head, "object": "text_completion"}
    n = body.n or 1
    echoes = await _echoes(body, jobs, prompts)
    if body.stream:
        encoders = [encode.CompletionStream(head, False, k, echo=e) for k, e in enumerate(echoes)]
        return await choices.stream(gateway, jobs, encoders, head, body.include_usage(), n)
    gots = await choices.collect(gateway, jobs, request.receive)
    bodies = [encode.completion_body(head, got, e) for got, e in zip(gots, echoes, strict=True)]
    return choices.merged_body(bodies, [g.finished for g in gots], n)
