"""OpenAI Responses objects and stream events from a job's events (pure: no model, no server).

Streams carry `sequence_number` on every event: response.created -> response.in_progress ->
(output_item.added -> content_part.added -> output_text.delta... -> output_text.done ->
content_part.done -> output_item.done) per message, reasoning_text.delta/.done for reasoning,
function_call_arguments.delta/.done per call -> response.completed (response.incomplete when
max_output_tokens cut it short, as OpenAI does).
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Callable

from mlxlab.serve.answer import Encoder
from mlxlab.serve.engine.jobs import Delta, Done, Failed


class Draft:
    """The response being built: its id, request echo fields and output item ids."""

    def __init__(self, body, model: str, instructions: str | None, created: int):
        self.id = f"resp_{uuid.uuid4().hex}"
        self.body, self.model, self.instructions, self.created = body, model, instructions, created
        self.ids = {
            "message": f"msg_{uuid.uuid4().hex[:24]}",
            "reasoning": f"rs_{uuid.uuid4().hex[:24]}",
        }

    def base(self, status: str) -> dict:
        b = self.body
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.model,
            "output": [],
            "error": None,
            "incomplete_details": None,
            "instructions": self.instructions,
            "max_output_tokens": b.max_output_tokens,
            "previous_response_id": b.previous_response_id,
            "temperature": b.temperature,
            "top_p": b.top_p,
            "top_logprobs": b.top_logprobs,
            "parallel_tool_calls": b.parallel_tool_calls,
            "tool_choice": b.tool_choice or "auto",
            "tools": b.tools or [],
            "store": b.store,
            "text": {
                "format": b.text.format.echo() if b.text and b.text.format else {"type": "text"}
            },
            "metadata": b.metadata or {},
            "usage": None,
        }

    def final(self, done: Done, reasoning: str, text: str, logprobs: list[dict] = ()) -> dict:
        output = []
        if reasoning:
            output.append(
                {
                    "type": "reasoning",
                    "id": self.ids["reasoning"],
                    "summary": [],
                    "content": [{"type": "reasoning_text", "text": reasoning}],
                }
            )
        if text or not done.tool_calls:
            output.append(
                {
                    "type": "message",
                    "id": self.ids["message"],
                    "status": status_of(done),
                    "role": "assistant",
                    "content": [output_text(text, logprobs)],
                }
            )
        for c in done.tool_calls:
            output.append(
                {
                    "type": "function_call",
                    "id": call_item_id(c),
                    "call_id": c["id"],
                    "name": c["name"],
                    "arguments": c["arguments"],
                    "status": "completed",
                }
            )
        incomplete = status_of(done) == "incomplete"
        resp = self.base(status_of(done))
        resp.update(
            output=output,
            incomplete_details={"reason": "max_output_tokens"} if incomplete else None,
            usage={
                "input_tokens": done.prompt_tokens,
                # cache_write_tokens (required by openai>=3): OpenAI bills explicit cache
                # writes; this server's prompt cache has no such writes, so 0.
                "input_tokens_details": {
                    "cached_tokens": done.cached_tokens,
                    "cache_write_tokens": 0,
                },
                "output_tokens": done.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": done.prompt_tokens + done.completion_tokens,
            },
        )
        resp["output_text"] = text
        return resp


def output_text(text: str, logprobs=()) -> dict:
    """A message's output_text part: its text, no annotations, and its tokens' logprobs (empty
    unless the request asked: `include` message.output_text.logprobs or top_logprobs)."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": list(logprobs)}


def status_of(done: Done) -> str:
    """The response's status, and its message item's: "incomplete" when max_output_tokens cut
    it (finish reason length; complete tool calls finish tool_calls), as on OpenAI."""
    return "incomplete" if done.finish_reason == "length" else "completed"


def call_item_id(call: dict) -> str:
    return "fc_" + call["id"].removeprefix("call_")


def input_items(rid: str, messages: list[dict]) -> list[dict]:
    """A stored response's input as Responses items, oldest first (what `GET
    /v1/responses/{id}/input_items` lists): every earlier turn of its chain and the request's own
    input, chat messages turned back into message, function_call and function_call_output
    items. Ids are derived from the response id and the position, so pages stay stable. An
    image is listed without its bytes (the store keeps only its hash), with its URL if it had
    one."""

    def item_id(prefix: str, i: int) -> str:
        return f"{prefix}_{hashlib.sha256(f'{rid}:{i}'.encode()).hexdigest()[:24]}"

    def parts(m: dict) -> list[dict]:
        kind = "output_text" if m["role"] == "assistant" else "input_text"
        content = m.get("content")
        # an output_text part is shaped as in a response's own output (`output_text`)

        def part(text: str) -> dict:
            return output_text(text) if kind == "output_text" else {"type": kind, "text": text}

        if isinstance(content, str):
            return [part(content)] if content or kind == "input_text" else []
        out = []
        for p in content or []:
            if isinstance(p, dict) and p.get("type") == "image":
                out.append({"type": "input_image", "detail": "auto", "image_url": p.get("url")})
            elif isinstance(p, dict) and isinstance(p.get("text"), str):
                out.append(part(p["text"]))
        return out

    items = []
    for i, m in enumerate(messages):
        if m["role"] == "tool":
            items.append(
                {
                    "type": "function_call_output",
                    "id": item_id("fco", i),
                    "call_id": m.get("tool_call_id"),
                    "output": m.get("content") if isinstance(m.get("content"), str) else "",
                    "status": "completed",
                }
            )
            continue
        content = parts(m)
        if content or not m.get("tool_calls"):
            items.append(
                {
                    "type": "message",
                    "id": item_id("msg", i),
                    "role": m["role"],
                    "status": "completed",
                    "content": content,
                }
            )
        for c in m.get("tool_calls") or []:
            fn = c.get("function") or {}
            args = fn.get("arguments", {})
            items.append(
                {
                    "type": "function_call",
                    "id": call_item_id(c),
                    "call_id": c.get("id"),
                    "name": fn.get("name"),
                    "arguments": args if isinstance(args, str) else json.dumps(args),
                    "status": "completed",
                }
            )
    return items


