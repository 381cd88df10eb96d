"""Anthropic `POST /v1/messages` and `POST /v1/messages/count_tokens`; errors in the Anthropic shape."""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Request

from mlxlab.serve import pipeline
from mlxlab.serve.anthropic import encode
from mlxlab.serve.anthropic.protocol import (
    AnthropicError,
    CountRequest,
    MessagesRequest,
    error_shape,
    template_kwargs,
    to_ask,
    to_chat,
)
from mlxlab.serve.http import STREAMED, protocol_route

router = APIRouter(route_class=protocol_route(error_shape, AnthropicError))


@router.post("/v1/messages", responses=STREAMED)
async def messages(body: MessagesRequest, request: Request):
    gateway, cfg = request.app.state.gateway, request.app.state.cfg
    job = await pipeline.prepare(gateway, cfg, lambda: to_ask(body))
    job.id = f"msg_{uuid.uuid4().hex[:24]}"
    if body.stream:
        return await pipeline.stream(gateway, job, encode.MessageStream(job.id, cfg.model, job))
    got = await pipeline.collect(gateway, job, request.is_disconnected)
    return encode.message_body(job.id, cfg.model, got)


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountRequest, request: Request):
    gateway, cfg = request.app.state.gateway, request.app.state.cfg

    def count() -> int:
        chat, tools, origins, schemas = to_chat(body)
        pipeline.check_request(cfg, pipeline.Ask(messages=chat, tools=tools, tool_schemas=schemas))
        loaded = pipeline.ready_loaded(gateway)
        prompt, _, _ = pipeline.render_chat(loaded, chat, tools, template_kwargs(body), origins)
        return len(prompt)

    return {"input_tokens": await pipeline.off_loop(count)}
