"""Anthropic Messages and OpenAI Responses in-process on a tiny model: shapes, event grammars,
the response store, per-protocol errors, and one request path under all three surfaces."""

from __future__ import annotations

import json

import pytest
from openai.types.responses import Response

from mlxlab.serve.responses.store import ResponseStore
from tests.helpers.serve import SYSTEM, make_client, named_events


@pytest.fixture(scope="module")
def client(tiny_dir):
    tiny_dir("gemma3")
    c, gateway = make_client()
    yield c
    gateway.stop()


CONVO = [{"role": "user", "content": "Name a prime number."}]


def anthropic_prompt(usage: dict) -> int:
    """The prompt's length from Anthropic usage (input_tokens is the uncached part)."""
    return (
        usage["input_tokens"]
        + usage["cache_read_input_tokens"]
        + usage["cache_creation_input_tokens"]
    )


def test_same_text_on_all_three_surfaces(client):
    chat = client.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "system", "content": "Be brief."}, *CONVO],
            "max_tokens": 12,
            "temperature": 0,
        },
    ).json()
    text = chat["choices"][0]["message"]["content"]
    msg = client.post(
        "/v1/messages",
        json={
            "model": "claude-sonnet-4",
            "system": "Be brief.",
            "messages": CONVO,
            "max_tokens": 12,
            "temperature": 0,
        },
    ).json()
    assert msg["content"] == [{"type": "text", "text": text}] and msg["stop_reason"] == "max_tokens"
    resp = client.post(
        "/v1/responses",
        json={
            "instructions": "Be brief.",
            "input": CONVO[0]["content"],
            "max_output_tokens": 12,
            "temperature": 0,
        },
    ).json()
    assert resp["output"][0]["content"][0]["text"] == text and resp["status"] == "incomplete"
    assert resp["output"][0]["status"] == "incomplete"  # the cut message item too
    assert (
        anthropic_prompt(msg["usage"])
        == chat["usage"]["prompt_tokens"]
        == resp["usage"]["input_tokens"]
    )


