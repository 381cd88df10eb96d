"""Anthropic `POST /v1/messages` and `POST /v1/messages/count_tokens`; errors in the Anthropic shape."""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Request

from mlxlab.serve import answer, model_choice, pipeline, vision
from mlxlab.serve.anthropic import encode
from mlxlab.serve.anthropic.protocol import (
    AnthropicError,
    CountRequest,
    MessagesRequest,
    error_shape,
    shape_of,
    template_kwargs,
    to_ask,
    to_chat,
)
from mlxlab.serve.ask import Ask, render_chat
from mlxlab.serve.http import STREAMED, protocol_route
from mlxlab.serve.structured import grammar_for

router = APIRouter(route_class=protocol_route(error_shape, AnthropicError))


@router.post("/v1/messages", responses=STREAMED)
async def messages(body: MessagesRequest, request: Request):
    gateway, cfg = request.app.state.gateway, request.app.state.cfg
    job = await pipeline.prepare(gateway, cfg, lambda: to_ask(body), body.model)
    job.id = f"msg_{uuid.uuid4().hex[:24]}"
    if body.stream:
        return await answer.stream(gateway, job, encode.MessageStream(job.id, job.lease.asked, job))
    got = await answer.collect(gateway, job, request.receive)
    return encode.message_body(job.id, job.lease.asked, got)


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountRequest, request: Request):
    gateway, cfg = request.app.state.gateway, request.app.state.cfg

    def build() -> Ask:
        chat, tools, origins, schemas = to_chat(body)
        kwargs = template_kwargs(body)
        return Ask(
            messages=chat,
            tools=tools,
            tool_schemas=schemas,
            template_kwargs=kwargs,
            origins=origins,
        )

    def count(ask: Ask, loaded) -> int:
        pipeline.check_request(cfg, ask)
        shape = shape_of(body)
        seen = vision.plan(cfg, loaded, ask)  # with images: the processor's tokens
        if seen is not None and seen.inputs is not None:
            prompt, reasoning = seen.prompt, seen.reasoning
        else:
            messages = seen.messages if seen is not None else ask.messages
            prompt, _, reasoning = render_chat(
                loaded, messages, ask.tools, ask.template_kwargs, ask.origins
            )
        if shape.constrained:  # refused as /v1/messages refuses it
            grammar_for(shape, ask.tools, loaded, reasoning)
        return len(prompt)

    ask = await pipeline.off_loop(build)
    lease = await model_choice.lease_for(gateway, body.model)  # the tokens of the model it names
    try:
        await vision.fetch_images(cfg, lease.loaded, ask)
        return {"input_tokens": await pipeline.off_loop(count, ask, lease.loaded)}
    finally:
        lease.release()
