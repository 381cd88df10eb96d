"""OpenAI Responses: `POST /v1/responses`, `GET`/`DELETE /v1/responses/{id}`,
`GET /v1/responses/{id}/input_items`; errors in the OpenAI shape. The store
(`app.state.response_store`) keeps what `previous_response_id` needs; an unknown or expired id is
a 404."""

from __future__ import annotations

import json
import time
from typing import Literal

from fastapi import APIRouter, Query, Request

from mlxlab.serve import answer, pipeline, vision
from mlxlab.serve.engine.jobs import Done
from mlxlab.serve.http import STREAMED, APIError, protocol_route
from mlxlab.serve.openai.protocol import OpenAIError, error_shape
from mlxlab.serve.responses.encode import Draft, ResponseStream, input_items
from mlxlab.serve.responses.protocol import ResponsesRequest, to_ask, to_chat
from mlxlab.serve.responses.store import ResponseStore

router = APIRouter(route_class=protocol_route(error_shape, OpenAIError))


def not_found(rid: str, param: str | None = None) -> APIError:
    return APIError(
        404,
        f"response {rid!r} not found (unknown or expired)",
        type="not_found_error",
        param=param,
        code="response_not_found",
    )


def remember(
    store: ResponseStore, resp: dict, messages: list[dict], instructions, done: Done, text: str
) -> None:
    """Keep the conversation with this answer appended, for a follow-up's previous_response_id
    (images as their hashes: only a new user message's images are shown to the model)."""
    convo = vision.for_store(messages)
    if done.tool_calls:
        convo.append(
            {
                "role": "assistant",
                "content": text,
                "tool_calls": [
                    {
                        "id": c["id"],
                        "type": "function",
                        "function": {"name": c["name"], "arguments": json.loads(c["arguments"])},
                    }
                    for c in done.tool_calls
                ],
            }
        )
    else:
        convo.append({"role": "assistant", "content": text})
    store.put(
        resp["id"],
        {
            "messages": convo,
            "inputs": len(messages),  # the messages before this answer: its input items
            "instructions": instructions,
            "response": resp,
        },
    )


@router.post("/v1/responses", responses=STREAMED)
async def create(body: ResponsesRequest, request: Request):
    gateway, cfg = request.app.state.gateway, request.app.state.cfg
    store: ResponseStore = request.app.state.response_store
    previous = None
    if body.previous_response_id:
        previous = store.get(body.previous_response_id)
        if previous is None:
            raise not_found(body.previous_response_id, "previous_response_id")
    messages, instructions, origins = to_chat(body, previous)
    if not messages:
        raise APIError(400, "input has no messages", param="input")
    if (
        body.store
        and ResponseStore.size_of(
            {"messages": vision.for_store(messages), "instructions": instructions}
        )
        > store.max_bytes
    ):
        raise APIError(
            400,
            f"the conversation exceeds the response store's {store.max_bytes} bytes; send it "
            "with store=false",
            param="store",
            code="store_entry_too_large",
        )
    job = await pipeline.prepare(
        gateway, cfg, lambda: to_ask(body, messages, instructions, origins), body.model
    )
    draft = Draft(body, job.lease.asked, instructions, int(time.time()))

    def on_final(resp: dict, done: Done, text: str) -> None:
        if body.store:
            remember(store, resp, messages, instructions, done, text)

    if body.stream:
        return await answer.stream(gateway, job, ResponseStream(draft, on_final))
    got = await answer.collect(gateway, job, request.receive)
    resp = draft.final(got.finished, got.reasoning, got.content, got.content_logprobs)
    on_final(resp, got.finished, got.content)
    return resp


@router.get("/v1/responses/{rid}")
async def get(rid: str, request: Request):
    entry = request.app.state.response_store.get(rid)
    if entry is None:
        raise not_found(rid)
    return entry["response"]


@router.get("/v1/responses/{rid}/input_items")
async def list_input_items(
    rid: str,
    request: Request,
    limit: int = Query(20, ge=1, le=100),
    order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
    before: str | None = None,
):
    """The input items of a stored response (its chain's earlier turns included), a page of
    `limit` in `order` (newest first by default, as OpenAI), after or before an item id."""
    entry = request.app.state.response_store.get(rid)
    if entry is None:
        raise not_found(rid)
    items = input_items(rid, entry["messages"][: entry.get("inputs", len(entry["messages"]))])
    if order == "desc":
        items.reverse()
    ids = [i["id"] for i in items]
    for cursor, name in ((after, "after"), (before, "before")):
        if cursor is not None and cursor not in ids:
            raise APIError(
                404, f"no input item {cursor!r} in {rid!r}", type="not_found_error", param=name
            )
    if after is not None:
        items = items[ids.index(after) + 1 :]
    if before is not None:  # the page just before the cursor
        left = [i["id"] for i in items]
        items = items[: left.index(before)] if before in left else []
        page, more = items[-limit:], len(items) > limit
    else:
        page, more = items[:limit], len(items) > limit
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": more,
    }


@router.delete("/v1/responses/{rid}")
async def delete(rid: str, request: Request):
    if not request.app.state.response_store.delete(rid):
        raise not_found(rid)
    return {"id": rid, "object": "response.deleted", "deleted": True}
