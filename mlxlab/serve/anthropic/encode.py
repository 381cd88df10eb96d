"""Anthropic Messages bodies and stream events from a job's events (pure: no model, no server).

Content blocks are thinking, text and tool_use. Streams follow the event grammar
message_start -> (content_block_start, ping, content_block_delta..., content_block_stop)* ->
message_delta -> message_stop; a failure mid-stream is an `event: error` frame.
"""

from __future__ import annotations

import json

from mlxlab.serve.answer import Collector, Encoder, failed_error
from mlxlab.serve.anthropic.protocol import error_shape
from mlxlab.serve.engine.jobs import Delta, Done, Failed, Job

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


def usage(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict:
    """Anthropic's usage: `input_tokens` is the uncached part of the prompt, so the prompt is
    input_tokens + cache_read_input_tokens + cache_creation_input_tokens (entries are written
    as a side effect of serving, never billed apart: creation is 0)."""
    return {
        "input_tokens": prompt_tokens - cached_tokens,
        "output_tokens": output_tokens,
        "cache_read_input_tokens": cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def usage_of(done: Done) -> dict:
    return usage(done.prompt_tokens, done.cached_tokens, done.completion_tokens)


def tool_id(call: dict) -> str:
    return "toolu_" + call["id"].removeprefix("call_")


def stop_reason(done: Done) -> str:
    if done.stop_sequence is not None:
        return "stop_sequence"
    return STOP_REASONS.get(done.finish_reason, "end_turn")


class MessageStream(Encoder):
    """`job`: read when the stream starts, which `answer.stream` does after the job's first
    event, so the lane has already looked the prompt up in the cache (`job.cached_tokens`) and
    message_start's usage is the final one's input side."""

    def __init__(self, message_id: str, model: str, job: Job):
        self.id, self.model, self.job = message_id, model, job
        self.index, self.open = -1, None  # the current content block and its kind

    def start(self) -> list[str]:
        return [
            event(
                "message_start",
                {
                    "type": "message_start",
                    "message": {
                        "id": self.id,
                        "type": "message",
                        "role": "assistant",
                        "model": self.model,
                        "content": [],
                        "stop_reason": None,
                        "stop_sequence": None,
                        "usage": usage(len(self.job.prompt), self.job.cached_tokens, 0),
                    },
                },
            )
        ]

    def _stop_block(self) -> str:
        return event("content_block_stop", {"type": "content_block_stop", "index": self.index})

    def delta(self, ev: Delta) -> list[str]:
        if not ev.text:
            return []
        out = []
        kind = "thinking" if ev.kind == "reasoning" else "text"
        if kind != self.open:
            if self.open:
                out.append(self._stop_block())
            self.index, self.open = self.index + 1, kind
            out.append(
                event(
                    "content_block_start",
                    {
                        "type": "content_block_start",
                        "index": self.index,
                        "content_block": {"type": kind, kind: ""},
                    },
                )
            )
            if self.index == 0:
                out.append(event("ping", {"type": "ping"}))
        delta = (
            {"type": "thinking_delta", "thinking": ev.text}
            if kind == "thinking"
            else {"type": "text_delta", "text": ev.text}
        )
        out.append(
            event(
                "content_block_delta",
                {"type": "content_block_delta", "index": self.index, "delta": delta},
            )
        )
        return out

    def done(self, ev: Done) -> list[str]:
        out = [self._stop_block()] if self.open else []
        for call in ev.tool_calls:
            self.index += 1
            out += [
                event(
                    "content_block_start",
                    {
                        "type": "content_block_start",
                        "index": self.index,
                        "content_block": {
                            "type": "tool_use",
                            "id": tool_id(call),
                            "name": call["name"],
                            "input": {},
                        },
                    },
                ),
                event(
                    "content_block_delta",
                    {
                        "type": "content_block_delta",
                        "index": self.index,
                        "delta": {"type": "input_json_delta", "partial_json": call["arguments"]},
                    },
                ),
                self._stop_block(),
            ]
        out.append(
            event(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": stop_reason(ev), "stop_sequence": ev.stop_sequence},
                    "usage": usage_of(ev),
                },
            )
        )
        out.append(event("message_stop", {"type": "message_stop"}))
        return out

    def failed(self, ev: Failed) -> list[str]:
        return [event("error", error_shape(failed_error(ev))[1])]


def message_body(message_id: str, model: str, got: Collector) -> dict:
    done = got.finished
    content = []
    if got.reasoning:
        content.append({"type": "thinking", "thinking": got.reasoning, "signature": ""})
    if got.content or not done.tool_calls:
        content.append({"type": "text", "text": got.content})
    content += [
        {
            "type": "tool_use",
            "id": tool_id(c),
            "name": c["name"],
            "input": json.loads(c["arguments"]),
        }
        for c in done.tool_calls
    ]
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason(done),
        "stop_sequence": done.stop_sequence,
        "usage": usage_of(done),
    }
