"""Each protocol's stream encoder and body, driven with engine events and no model or server."""

from __future__ import annotations

import asyncio
import json

import pytest

from mlxlab.serve import answer
from mlxlab.serve.anthropic.encode import MessageStream, message_body
from mlxlab.serve.engine.jobs import Delta, Done, Failed, Job
from mlxlab.serve.http import APIError
from mlxlab.serve.openai.encode import ChatStream, CompletionStream, chat_body, completion_body
from mlxlab.serve.responses.encode import Draft, ResponseStream
from mlxlab.serve.responses.protocol import ResponsesRequest

CALL = {"id": "call_abc", "name": "get_weather", "arguments": '{"city": "Paris"}'}
LP = [{"token": "Hi", "logprob": -0.1, "bytes": [72, 105], "top_logprobs": []}]


def done(finish="stop", calls=(), stop=None) -> Done:
    return Done(
        finish,
        prompt_tokens=7,
        completion_tokens=3,
        cached_tokens=2,
        tool_calls=list(calls),
        stop_sequence=stop,
    )


def data_lines(chunks: list[str]) -> list:
    lines = [c.removeprefix("data: ").strip() for c in chunks]
    assert all(c.startswith("data: ") and c.endswith("\n\n") for c in chunks)
    return [line if line == "[DONE]" else json.loads(line) for line in lines]


def named(chunks: list[str]) -> list[tuple[str, dict]]:
    out = []
    for c in chunks:
        head, body = c.rstrip("\n").split("\n")
        out.append((head.removeprefix("event: "), json.loads(body.removeprefix("data: "))))
    return out


HEAD = {"id": "chatcmpl-1", "created": 1, "model": "m"}