class ResponseStream(Encoder):
    """`on_final(response, done, text)` is called with the finished response (to store it)."""

    def __init__(self, draft: Draft, on_final: Callable[[dict, Done, str], None]):
        self.draft, self.on_final = draft, on_final
        self.seq, self.index, self.current = (
            0,
            -1,
            None,
        )  # event counter, output index, open item kind
        self.texts = {"reasoning": "", "content": ""}
        self.logprobs: list[dict] = []  # the answer's, when asked
        self.pending: list[dict] = []  # those of tokens no delta has shown yet

    def _ev(self, kind: str, **data) -> str:
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': self.seq - 1, **data})}\n\n"

    def start(self) -> list[str]:
        resp = self.draft.base("in_progress")
        return [
            self._ev("response.created", response=resp),
            self._ev("response.in_progress", response=resp),
        ]

    def _open(self, kind: str) -> list[str]:
        self.index += 1
        self.current = kind
        ids = self.draft.ids
        if kind == "content":
            return [
                self._ev(
                    "response.output_item.added",
                    output_index=self.index,
                    item={
                        "type": "message",
                        "id": ids["message"],
                        "status": "in_progress",
                        "role": "assistant",
                        "content": [],
                    },
                ),
                self._ev(
                    "response.content_part.added",
                    item_id=ids["message"],
                    output_index=self.index,
                    content_index=0,
                    part=output_text(""),
                ),
            ]
        return [
            self._ev(
                "response.output_item.added",
                output_index=self.index,
                item={"type": "reasoning", "id": ids["reasoning"], "summary": [], "content": []},
            )
        ]

    def _close(self, status: str = "completed") -> list[str]:
        ids, i = self.draft.ids, self.index
        if self.current == "content":
            t = self.texts["content"]
            part = output_text(t, self.logprobs)
            return [
                self._ev(
                    "response.output_text.done",
                    item_id=ids["message"],
                    output_index=i,
                    content_index=0,
                    text=t,
                    logprobs=self.logprobs,
                ),
                self._ev(
                    "response.content_part.done",
                    item_id=ids["message"],
                    output_index=i,
                    content_index=0,
                    part=part,
                ),
                self._ev(
                    "response.output_item.done",
                    output_index=i,
                    item={
                        "type": "message",
                        "id": ids["message"],
                        "status": status,
                        "role": "assistant",
                        "content": [part],
                    },
                ),
            ]
        t = self.texts["reasoning"]
        return [
            self._ev(
                "response.reasoning_text.done",
                item_id=ids["reasoning"],
                output_index=i,
                content_index=0,
                text=t,
            ),
            self._ev(
                "response.output_item.done",
                output_index=i,
                item={
                    "type": "reasoning",
                    "id": ids["reasoning"],
                    "summary": [],
                    "content": [{"type": "reasoning_text", "text": t}],
                },
            ),
        ]

    def delta(self, ev: Delta) -> list[str]:
        if not ev.text:  # a token that completes no character yet: its logprob goes with the next
            if ev.kind == "content":
                self.pending += ev.logprobs or []
            return []
        out = []
        if ev.kind != self.current:
            if self.current:
                out += self._close()
            out += self._open(ev.kind)
        self.texts[self.current] += ev.text
        if self.current == "content":
            out.append(self._text_delta(ev.text, ev.logprobs or []))
        else:
            out.append(
                self._ev(
                    "response.reasoning_text.delta",
                    item_id=self.draft.ids["reasoning"],
                    output_index=self.index,
                    content_index=0,
                    delta=ev.text,
                )
            )
        return out

    def _text_delta(self, text: str, logprobs: list[dict]) -> str:
        """An output_text.delta with its tokens' logprobs (and any held back before it)."""
        logprobs, self.pending = self.pending + logprobs, []
        self.logprobs += logprobs
        return self._ev(
            "response.output_text.delta",
            item_id=self.draft.ids["message"],
            output_index=self.index,
            content_index=0,
            delta=text,
            logprobs=logprobs,
        )

    def done(self, ev: Done) -> list[str]:
        out = []
        if self.current is None and not ev.tool_calls:  # an empty answer is still a message
            out += self._open("content")
        if self.current == "content" and self.pending:  # the answer ended inside a character
            out.append(self._text_delta("", []))
        if self.current:
            out += self._close(status_of(ev))
        for c in ev.tool_calls:
            self.index += 1
            item = {
                "type": "function_call",
                "id": call_item_id(c),
                "call_id": c["id"],
                "name": c["name"],
                "arguments": "",
                "status": "in_progress",
            }
            out += [
                self._ev("response.output_item.added", output_index=self.index, item=item),
                self._ev(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=self.index,
                    delta=c["arguments"],
                ),
                self._ev(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=self.index,
                    name=c["name"],
                    arguments=c["arguments"],
                ),
                self._ev(
                    "response.output_item.done",
                    output_index=self.index,
                    item={**item, "arguments": c["arguments"], "status": "completed"},
                ),
            ]
        final = self.draft.final(ev, self.texts["reasoning"], self.texts["content"], self.logprobs)
        self.on_final(final, ev, self.texts["content"])
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        out.append(self._ev(kind, response=final))
        return out

    def failed(self, ev: Failed) -> list[str]:
        return [self._ev("error", code=ev.code or "server_error", message=ev.message, param=None)]