def test_usage_with_cached_input_adds_up_on_every_protocol(client):
    """The same long-system-prompt request twice: the second reads most of its prompt from the
    cache. Anthropic counts input_tokens apart from the cache reads (prompt = input + read +
    creation); OpenAI's cached_tokens are a part of prompt_tokens / input_tokens."""
    user = [{"role": "user", "content": "Which module parses command-line options?"}]
    body = {"model": "x", "system": SYSTEM, "messages": user, "max_tokens": 3, "temperature": 0}
    total = client.post("/v1/messages/count_tokens", json=body).json()["input_tokens"]
    first = client.post("/v1/messages", json=body).json()["usage"]
    again = client.post("/v1/messages", json=body).json()["usage"]
    assert anthropic_prompt(first) == anthropic_prompt(again) == total
    assert again["cache_read_input_tokens"] >= total - 1 and again["input_tokens"] >= 1
    ev = named_events(client.post("/v1/messages", json={**body, "stream": True}).text)
    for name, data in ev:
        if name in ("message_start", "message_delta"):
            u = data["message"]["usage"] if name == "message_start" else data["usage"]
            assert anthropic_prompt(u) == total and u["cache_read_input_tokens"] >= total - 1, u

    chat = {"messages": [{"role": "system", "content": SYSTEM}, *user], "max_tokens": 3}
    for _ in range(2):
        u = client.post("/v1/chat/completions", json={**chat, "temperature": 0}).json()["usage"]
    cached = u["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached < u["prompt_tokens"] == total
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    resp = {"instructions": SYSTEM, "input": user[0]["content"], "max_output_tokens": 3}
    for _ in range(2):
        body = client.post("/v1/responses", json={**resp, "temperature": 0}).json()
    # The installed openai SDK's own type reads it strictly (its usage fields are required).
    Response.model_validate(body)
    u = body["usage"]
    cached = u["input_tokens_details"]["cached_tokens"]
    assert 0 < cached < u["input_tokens"] == total
    assert u["total_tokens"] == u["input_tokens"] + u["output_tokens"]


def test_messages_stream_grammar_and_count_tokens(client):
    body = {
        "model": "claude-x",
        "messages": CONVO,
        "max_tokens": 10,
        "temperature": 0,
        "stop_sequences": ["\u2603"],
    }
    plain = client.post("/v1/messages", json=body).json()
    r = client.post(
        "/v1/messages?beta=true",
        json={**body, "stream": True},
        headers={
            "anthropic-version": "2023-06-01",
            "anthropic-beta": "tools-2024",
            "x-api-key": "k",
        },
    )
    ev = named_events(r.text)
    names = [e for e, _ in ev]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert names[1] == "content_block_start" and "content_block_stop" in names
    text = "".join(d["delta"]["text"] for e, d in ev if e == "content_block_delta")
    assert [{"type": "text", "text": text}] == plain["content"]
    assert (
        ev[-2][1]["delta"]["stop_reason"] == "max_tokens"
        and ev[-2][1]["usage"]["output_tokens"] == 10
    )
    count = client.post("/v1/messages/count_tokens", json={"model": "x", "messages": CONVO}).json()
    assert count["input_tokens"] == anthropic_prompt(plain["usage"])


def test_messages_tool_blocks_map_onto_the_tool_path(client):
    tools = [
        {
            "name": "get_weather",
            "description": "Weather",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
        {"type": "web_search_20250305", "name": "web_search"},
    ]
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Checking."},
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "get_weather",
                    "input": {"city": "Paris"},
                },
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"}],
        },
    ]
    ok = client.post(
        "/v1/messages", json={"model": "x", "messages": messages, "tools": tools, "max_tokens": 4}
    )
    assert ok.status_code == 200, ok.text
    count = client.post(
        "/v1/messages/count_tokens", json={"model": "x", "messages": messages, "tools": tools}
    ).json()
    without = client.post(
        "/v1/messages/count_tokens", json={"model": "x", "messages": messages[:1]}
    ).json()
    assert (
        count["input_tokens"] > without["input_tokens"] + 20
    )  # tools, the call and the result are in the prompt


def test_a_wrong_method_under_messages_is_an_invalid_request(client):
    r = client.get("/v1/messages")
    assert r.status_code == 405 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "body,fragment",
    [
        ({"model": "x", "messages": CONVO}, "max_tokens"),
        ({"model": "x", "messages": CONVO, "max_tokens": 5, "temperature": 1.5}, "temperature"),
        (
            {
                "model": "x",
                "max_tokens": 5,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "tool_result", "tool_use_id": "toolu_9", "content": "x"}
                        ],
                    }
                ],
            },
            "no matching tool_use",
        ),
        (
            {
                "model": "x",
                "max_tokens": 5,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image",
                                "source": {
                                    "type": "base64",
                                    "media_type": "image/png",
                                    "data": "AA==",
                                },
                            }
                        ],
                    }
                ],
            },
            "vision",
        ),
        (
            {
                "model": "x",
                "max_tokens": 5,
                "messages": [{"role": "user", "content": [{"type": "video"}]}],
            },
            "video",
        ),
        (  # a tool_result's content that is neither text nor blocks (a 500 before)
            {
                "model": "x",
                "max_tokens": 5,
                "messages": [
                    {"role": "user", "content": "hi"},
                    {
                        "role": "assistant",
                        "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}],
                    },
                    {
                        "role": "user",
                        "content": [{"type": "tool_result", "tool_use_id": "t", "content": 5}],
                    },
                ],
            },
            "must be a string or a list",
        ),
    ],
)
def test_messages_errors_use_the_anthropic_shape(client, body, fragment):
    r = client.post("/v1/messages", json=body)
    assert r.status_code == 400
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert fragment in err["error"]["message"]


