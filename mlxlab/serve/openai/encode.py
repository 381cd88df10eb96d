"""OpenAI chat/completions and completions bodies and stream chunks from a job's events (pure:
no model, no server).

Streams: `data: {chunk}` lines, then `data: [DONE]`. Chat starts with a role chunk, sends content
or reasoning deltas (and logprobs), then tool calls in one chunk, the finish chunk, and (with
`stream_options.include_usage`) a usage chunk with empty `choices`. A failure mid-stream is an
error object in the OpenAI shape.
"""

from __future__ import annotations

import json

from mlxlab.serve.answer import Collector, Encoder, failed_error
from mlxlab.serve.engine.jobs import Delta, Done, Failed
from mlxlab.serve.openai.protocol import error_shape


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def usage_of(done: Done) -> dict:
    return {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.completion_tokens,
        "total_tokens": done.prompt_tokens + done.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": done.cached_tokens},
    }


def tool_calls_of(done: Done) -> list[dict]:
    return [
        {
            "id": c["id"],
            "type": "function",
            "function": {"name": c["name"], "arguments": c["arguments"]},
        }
        for c in done.tool_calls
    ]


class _Stream(Encoder):
    """What both OpenAI streams share: the usage chunk, the error object, the [DONE] line."""

    def __init__(self, head: dict, include_usage: bool, index: int = 0):
        self.head, self.include_usage, self.index = head, include_usage, index

    def _usage(self, ev: Done) -> list[str]:
        return (
            [sse({**self.head, "choices": [], "usage": usage_of(ev)})] if self.include_usage else []
        )

    def failed(self, ev: Failed) -> list[str]:
        return [sse(error_shape(failed_error(ev))[1])]

    def end(self) -> list[str]:
        return ["data: [DONE]\n\n"]


class ChatStream(_Stream):
    def __init__(self, head: dict, include_usage: bool, index: int = 0):
        super().__init__({**head, "object": "chat.completion.chunk"}, include_usage, index)

    def _chunk(self, delta: dict, logprobs=None, finish: str | None = None) -> str:
        return sse(
            {
                **self.head,
                "choices": [
                    {
                        "index": self.index,
                        "delta": delta,
                        "logprobs": logprobs,
                        "finish_reason": finish,
                    }
                ],
            }
        )

    def start(self) -> list[str]:
        return [self._chunk({"role": "assistant", "content": ""})]

    def delta(self, ev: Delta) -> list[str]:
        if not ev.text and not ev.logprobs:
            return []
        delta = (
            {"reasoning_content" if ev.kind == "reasoning" else "content": ev.text}
            if ev.text
            else {}
        )
        return [self._chunk(delta, {"content": ev.logprobs} if ev.logprobs else None)]

    def done(self, ev: Done) -> list[str]:
        out = []
        if ev.tool_calls:
            out.append(
                self._chunk(
                    {"tool_calls": [{"index": i, **c} for i, c in enumerate(tool_calls_of(ev))]}
                )
            )
        out.append(self._chunk({}, finish=ev.finish_reason))
        return out + self._usage(ev)


def chat_body(head: dict, got: Collector, logprobs: bool) -> dict:
    done = got.finished
    message = {"role": "assistant", "content": got.content}
    if got.reasoning:
        message["reasoning_content"] = got.reasoning
    if done.tool_calls:
        message["tool_calls"] = tool_calls_of(done)
        message["content"] = got.content or None  # as OpenAI: a message of only calls has none
    return {
        **head,
        "object": "chat.completion",
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": done.finish_reason,
                "logprobs": {"content": got.logprobs} if logprobs else None,
            }
        ],
        "usage": usage_of(done),
    }


def legacy_logprobs(entries: list[dict], start: int = 0) -> dict | None:
    """Chat-style logprob entries in the completions API's legacy layout; `text_offset`: where
    each token starts in the completion's text, counted from `start` (the length of the
    tokens before these, in a stream)."""
    if not entries:
        return None
    offsets = []
    for e in entries:
        offsets.append(start)
        start += len(e["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
        "text_offset": offsets,
    }


class CompletionStream(_Stream):
    """`echo`: the prompt's text, sent as the first chunk (the request's `echo`)."""

    offset = 0  # text_offset of the next token

    def __init__(self, head: dict, include_usage: bool, index: int = 0, echo: str = ""):
        super().__init__(head, include_usage, index)
        self.echo = echo

    def start(self) -> list[str]:
        return [self._chunk(self.echo)] if self.echo else []

    def _chunk(self, text: str, logprobs=None, finish: str | None = None) -> str:
        choice = {"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        return sse({**self.head, "choices": [choice]})

    def delta(self, ev: Delta) -> list[str]:
        if not ev.text and not ev.logprobs:
            return []
        logprobs = legacy_logprobs(ev.logprobs, self.offset)
        self.offset += sum(len(e["token"]) for e in ev.logprobs or [])
        return [self._chunk(ev.text, logprobs)]

    def done(self, ev: Done) -> list[str]:
        return [self._chunk("", finish=ev.finish_reason)] + self._usage(ev)


def completion_body(head: dict, got: Collector, echo: str = "") -> dict:
    """`echo`: the prompt's text, before the completion's (the request's `echo`)."""
    return {
        **head,
        "choices": [
            {
                "index": 0,
                "text": echo + got.content,
                "logprobs": legacy_logprobs(got.logprobs),
                "finish_reason": got.finished.finish_reason,
            }
        ],
        "usage": usage_of(got.finished),
    }
