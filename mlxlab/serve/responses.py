"""OpenAI Responses over the shared request path: `POST /v1/responses`, `GET`/`DELETE
/v1/responses/{id}`, and the per-process response store behind `previous_response_id`.

`input` (a string, or items: message, function_call, function_call_output) and `instructions`
become chat messages (instructions and system/developer items merged into one leading system
message); `previous_response_id` splices the stored conversation and its output back in, the
instructions carrying forward when the new request gives none. The store keeps what a follow-up
needs (the conversation as chat messages, the instructions, the response object) for an hour,
byte-capped (32 MiB) with least-recently-used eviction; an unknown or expired id is a 404.

Streams carry `sequence_number` on every event: response.created -> response.in_progress ->
(output_item.added -> content_part.added -> output_text.delta... -> output_text.done ->
content_part.done -> output_item.done) per message, function_call_arguments.delta/.done per
call, reasoning_text.delta/.done for reasoning -> response.completed (response.incomplete when
max_output_tokens cut it short, as OpenAI does).
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from mlxlab.config import ServeConfig
from mlxlab.serve import pipeline
from mlxlab.serve.engine import Delta, Done, Failed, Gateway
from mlxlab.serve.protocol import APIError


class ResponseStore:
    """id -> stored response; TTL plus a byte cap with LRU eviction."""

    def __init__(self, max_bytes: int = 32 * 2**20, ttl_s: float = 3600.0):
        self.max_bytes, self.ttl_s = max_bytes, ttl_s
        self._items: OrderedDict[str, tuple[float, int, dict]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.evicted = self.expired = 0

    @staticmethod
    def size_of(entry: dict) -> int:
        return len(json.dumps(entry, ensure_ascii=False).encode())

    def _expire(self, now: float) -> None:
        for key in [k for k, (t, _, _) in self._items.items() if now - t > self.ttl_s]:
            self._bytes -= self._items.pop(key)[1]
            self.expired += 1

    def put(self, rid: str, entry: dict) -> bool:
        size = self.size_of(entry)
        if size > self.max_bytes:
            return False
        with self._lock:
            now = time.time()
            self._expire(now)
            if rid in self._items:
                self._bytes -= self._items.pop(rid)[1]
            self._items[rid] = (now, size, entry)
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, (_, old, _) = self._items.popitem(last=False)
                self._bytes -= old
                self.evicted += 1
        return True

    def get(self, rid: str) -> dict | None:
        with self._lock:
            self._expire(time.time())
            item = self._items.get(rid)
            if item is None:
                return None
            self._items.move_to_end(rid)
            return item[2]

    def delete(self, rid: str) -> bool:
        with self._lock:
            item = self._items.pop(rid, None)
            if item:
                self._bytes -= item[1]
            return item is not None

    def stats(self) -> dict:
        with self._lock:
            self._expire(time.time())
            return {"entries": len(self._items), "bytes": self._bytes, "max_bytes": self.max_bytes,
                    "ttl_ms": int(self.ttl_s * 1000), "evicted": self.evicted, "expired": self.expired}


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    stream: bool = False
    store: bool = True
    metadata: dict[str, Any] | None = None
    adapter: str | None = None
    reasoning: dict[str, Any] | None = None


def _item_text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}: content must be a string or a list of parts", param=where)
    return pipeline.text_of(content, where)


def to_chat(body: ResponsesRequest, previous: dict | None) -> tuple[list[dict], str | None]:
    """(conversation messages without the system message, instructions in force)."""
    messages = list(previous["messages"]) if previous else []
    instructions = body.instructions if body.instructions is not None else (previous or {}).get("instructions")
    known_calls = {c["id"] for m in messages for c in m.get("tool_calls", [])}
    items = [{"type": "message", "role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    system_extra = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise APIError(400, f"{where}: an item must be an object", param=where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(400, f"{where}: unknown role {role!r}", param=where)
            text = _item_text(item.get("content", ""), f"{where}.content")
            if role in ("system", "developer"):
                system_extra.append(text)
            else:
                messages.append({"role": role, "content": text})
        elif kind == "function_call":
            call_id, name = item.get("call_id"), item.get("name")
            if not isinstance(call_id, str) or not isinstance(name, str):
                raise APIError(400, f"{where}: function_call needs string call_id and name", param=where)
            try:
                args = json.loads(item.get("arguments") or "{}")
            except (TypeError, json.JSONDecodeError):
                raise APIError(400, f"{where}: function_call arguments are not JSON", param=where) from None
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls") is not None:
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            known_calls.add(call_id)
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if call_id not in known_calls:
                raise APIError(400, f"{where}: function_call_output for {call_id!r} has no matching "
                                    "function_call", param=where)
            output = item.get("output", "")
            messages.append({"role": "tool", "tool_call_id": call_id,
                             "content": output if isinstance(output, str) else json.dumps(output)})
        elif kind == "reasoning":
            continue
        else:
            raise APIError(400, f"{where}: unsupported item type {kind!r}", param=where)
    if system_extra:
        instructions = "\n\n".join([*([instructions] if instructions else []), *system_extra])
    return messages, instructions


def _tools(body: ResponsesRequest) -> list[dict] | None:
    if body.tool_choice == "none":
        return None
    out = []
    for i, t in enumerate(body.tools or []):
        if t.get("type") != "function":
            continue  # built-in tools (web_search, file_search, ...) are not run here
        if not isinstance(t.get("name"), str):
            raise APIError(400, f"tools[{i}]: a function tool needs a string name", param=f"tools[{i}]")
        out.append({"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                                     "parameters": t.get("parameters") or {}}})
    return out or None


def register(app: FastAPI, cfg: ServeConfig, gateway: Gateway) -> None:
    store = ResponseStore()
    app.state.response_store = store

    def base(rid: str, body: ResponsesRequest, instructions, created: int, status: str) -> dict:
        return {"id": rid, "object": "response", "created_at": created, "status": status, "model": cfg.model,
                "output": [], "error": None, "incomplete_details": None, "instructions": instructions,
                "max_output_tokens": body.max_output_tokens, "previous_response_id": body.previous_response_id,
                "temperature": body.temperature, "top_p": body.top_p, "parallel_tool_calls": True,
                "tool_choice": body.tool_choice or "auto", "tools": body.tools or [], "store": body.store,
                "text": {"format": {"type": "text"}}, "metadata": body.metadata or {}, "usage": None}

    def finish(resp: dict, done: Done, reasoning: str, text: str, ids: dict) -> dict:
        output = []
        if reasoning:
            output.append({"type": "reasoning", "id": ids["reasoning"], "summary": [],
                           "content": [{"type": "reasoning_text", "text": reasoning}]})
        if text or not done.tool_calls:
            output.append({"type": "message", "id": ids["message"], "status": "completed", "role": "assistant",
                           "content": [{"type": "output_text", "text": text, "annotations": []}]})
        for c in done.tool_calls:
            output.append({"type": "function_call", "id": "fc_" + c["id"].removeprefix("call_"), "call_id": c["id"],
                           "name": c["name"], "arguments": c["arguments"], "status": "completed"})
        incomplete = done.finish_reason == "length"
        resp.update(status="incomplete" if incomplete else "completed", output=output,
                    incomplete_details={"reason": "max_output_tokens"} if incomplete else None,
                    usage={"input_tokens": done.prompt_tokens,
                           "input_tokens_details": {"cached_tokens": done.cached_tokens},
                           "output_tokens": done.completion_tokens,
                           "output_tokens_details": {"reasoning_tokens": 0},
                           "total_tokens": done.prompt_tokens + done.completion_tokens})
        resp["output_text"] = text
        return resp

    def remember(resp: dict, messages: list[dict], instructions, done: Done, text: str) -> None:
        convo = list(messages)
        if done.tool_calls:
            convo.append({"role": "assistant", "content": text, "tool_calls": [
                {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": json.loads(c["arguments"])}}
                for c in done.tool_calls]})
        else:
            convo.append({"role": "assistant", "content": text})
        store.put(resp["id"], {"messages": convo, "instructions": instructions, "response": resp})

    @app.post("/v1/responses")
    async def create(body: ResponsesRequest, request: Request):
        previous = None
        if body.previous_response_id:
            previous = store.get(body.previous_response_id)
            if previous is None:
                raise APIError(404, f"response {body.previous_response_id!r} not found (unknown or expired)",
                               type="not_found_error", param="previous_response_id", code="response_not_found")
        messages, instructions = to_chat(body, previous)
        if not messages:
            raise APIError(400, "input has no messages", param="input")
        if body.store and ResponseStore.size_of({"messages": messages, "instructions": instructions}) > store.max_bytes:
            raise APIError(400, f"the conversation exceeds the response store's {store.max_bytes} bytes; send it "
                                "with store=false", param="store", code="store_entry_too_large")
        chat = ([{"role": "system", "content": instructions}] if instructions else []) + messages
        job = pipeline.chat_job(gateway, cfg, pipeline.normalize_messages(chat), body, tools=_tools(body),
                                limit=body.max_output_tokens)
        rid = f"resp_{uuid.uuid4().hex}"
        created = int(time.time())
        ids = {"message": f"msg_{uuid.uuid4().hex[:24]}", "reasoning": f"rs_{uuid.uuid4().hex[:24]}"}
        if body.stream:
            events = await pipeline.start(gateway, job)

            async def stream():
                seq = 0

                def ev(kind: str, **data) -> str:
                    nonlocal seq
                    seq += 1
                    return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq - 1, **data})}\n\n"

                resp = base(rid, body, instructions, created, "in_progress")
                yield ev("response.created", response=resp)
                yield ev("response.in_progress", response=resp)
                out_index, current, texts = -1, None, {"reasoning": "", "content": ""}

                def close(kind):
                    if kind == "content":
                        t = texts["content"]
                        part = {"type": "output_text", "text": t, "annotations": []}
                        return [ev("response.output_text.done", item_id=ids["message"], output_index=out_index,
                                   content_index=0, text=t, logprobs=[]),
                                ev("response.content_part.done", item_id=ids["message"], output_index=out_index,
                                   content_index=0, part=part),
                                ev("response.output_item.done", output_index=out_index, item={
                                    "type": "message", "id": ids["message"], "status": "completed",
                                    "role": "assistant", "content": [part]})]
                    t = texts["reasoning"]
                    return [ev("response.reasoning_text.done", item_id=ids["reasoning"], output_index=out_index,
                               content_index=0, text=t),
                            ev("response.output_item.done", output_index=out_index, item={
                                "type": "reasoning", "id": ids["reasoning"], "summary": [],
                                "content": [{"type": "reasoning_text", "text": t}]})]

                def open_(kind):
                    if kind == "content":
                        return [ev("response.output_item.added", output_index=out_index, item={
                                    "type": "message", "id": ids["message"], "status": "in_progress",
                                    "role": "assistant", "content": []}),
                                ev("response.content_part.added", item_id=ids["message"], output_index=out_index,
                                   content_index=0, part={"type": "output_text", "text": "", "annotations": []})]
                    return [ev("response.output_item.added", output_index=out_index, item={
                        "type": "reasoning", "id": ids["reasoning"], "summary": [], "content": []})]

                async for e in events:
                    if isinstance(e, Delta) and e.text:
                        if e.kind != current:
                            if current:
                                for x in close(current):
                                    yield x
                            out_index += 1
                            current = e.kind
                            for x in open_(current):
                                yield x
                        texts[current] += e.text
                        if current == "content":
                            yield ev("response.output_text.delta", item_id=ids["message"], output_index=out_index,
                                     content_index=0, delta=e.text, logprobs=[])
                        else:
                            yield ev("response.reasoning_text.delta", item_id=ids["reasoning"],
                                     output_index=out_index, content_index=0, delta=e.text)
                    elif isinstance(e, Done):
                        if current is None and not e.tool_calls:  # an empty answer is still a message
                            out_index += 1
                            current = "content"
                            for x in open_("content"):
                                yield x
                        if current:
                            for x in close(current):
                                yield x
                        for c in e.tool_calls:
                            out_index += 1
                            item = {"type": "function_call", "id": "fc_" + c["id"].removeprefix("call_"),
                                    "call_id": c["id"], "name": c["name"], "arguments": "", "status": "in_progress"}
                            yield ev("response.output_item.added", output_index=out_index, item=item)
                            yield ev("response.function_call_arguments.delta", item_id=item["id"],
                                     output_index=out_index, delta=c["arguments"])
                            yield ev("response.function_call_arguments.done", item_id=item["id"],
                                     output_index=out_index, name=c["name"], arguments=c["arguments"])
                            yield ev("response.output_item.done", output_index=out_index,
                                     item={**item, "arguments": c["arguments"], "status": "completed"})
                        final = finish(base(rid, body, instructions, created, "completed"), e,
                                       texts["reasoning"], texts["content"], ids)
                        if body.store:
                            remember(final, messages, instructions, e, texts["content"])
                        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
                        yield ev(kind, response=final)
                    elif isinstance(e, Failed):
                        yield ev("error", code="server_error", message=e.message, param=None)

            return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

        got = await pipeline.collect(gateway, job, request.is_disconnected)
        resp = finish(base(rid, body, instructions, created, "completed"), got.done, got.reasoning, got.content, ids)
        if body.store:
            remember(resp, messages, instructions, got.done, got.content)
        return resp

    @app.get("/v1/responses/{rid}")
    async def get(rid: str):
        entry = store.get(rid)
        if entry is None:
            raise APIError(404, f"response {rid!r} not found (unknown or expired)", type="not_found_error",
                           code="response_not_found")
        return entry["response"]

    @app.delete("/v1/responses/{rid}")
    async def delete(rid: str):
        if not store.delete(rid):
            raise APIError(404, f"response {rid!r} not found (unknown or expired)", type="not_found_error",
                           code="response_not_found")
        return {"id": rid, "object": "response.deleted", "deleted": True}
