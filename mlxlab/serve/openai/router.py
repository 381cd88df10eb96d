"""OpenAI `POST /v1/chat/completions` and `POST /v1/completions`; errors in the OpenAI shape."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request

from mlxlab.serve import answer, pipeline
from mlxlab.serve.http import STREAMED, protocol_route
from mlxlab.serve.openai import audio, encode
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
    job = await pipeline.prepare(gateway, cfg, body.to_ask, body.model)
    job.id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
    head = {"id": job.id, "created": int(time.time()), "model": job.lease.asked}
    if body.stream:
        stream = audio.chat_stream(head, body.include_usage(), heard)
        return await answer.stream(gateway, job, stream)
    got = await answer.collect(gateway, job, request.receive)
    return audio.with_usage(encode.chat_body(head, got, body.logprobs), heard)


@router.post("/v1/completions", responses=STREAMED, openapi_extra=_example(COMPLETION_EXAMPLE))
async def completions(body: CompletionRequest, request: Request):
    gateway, cfg = request.app.state.gateway, request.app.state.cfg
    job = await pipeline.prepare(gateway, cfg, body.to_ask, body.model)
    job.id = f"cmpl-{uuid.uuid4().hex[:24]}"
    head = {
        "id": job.id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": job.lease.asked,
    }
    if body.stream:
        return await answer.stream(
            gateway, job, encode.CompletionStream(head, body.include_usage())
        )
    got = await answer.collect(gateway, job, request.receive)
    return encode.completion_body(head, got)