def test_responses_logprobs_as_chat_completions_gives_them(client):
    """include message.output_text.logprobs (or top_logprobs) fills the output_text part's
    logprobs, one entry per answer token in chat completions' layout; streamed, the deltas carry
    them and output_text.done has them all; unasked, the list is empty."""
    ask = {"input": CONVO[0]["content"], "max_output_tokens": 8, "temperature": 0}
    chat = client.post(
        "/v1/chat/completions",
        json={"messages": CONVO, "max_tokens": 8, "logprobs": True, "top_logprobs": 2},
    ).json()
    layout = chat["choices"][0]["logprobs"]["content"][0]
    asked = {**ask, "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    resp = client.post("/v1/responses", json=asked).json()
    part = resp["output"][0]["content"][0]
    want = part["logprobs"]
    assert len(want) == resp["usage"]["output_tokens"] == 8
    assert all(e.keys() == layout.keys() and len(e["top_logprobs"]) == 2 for e in want)
    assert all(e["top_logprobs"][0]["logprob"] == e["logprob"] for e in want)  # greedy
    alone = client.post("/v1/responses", json={**ask, "top_logprobs": 2}).json()
    assert alone["output"][0]["content"][0]["logprobs"] == want
    plain = client.post("/v1/responses", json=ask).json()["output"][0]["content"][0]
    assert plain["logprobs"] == [] and plain["text"] == part["text"]
    ev = named_events(client.post("/v1/responses", json={**asked, "stream": True}).text)
    streamed = [e for name, d in ev if name == "response.output_text.delta" for e in d["logprobs"]]
    (done,) = [d for name, d in ev if name == "response.output_text.done"]
    assert streamed == done["logprobs"] == want
    assert ev[-1][1]["response"]["output"][0]["content"][0]["logprobs"] == want
    r = client.post("/v1/responses", json={**ask, "top_logprobs": 21})
    assert r.status_code == 400 and "top_logprobs" in r.text
    r = client.post("/v1/responses", json={**ask, "include": ["message.output_text.logprob"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "include.0"
    r = client.post("/v1/responses", json={**ask, "include": ["reasoning.encrypted_content"]})
    assert r.status_code == 200 and r.json()["output"][0]["content"][0]["logprobs"] == []


def test_responses_chain_get_delete_and_stream(client):
    first = client.post(
        "/v1/responses",
        json={
            "instructions": "Be brief.",
            "input": "Say a colour.",
            "max_output_tokens": 6,
            "temperature": 0,
        },
    ).json()
    assert first["object"] == "response" and first["id"].startswith("resp_")
    assert client.get(f"/v1/responses/{first['id']}").json()["id"] == first["id"]
    r = client.post(
        "/v1/responses",
        json={
            "input": [{"type": "message", "role": "user", "content": "Another."}],
            "previous_response_id": first["id"],
            "max_output_tokens": 6,
            "temperature": 0,
            "stream": True,
        },
    )
    ev = named_events(r.text)
    names = [e for e, _ in ev]
    assert names[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert names[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [d["sequence_number"] for _, d in ev] == list(range(len(ev)))
    assert ev[-2][1]["item"]["status"] == "incomplete"
    final = ev[-1][1]["response"]
    # The chain carried the instructions and the first exchange: the cache reused it.
    assert (
        final["instructions"] == "Be brief."
        and final["usage"]["input_tokens"] > first["usage"]["input_tokens"]
    )
    assert (
        final["usage"]["input_tokens_details"]["cached_tokens"]
        >= first["usage"]["input_tokens"] - 1
    )
    stats = client.get("/stats").json()["response_store"]
    assert (
        stats["entries"] >= 2 and stats["max_bytes"] == 32 * 2**20 and stats["ttl_ms"] == 3_600_000
    )
    assert client.delete(f"/v1/responses/{first['id']}").json()["deleted"] is True
    gone = client.post("/v1/responses", json={"input": "x", "previous_response_id": first["id"]})
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "response_not_found"
    assert client.get(f"/v1/responses/{first['id']}").status_code == 404
    assert client.delete(f"/v1/responses/{first['id']}").status_code == 404


@pytest.mark.parametrize(
    "body,fragment",
    [
        ({"input": [{"type": "mystery"}]}, "unsupported item type"),
        (
            {"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]},
            "no matching function_call",
        ),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": 5}, "input"),
        (
            {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": '"s"'}]},
            "input[0]: function_call arguments must be a JSON object",
        ),
        (
            {
                "input": "x",
                "tools": [{"type": "function", "name": "f"}],
                "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": 5},
            },
            "tool_choice.tools",
        ),
        (
            {
                "input": [
                    {"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}
                ]
            },
            "vision",
        ),
    ],
)
def test_responses_errors_use_the_openai_shape(client, body, fragment):
    r = client.post("/v1/responses", json=body)
    assert r.status_code == 400
    assert fragment in r.json()["error"]["message"]


# A user question, the model's call and the call's result, as Responses input items.
WEATHER_ROUND_TRIP = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "type": "function_call",
        "call_id": "call_1",
        "name": "get_weather",
        "arguments": '{"city": "Paris"}',
    },
    {"type": "function_call_output", "call_id": "call_1", "output": "18 C"},
]


def test_responses_function_call_items_round_trip(client):
    items = WEATHER_ROUND_TRIP
    tools = [
        {"type": "function", "name": "get_weather", "parameters": {"type": "object"}},
        {"type": "web_search_preview"},
    ]
    r = client.post(
        "/v1/responses",
        json={"input": items, "tools": tools, "max_output_tokens": 4, "store": False},
    )
    assert r.status_code == 200 and client.get(f"/v1/responses/{r.json()['id']}").status_code == 404


def test_responses_input_items_list_the_chain_in_pages(client):
    """GET /v1/responses/{id}/input_items: the chain's earlier turns and this request's input
    as items (newest first by default), paged by limit / after / before, ids stable."""
    items = WEATHER_ROUND_TRIP
    tools = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]
    first = client.post(
        "/v1/responses", json={"input": items, "tools": tools, "max_output_tokens": 3}
    ).json()
    second = client.post(
        "/v1/responses",
        json={"input": "Thanks!", "previous_response_id": first["id"], "max_output_tokens": 3},
    ).json()
    url = f"/v1/responses/{second['id']}/input_items"
    listed = client.get(url, params={"order": "asc"}).json()
    assert listed["object"] == "list" and listed["has_more"] is False
    data = listed["data"]
    assert [i["type"] for i in data] == [
        "message",
        "function_call",
        "function_call_output",
        "message",  # the first answer
        "message",  # this request's input
    ]
    assert data[0]["content"] == [{"type": "input_text", "text": "Weather in Paris?"}]
    assert data[1]["call_id"] == "call_1" and json.loads(data[1]["arguments"]) == {"city": "Paris"}
    assert data[2]["output"] == "18 C"
    assert data[3]["role"] == "assistant" and data[3]["content"][0]["type"] == "output_text"
    assert data[3]["content"] == first["output"][0]["content"]  # text and annotations
    assert data[4]["content"][0]["text"] == "Thanks!"
    newest = client.get(url).json()["data"]  # desc by default
    assert [i["id"] for i in newest] == [i["id"] for i in reversed(data)]
    page = client.get(url, params={"order": "asc", "limit": 2}).json()
    assert [i["id"] for i in page["data"]] == [i["id"] for i in data[:2]] and page["has_more"]
    rest = client.get(url, params={"order": "asc", "after": page["last_id"]}).json()
    assert [i["id"] for i in rest["data"]] == [i["id"] for i in data[2:]]
    back = client.get(url, params={"order": "asc", "before": data[3]["id"], "limit": 2}).json()
    assert [i["id"] for i in back["data"]] == [i["id"] for i in data[1:3]]
    # the first response's own input: the three items it was given
    assert len(client.get(f"/v1/responses/{first['id']}/input_items").json()["data"]) == 3
    assert client.get(url, params={"after": "nope"}).status_code == 404
    assert client.get(url, params={"limit": 0}).status_code == 400
    assert client.get("/v1/responses/resp_unknown/input_items").status_code == 404


def test_response_store_ttl_and_byte_cap():
    store = ResponseStore(max_bytes=300, ttl_s=3600)
    assert store.put("a", {"x": "a" * 100}) and store.put("b", {"x": "b" * 100})
    assert store.get("a") is not None  # a is now the most recent
    store.put("c", {"x": "c" * 100})
    assert (
        store.get("b") is None
        and store.get("a")
        and store.get("c")
        and store.stats()["evicted"] == 1
    )
    assert not store.put("big", {"x": "z" * 400})
    store.ttl_s = -1
    assert store.get("a") is None and store.stats()["entries"] == 0


def test_oversized_store_entry_is_refused_before_generation(client):
    store = client.app.state.response_store
    old = store.max_bytes
    store.max_bytes = 200
    try:
        r = client.post("/v1/responses", json={"input": "x" * 400, "max_output_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["code"] == "store_entry_too_large"
        ok = client.post(
            "/v1/responses", json={"input": "x" * 400, "max_output_tokens": 2, "store": False}
        )
        assert ok.status_code == 200
    finally:
        store.max_bytes = old


def test_openapi_schema_describes_the_real_routes_and_can_be_switched_off(client):
    from fastapi.routing import APIRoute
    from fastapi.testclient import TestClient

    from mlxlab.serve.admin import router as admin
    from mlxlab.serve.anthropic import router as anthropic
    from mlxlab.serve.app import create_app
    from mlxlab.serve.audio import router as audio
    from mlxlab.serve.config import ServeConfig
    from mlxlab.serve.embeddings import router as embeddings
    from mlxlab.serve.openai import router as openai
    from mlxlab.serve.responses import router as responses
    from mlxlab.serve.web import router as web

    r = client.get("/openapi.json")
    assert r.status_code == 200 and "x-request-id" in r.headers
    schema = r.json()
    routers = (
        admin.health_router,
        admin.router,
        admin.admin_router,
        openai.router,
        anthropic.router,
        responses.router,
        web.pages_router,
        web.runs_router,
        audio.router,
        embeddings.router,
    )
    routes = {
        (m.lower(), route.path.replace(":path", ""))
        for router in routers
        for route in router.routes
        if isinstance(route, APIRoute) and route.include_in_schema
        for m in route.methods
    }
    documented = {(m, p) for p, ops in schema["paths"].items() for m in ops}
    assert documented == routes and ("post", "/v1/responses") in documented

    def body_ref(path):
        content = schema["paths"][path]["post"]["requestBody"]["content"]
        return content["application/json"]["schema"]["$ref"].rsplit("/", 1)[-1]

    assert body_ref("/v1/chat/completions") == "ChatRequest"
    assert body_ref("/v1/messages") == "MessagesRequest"
    assert body_ref("/v1/responses") == "ResponsesRequest"
    # Errors are documented as answered: 4XX in the protocol's shape, never FastAPI's 422.
    for path, ops in schema["paths"].items():
        for op in ops.values():
            assert "422" not in op["responses"], path
    errors = {
        path: ops["post"]["responses"]["4XX"]["content"]["application/json"]["schema"]["$ref"]
        for path, ops in schema["paths"].items()
        if "post" in ops
    }
    assert errors["/v1/messages"].endswith("/AnthropicError")
    assert errors["/v1/chat/completions"].endswith("/OpenAIError")
    stream = schema["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]
    assert "text/event-stream" in stream

    cfg = ServeConfig(model="tiny-gemma3", openapi=False)
    off = TestClient(create_app(cfg, client.app.state.gateway), base_url="http://localhost")
    off = off.get("/openapi.json")
    assert off.status_code == 404 and off.json()["error"]["type"] == "not_found_error"
    assert client.get("/docs").status_code == 404


BAD_SCHEMA = {"type": 12, "properties": "x"}
GOOD_TOOL = {"type": "function", "function": {"name": "ok", "parameters": {"type": "object"}}}


def post_each_protocol(client, tools_openai, tools_anthropic, tools_responses):
    """(OpenAI chat, Anthropic, Responses) answers to one question offering these tools."""
    chat = client.post(
        "/v1/chat/completions",
        json={"messages": CONVO, "max_tokens": 2, "tools": tools_openai},
    )
    msg = client.post(
        "/v1/messages",
        json={"model": "x", "messages": CONVO, "max_tokens": 2, "tools": tools_anthropic},
    )
    resp = client.post(
        "/v1/responses",
        json={"input": "Name a prime number.", "max_output_tokens": 2, "tools": tools_responses},
    )
    return chat, msg, resp


def test_an_invalid_tool_schema_is_a_400_naming_it_even_when_no_call_is_forced(client):
    chat, msg, resp = post_each_protocol(
        client,
        [GOOD_TOOL, {"type": "function", "function": {"name": "f", "parameters": BAD_SCHEMA}}],
        [
            {"type": "web_search_20250305", "name": "web_search"},
            {"name": "f", "input_schema": BAD_SCHEMA},
        ],
        [
            {"type": "web_search_preview"},
            {"type": "function", "name": "f", "parameters": BAD_SCHEMA},
        ],
    )
    assert chat.status_code == 400, chat.text
    err = chat.json()["error"]
    assert err["param"] == "tools[1].function.parameters" and err["code"] == "invalid_schema"
    assert err["message"].startswith("tools[1].function.parameters: ")
    assert msg.status_code == 400 and msg.json()["type"] == "error"
    assert msg.json()["error"]["message"].startswith("tools[1].input_schema: ")
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "tools[1].parameters"
    count = client.post(
        "/v1/messages/count_tokens",
        json={
            "model": "x",
            "messages": CONVO,
            "tools": [{"name": "f", "input_schema": BAD_SCHEMA}],
        },
    )
    assert count.status_code == 400 and "tools[0].input_schema" in count.json()["error"]["message"]
    # tool_choice none still sends the definitions: they are checked all the same (as OpenAI does).
    none = client.post(
        "/v1/responses",
        json={
            "input": "x",
            "tool_choice": "none",
            "tools": [{"type": "function", "name": "f", "parameters": {"required": "a"}}],
        },
    )
    assert none.status_code == 400 and none.json()["error"]["param"] == "tools[0].parameters"


def test_valid_schemas_the_grammar_engine_cannot_enforce_are_offered_unforced(client):
    """A JSON schema is valid though llguidance lacks some of it (uniqueItems, propertyNames,
    if/then, look-ahead patterns, custom formats): fine unless a call is forced."""
    params = {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
            "name": {"type": "string", "pattern": "^(?!tmp).*$", "format": "x-custom"},
            "env": {"type": "object", "propertyNames": {"pattern": "^[A-Z_]+$"}},
        },
        "if": {"required": ["name"]},
        "then": {"required": ["tags"]},
    }
    chat, msg, resp = post_each_protocol(
        client,
        [{"type": "function", "function": {"name": "f", "parameters": params}}],
        [{"name": "f", "input_schema": params}],
        [{"type": "function", "name": "f", "parameters": params}],
    )
    assert [r.status_code for r in (chat, msg, resp)] == [200, 200, 200], (chat.text, msg.text)
    forced = client.post(
        "/v1/chat/completions",
        json={
            "messages": CONVO,
            "max_tokens": 2,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": params}}],
            "tool_choice": "required",
        },
    )
    assert forced.status_code == 400 and forced.json()["error"]["code"] == "invalid_schema"


CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize(
    "messages,param",
    [
        (
            [*CONVO, {"role": "tool", "tool_call_id": "call_1", "content": "7"}],
            "messages[1]",
        ),
        (
            [
                *CONVO,
                {"role": "assistant", "content": "", "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "7"},
                {"role": "user", "content": "And?"},
                {"role": "tool", "tool_call_id": "call_1", "content": "7"},
            ],
            "messages[4]",
        ),
        (
            [
                *CONVO,
                {"role": "assistant", "content": "", "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_9", "content": "7"},
            ],
            "messages[2].tool_call_id",
        ),
    ],
)
def test_openai_tool_message_must_answer_a_preceding_call(client, messages, param):
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(param + ": ")


def test_a_tool_message_answering_the_call_before_it_is_accepted(client):
    messages = [
        *CONVO,
        {"role": "assistant", "content": "", "tool_calls": [CALL, {**CALL, "id": "call_2"}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "7"},
        {"role": "tool", "tool_call_id": "call_2", "content": "11"},
    ]
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    assert r.status_code == 200, r.text


STRICT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if loop.index0 > 0 and m['role'] == messages[loop.index0 - 1]['role'] -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}{{ m['role'] }}: {{ m['content'] }}\n{%- endfor -%}"
    "{%- if add_generation_prompt -%}assistant: {%- endif -%}"
)


def two_assistant_turns(client):
    """(OpenAI, Anthropic, Responses) answers to a conversation with two assistant turns in a
    row (the third message, after the system prompt where one is given)."""
    turns = [
        {"role": "user", "content": "Name a prime."},
        {"role": "assistant", "content": "2."},
        {"role": "assistant", "content": "Also 3."},
        {"role": "user", "content": "Another?"},
    ]
    chat = client.post("/v1/chat/completions", json={"messages": turns, "max_tokens": 2})
    msg = client.post(
        "/v1/messages",
        json={"model": "x", "system": "Be brief.", "messages": turns, "max_tokens": 2},
    )
    resp = client.post(
        "/v1/responses",
        json={"instructions": "Be brief.", "input": turns, "max_output_tokens": 2, "store": False},
    )
    return chat, msg, resp


def test_consecutive_assistant_messages_render_where_the_template_takes_them(client, monkeypatch):
    chat, msg, resp = two_assistant_turns(client)  # mlxlab's Gemma template renders them
    assert [r.status_code for r in (chat, msg, resp)] == [200, 200, 200], (chat.text, msg.text)

    tokenizer = client.app.state.gateway.loaded.tokenizer._tokenizer
    monkeypatch.setattr(tokenizer, "chat_template", STRICT_TEMPLATE)
    chat, msg, resp = two_assistant_turns(client)
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages[2]", chat.text
    assert "two assistant messages in a row" in chat.json()["error"]["message"]
    assert msg.status_code == 400 and msg.json()["error"]["message"].startswith("messages[2]: ")
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "input[2]", resp.text


@pytest.mark.parametrize(
    "choice,tools,fragment",
    [
        ({"type": "any"}, None, "needs at least one offered function tool"),
        ({"type": "tool", "name": "g"}, "f", "no offered tool is named 'g'"),
        ({"type": "tool"}, "f", "needs a name"),
    ],
)
def test_count_tokens_refuses_the_tool_choice_messages_refuses(client, choice, tools, fragment):
    body = {"model": "x", "messages": CONVO, "tool_choice": choice}
    if tools:
        body["tools"] = [{"name": tools, "input_schema": {"type": "object"}}]
    answers = [
        client.post("/v1/messages/count_tokens", json=body),
        client.post("/v1/messages", json={**body, "max_tokens": 2}),
    ]
    for r in answers:
        assert r.status_code == 400 and r.json()["type"] == "error", r.text
        assert fragment in r.json()["error"]["message"]
