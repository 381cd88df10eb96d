"""Anthropic Messages over the shared request path: `POST /v1/messages` and `/count_tokens`.

Bodies become the same chat messages the OpenAI route builds (system -> a leading system message;
tool_use blocks -> assistant tool calls; tool_result blocks -> tool messages, so the model sees
them through its native tool format rather than inlined text), and the job's events become
Anthropic content blocks: thinking, text, tool_use. Streams follow the event grammar
message_start -> (content_block_start, ping, content_block_delta..., content_block_stop)* ->
message_delta -> message_stop; a failure mid-stream is an `event: error` frame. Errors use the
Anthropic shape (app.py picks it for paths under /v1/messages).
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from mlxlab.config import ServeConfig
from mlxlab.serve import pipeline
from mlxlab.serve.engine import Delta, Done, Failed, Gateway
from mlxlab.serve.protocol import APIError

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class Message(_Base):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class MessagesRequest(_Base):
    model: str = Field(min_length=1)
    messages: list[Message] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    stop_sequences: list[str] | None = Field(None, max_length=16)
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False
    metadata: dict[str, Any] | None = None
    adapter: str | None = None
    thinking: dict[str, Any] | None = None


class CountRequest(_Base):
    model: str = Field(min_length=1)
    messages: list[Message] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


def to_chat(body) -> tuple[list[dict], list[dict] | None]:
    """(chat messages for the template, function tools) from a Messages body."""
    messages: list[dict] = []
    if body.system:
        messages.append({"role": "system", "content": pipeline.text_of(body.system, "system", ("text",))})
    open_calls: set[str] = set()
    for i, m in enumerate(body.messages):
        where = f"messages[{i}].content"
        if isinstance(m.content, str):
            messages.append({"role": m.role, "content": m.content})
            continue
        text, calls = [], []
        for j, block in enumerate(m.content):
            kind = block.get("type")
            if kind == "text":
                if not isinstance(block.get("text"), str):
                    raise APIError(400, f"{where}[{j}]: a text block needs a string 'text'")
                text.append(block["text"])
            elif kind == "image":
                raise APIError(400, f"{where}[{j}]: image input needs a vision model; this server runs a "
                                    "text-only model")
            elif kind == "tool_use" and m.role == "assistant":
                if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str) \
                        or not isinstance(block.get("input", {}), dict):
                    raise APIError(400, f"{where}[{j}]: tool_use needs a string id and name and an object input")
                calls.append({"id": block["id"], "type": "function",
                              "function": {"name": block["name"], "arguments": block.get("input", {})}})
                open_calls.add(block["id"])
            elif kind == "tool_result" and m.role == "user":
                tid = block.get("tool_use_id")
                if tid not in open_calls:
                    raise APIError(400, f"{where}[{j}]: tool_result for {tid!r} has no matching tool_use "
                                        "in an earlier assistant message")
                if text:  # keep the order: text before the result stays before it
                    messages.append({"role": "user", "content": "".join(text)})
                    text = []
                result = block.get("content", "")
                result = result if isinstance(result, str) else pipeline.text_of(result, f"{where}[{j}].content", ("text",))
                if block.get("is_error"):
                    result = f"Error: {result}"
                messages.append({"role": "tool", "tool_call_id": tid, "content": result})
            elif kind in ("thinking", "redacted_thinking") and m.role == "assistant":
                continue  # earlier reasoning is not replayed to the model
            else:
                raise APIError(400, f"{where}[{j}]: unsupported block type {kind!r} in a {m.role} message")
        if calls:
            messages.append({"role": "assistant", "content": "".join(text), "tool_calls": calls})
        elif text or m.role == "assistant":
            messages.append({"role": m.role, "content": "".join(text)})
    tools = []
    for i, t in enumerate(body.tools or []):
        if t.get("type") not in (None, "custom"):
            continue  # server tools (web_search, bash, ...) are not ours to run
        if not isinstance(t.get("name"), str) or not isinstance(t.get("input_schema", {}), dict):
            raise APIError(400, f"tools[{i}]: a tool needs a string name and an object input_schema")
        tools.append({"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                                       "parameters": t.get("input_schema", {})}})
    if (body.tool_choice or {}).get("type") == "none":
        tools = []
    return messages, tools or None


def _template_kwargs(body) -> dict | None:
    if body.thinking and body.thinking.get("type") == "enabled":
        return {"enable_thinking": True}
    return None


def _event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


def register(app: FastAPI, cfg: ServeConfig, gateway: Gateway) -> None:
    def usage(done: Done) -> dict:
        return {"input_tokens": done.prompt_tokens, "output_tokens": done.completion_tokens,
                "cache_read_input_tokens": done.cached_tokens, "cache_creation_input_tokens": 0}

    @app.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request):
        chat, tools = to_chat(body)
        job = pipeline.chat_job(gateway, cfg, chat, body, tools=tools, stops=body.stop_sequences,
                                limit=body.max_tokens, template_kwargs=_template_kwargs(body))
        job.id = f"msg_{uuid.uuid4().hex[:24]}"
        if body.stream:
            events = await pipeline.start(gateway, job)

            async def stream():
                yield _event("message_start", {"type": "message_start", "message": {
                    "id": job.id, "type": "message", "role": "assistant", "model": cfg.model, "content": [],
                    "stop_reason": None, "stop_sequence": None,
                    "usage": {"input_tokens": len(job.prompt), "output_tokens": 0,
                              "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}}})
                index, open_kind = -1, None
                async for ev in events:
                    if isinstance(ev, Delta) and ev.text:
                        kind = "thinking" if ev.kind == "reasoning" else "text"
                        if kind != open_kind:
                            if open_kind:
                                yield _event("content_block_stop", {"type": "content_block_stop", "index": index})
                            index, open_kind = index + 1, kind
                            yield _event("content_block_start", {"type": "content_block_start", "index": index,
                                                                 "content_block": {"type": kind, kind: ""}})
                            if index == 0:
                                yield _event("ping", {"type": "ping"})
                        delta = ({"type": "thinking_delta", "thinking": ev.text} if kind == "thinking"
                                 else {"type": "text_delta", "text": ev.text})
                        yield _event("content_block_delta", {"type": "content_block_delta", "index": index,
                                                             "delta": delta})
                    elif isinstance(ev, Done):
                        if open_kind:
                            yield _event("content_block_stop", {"type": "content_block_stop", "index": index})
                        for call in ev.tool_calls:
                            index += 1
                            yield _event("content_block_start", {"type": "content_block_start", "index": index,
                                                                 "content_block": {"type": "tool_use",
                                                                                   "id": _tool_id(call),
                                                                                   "name": call["name"], "input": {}}})
                            yield _event("content_block_delta", {"type": "content_block_delta", "index": index,
                                                                 "delta": {"type": "input_json_delta",
                                                                           "partial_json": call["arguments"]}})
                            yield _event("content_block_stop", {"type": "content_block_stop", "index": index})
                        yield _event("message_delta", {"type": "message_delta",
                                                       "delta": {"stop_reason": _stop_reason(ev),
                                                                 "stop_sequence": ev.stop_sequence},
                                                       "usage": usage(ev)})
                        yield _event("message_stop", {"type": "message_stop"})
                    elif isinstance(ev, Failed):
                        yield _event("error", {"type": "error", "error": {"type": "api_error", "message": ev.message}})

            return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

        got = await pipeline.collect(gateway, job, request.is_disconnected)
        done = got.done
        content = []
        if got.reasoning:
            content.append({"type": "thinking", "thinking": got.reasoning, "signature": ""})
        if got.content or not done.tool_calls:
            content.append({"type": "text", "text": got.content})
        content += [{"type": "tool_use", "id": _tool_id(c), "name": c["name"], "input": json.loads(c["arguments"])}
                    for c in done.tool_calls]
        return {"id": job.id, "type": "message", "role": "assistant", "model": cfg.model, "content": content,
                "stop_reason": _stop_reason(done), "stop_sequence": done.stop_sequence, "usage": usage(done)}

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountRequest):
        chat, tools = to_chat(body)
        loaded = pipeline.ready_loaded(gateway)
        prompt, _, _ = pipeline.render_chat(loaded, chat, tools, _template_kwargs(body))
        return {"input_tokens": len(prompt)}


def _tool_id(call: dict) -> str:
    return "toolu_" + call["id"].removeprefix("call_")


def _stop_reason(done: Done) -> str:
    if done.stop_sequence is not None:
        return "stop_sequence"
    return STOP_REASONS.get(done.finish_reason, "end_turn")