def test_chat_stream_chunks():
    events = [
        Delta("reasoning", "think"),
        Delta("content", "Hi", LP),
        Delta("content", "", None),
        Delta("content", "", LP),
        done("tool_calls", [CALL]),
    ]
    out = data_lines(answer.encode(ChatStream(HEAD, include_usage=True), events))
    assert out[-1] == "[DONE]"
    chunks = out[:-1]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == "chatcmpl-1" for c in chunks)
    deltas = [c["choices"][0]["delta"] for c in chunks[:-1]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert deltas[1] == {"reasoning_content": "think"} and deltas[2] == {"content": "Hi"}
    assert chunks[2]["choices"][0]["logprobs"] == {"content": LP}
    assert deltas[3] == {} and chunks[3]["choices"][0]["logprobs"] == {
        "content": LP
    }  # logprobs only; the empty delta sent nothing
    assert deltas[4]["tool_calls"] == [
        {
            "index": 0,
            "id": "call_abc",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        }
    ]
    assert chunks[5]["choices"][0]["finish_reason"] == "tool_calls"
    assert chunks[6]["choices"] == [] and chunks[6]["usage"] == {
        "prompt_tokens": 7,
        "completion_tokens": 3,
        "total_tokens": 10,
        "prompt_tokens_details": {"cached_tokens": 2},
    }


def test_chat_stream_failure_and_no_usage():
    out = data_lines(
        answer.encode(
            ChatStream(HEAD, include_usage=False), [Delta("content", "a"), Failed("boom")]
        )
    )
    assert out[-2] == {
        "error": {"message": "boom", "type": "server_error", "param": None, "code": None}
    }
    assert out[-1] == "[DONE]" and not any(isinstance(c, dict) and "usage" in c for c in out)


def test_collector_and_bodies():
    got = answer.Collector()
    answer.encode(
        got,
        [
            Delta("reasoning", "r"),
            Delta("content", "He", LP),
            Delta("content", "llo"),
            done("tool_calls", [CALL]),
        ],
    )
    assert (got.content, got.reasoning, got.logprobs) == ("Hello", "r", LP)
    body = chat_body(HEAD, got, logprobs=True)
    msg = body["choices"][0]["message"]
    assert (
        body["object"] == "chat.completion"
        and msg["content"] == "Hello"
        and msg["reasoning_content"] == "r"
    )
    assert msg["tool_calls"][0]["function"]["name"] == "get_weather" and body["choices"][0][
        "logprobs"
    ] == {"content": LP}
    assert completion_body({"id": "c"}, got)["choices"][0]["logprobs"]["tokens"] == ["Hi"]
    with pytest.raises(APIError) as e:
        answer.encode(answer.Collector(), [Failed("boom")])
    assert e.value.status == 500


def test_completion_stream_chunks():
    out = data_lines(
        answer.encode(CompletionStream({"id": "cmpl-1"}, True), [Delta("content", "x", LP), done()])
    )
    assert out[0]["choices"][0]["text"] == "x" and out[0]["choices"][0]["logprobs"][
        "token_logprobs"
    ] == [-0.1]
    assert out[1]["choices"][0]["finish_reason"] == "stop" and out[2]["usage"]["total_tokens"] == 10
    assert out[3] == "[DONE]"


def test_anthropic_stream_grammar():
    events = [
        Delta("reasoning", "hm"),
        Delta("content", "It is "),
        Delta("content", "sunny"),
        done("tool_calls", [CALL]),
    ]
    out = named(
        answer.encode(MessageStream("msg_1", "m", Job([0] * 7, 1, None, cached_tokens=5)), events)
    )
    names = [n for n, _ in out]
    assert names == [
        "message_start",
        "content_block_start",
        "ping",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert out[0][1]["message"]["usage"] == {
        "input_tokens": 2,
        "output_tokens": 0,
        "cache_read_input_tokens": 5,
        "cache_creation_input_tokens": 0,
    }
    assert out[1][1]["content_block"] == {"type": "thinking", "thinking": ""}
    assert out[3][1]["delta"] == {"type": "thinking_delta", "thinking": "hm"}
    assert [d["index"] for n, d in out if n.startswith("content_block")] == [
        0,
        0,
        0,
        1,
        1,
        1,
        1,
        2,
        2,
        2,
    ]
    assert out[9][1]["content_block"] == {
        "type": "tool_use",
        "id": "toolu_abc",
        "name": "get_weather",
        "input": {},
    }
    assert out[10][1]["delta"] == {"type": "input_json_delta", "partial_json": '{"city": "Paris"}'}
    assert (
        out[12][1]["delta"]["stop_reason"] == "tool_use"
        and out[12][1]["usage"]["output_tokens"] == 3
    )


def test_anthropic_stop_sequence_failure_and_body():
    stopped = named(
        answer.encode(
            MessageStream("m", "m", Job([0], 1, None)), [Delta("content", "a"), done(stop="\n\n")]
        )
    )
    assert stopped[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "\n\n"}
    failed = named(answer.encode(MessageStream("m", "m", Job([0], 1, None)), [Failed("boom")]))
    assert failed[-1] == (
        "error",
        {"type": "error", "error": {"type": "api_error", "message": "boom"}},
    )
    got = answer.Collector()
    answer.encode(got, [done("tool_calls", [CALL])])
    body = message_body("msg_1", "m", got)
    assert body["content"] == [
        {"type": "tool_use", "id": "toolu_abc", "name": "get_weather", "input": {"city": "Paris"}}
    ]
    assert body["stop_reason"] == "tool_use"


def draft() -> Draft:
    return Draft(ResponsesRequest(input="x", max_output_tokens=3), "m", "Be brief.", 1)


def test_responses_stream_sequence_and_items():
    finals = []
    enc = ResponseStream(draft(), lambda resp, d, text: finals.append((resp, text)))
    events = [Delta("reasoning", "hm"), Delta("content", "Hi"), done("length", [CALL])]
    out = named(answer.encode(enc, events))
    assert [d["sequence_number"] for _, d in out] == list(range(len(out)))
    names = [n for n, _ in out]
    assert names == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [d.get("output_index") for _, d in out[2:-1]] == [0] * 4 + [1] * 6 + [2] * 4
    final = out[-1][1]["response"]
    assert final["status"] == "incomplete" and final["incomplete_details"] == {
        "reason": "max_output_tokens"
    }
    assert [i["type"] for i in final["output"]] == ["reasoning", "message", "function_call"]
    assert final["output"][2]["id"] == "fc_abc" and final["output_text"] == "Hi"
    assert finals == [(final, "Hi")] and final["instructions"] == "Be brief."


def test_responses_logprobs_are_the_answer_texts_own():
    """Responses' output_text logprobs: the content deltas' only (a reasoning or markup token's,
    sent in a Delta of no text, stays out), a token that shows no character yet carried
    by the next delta, one still held at the end flushed in a last empty delta; streamed and
    collected agree."""
    lp = [dict(LP[0], token=t) for t in "abcdef"]
    one = [[e] for e in lp]
    events = [
        Delta("reasoning", "hm", one[0]),
        Delta("reasoning", "", one[1]),  # the </think> marker
        Delta("content", "", one[2]),  # half a character
        Delta("content", "Hi", one[3]),
        Delta("markup", "", one[4]),  # call markup
        Delta("content", "", one[5]),  # the answer ends inside a character
        done("tool_calls", [CALL]),
    ]
    out = named(answer.encode(ResponseStream(draft(), lambda *a: None), events))
    deltas = [d["logprobs"] for n, d in out if n == "response.output_text.delta"]
    assert deltas == [[lp[2], lp[3]], [lp[5]]]
    (text_done,) = [d for n, d in out if n == "response.output_text.done"]
    assert text_done["logprobs"] == [lp[2], lp[3], lp[5]] and text_done["text"] == "Hi"
    final = out[-1][1]["response"]
    assert final["output"][1]["content"][0]["logprobs"] == text_done["logprobs"]
    got = answer.Collector()
    answer.encode(got, events)
    assert got.content_logprobs == text_done["logprobs"] and got.logprobs == lp
    body = draft().final(got.finished, got.reasoning, got.content, got.content_logprobs)
    assert body["output"][1]["content"][0] == final["output"][1]["content"][0]


def test_responses_empty_answer_is_a_message():
    out = named(answer.encode(ResponseStream(draft(), lambda *a: None), [done("stop")]))
    assert [n for n, _ in out][2:] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert out[-1][1]["response"]["output"][0]["content"][0]["text"] == ""


def test_pump_streams_what_encode_returns():
    events = [Delta("content", "a"), Delta("content", "b"), done()]

    async def drain():
        async def source():
            for ev in events:
                yield ev

        return [c async for c in answer.pump(source(), ChatStream(HEAD, True))]

    assert asyncio.run(drain()) == answer.encode(ChatStream(HEAD, True), events)
