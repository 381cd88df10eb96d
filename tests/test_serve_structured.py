"""Structured output and forced tool calls on every protocol, in-process on tiny-gemma3 (a random
model: whatever it says unconstrained is gibberish, so valid JSON proves the grammar), plus the
batched lane's per-row constraints."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import jsonschema
import pytest

from mlxlab import grammar as G
from mlxlab.serve import structured
from mlxlab.serve.engine.jobs import Done, Job, Sampling
from mlxlab.serve.engine.output import ToolSyntax
from mlxlab.serve.http import APIError
from tests.helpers.serve import make_client, named_events, sse_events, streamed_content

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "units": {"enum": ["metric", "imperial"]},
        "tags": {
            "type": "array",
            "items": {"type": "string", "pattern": "^[a-z]{1,6}$"},
            "minItems": 1,
            "maxItems": 3,
        },
    },
    "required": ["city", "days", "tags"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 10},
                    "days": {"type": "integer", "minimum": 1, "maximum": 3},
                },
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"enum": ["UTC", "CET"]}},
                "required": ["zone"],
            },
        },
    },
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(tiny_dir):
    tiny_dir("gemma3")
    c, gateway = make_client()
    yield c
    gateway.stop()


def chat(client, **kw):
    r = client.post(
        "/v1/chat/completions", json={"messages": ASK, "max_tokens": 160, "temperature": 0, **kw}
    )
    assert r.status_code == 200, r.text
    return r.json()


DEEP: dict = {"type": "string"}
for _ in range(180):  # ~360 nested objects: past the recursion limit of a schema walk
    DEEP = {"type": "object", "properties": {"a": DEEP}, "required": ["a"]}


def fmt(schema, name="weather"):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def test_json_schema_output_parses_validates_and_streams_the_same(client):
    body = chat(client, response_format=fmt(SCHEMA))
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
    free = chat(client)["choices"][0]["message"]["content"]
    assert free != choice["message"]["content"]  # the grammar did the work
    r = client.post(
        "/v1/chat/completions",
        json={
            "messages": ASK,
            "max_tokens": 160,
            "temperature": 0,
            "response_format": fmt(SCHEMA),
            "stream": True,
        },
    )
    assert streamed_content(sse_events(r.text)) == choice["message"]["content"]


def test_sampled_json_object_and_text(client):
    texts = set()
    for seed in (1, 2, 3):  # sampled: every draw validates
        out = chat(client, temperature=1.0, seed=seed, response_format=fmt(SCHEMA))["choices"][0]
        assert out["finish_reason"] == "stop"
        jsonschema.validate(json.loads(out["message"]["content"]), SCHEMA)
        texts.add(out["message"]["content"])
    assert len(texts) > 1
    out = chat(client, response_format={"type": "json_object"}, max_tokens=400)["choices"][0]
    assert out["finish_reason"] == "stop" and isinstance(
        json.loads(out["message"]["content"]), dict
    )
    assert (
        chat(client, response_format={"type": "text"})["choices"][0]["message"]["content"]
        == chat(client)["choices"][0]["message"]["content"]
    )


def test_max_tokens_cuts_to_a_valid_prefix(client):
    full = chat(client, response_format=fmt(SCHEMA))["choices"][0]["message"]["content"]
    cut = chat(client, response_format=fmt(SCHEMA), max_tokens=5)["choices"][0]
    assert cut["finish_reason"] == "length" and full.startswith(cut["message"]["content"])


def test_completions_take_a_response_format_too(client):
    r = client.post(
        "/v1/completions",
        json={
            "prompt": "JSON:",
            "max_tokens": 160,
            "temperature": 0,
            "response_format": fmt(SCHEMA),
        },
    ).json()
    jsonschema.validate(json.loads(r["choices"][0]["text"]), SCHEMA)


@pytest.mark.parametrize(
    "choice,names",
    [
        ("required", {"get_weather", "get_time"}),
        ({"type": "function", "function": {"name": "get_time"}}, {"get_time"}),
    ],
)
def test_tool_choice_forces_a_call_whose_arguments_validate(client, choice, names):
    body = chat(client, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False)
    c = body["choices"][0]
    assert c["finish_reason"] == "tool_calls" and len(c["message"]["tool_calls"]) == 1
    call = c["message"]["tool_calls"][0]["function"]
    assert call["name"] in names
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    jsonschema.validate(json.loads(call["arguments"]), params[call["name"]])
    auto = chat(client, tools=TOOLS)["choices"][0]
    assert auto["finish_reason"] != "tool_calls"  # unforced, the random model does not call


def test_a_forced_call_with_local_refs_in_its_schema_answers(client):
    """Pydantic writes `$defs` and `$ref`: a forced call whose schema has them is a call that
    validates (a bad-input probe had a 400 that named a pointer into the call's grammar)."""
    params = {
        "type": "object",
        "properties": {"loc": {"$ref": "#/$defs/Loc"}},
        "required": ["loc"],
        "$defs": {
            "Loc": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 12}},
                "required": ["city"],
            }
        },
    }
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": params}}]
    c = chat(client, tools=tools, tool_choice="required", parallel_tool_calls=False)["choices"][0]
    assert c["finish_reason"] == "tool_calls", c
    args = json.loads(c["message"]["tool_calls"][0]["function"]["arguments"])
    jsonschema.validate(args, params)
    assert set(args["loc"]) == {"city"}  # the inlined object is closed
    same = chat(client, response_format=fmt(params))["choices"][0]["message"]["content"]
    assert set(json.loads(same)["loc"]) == {"city"}  # and so is a response_format's


def test_anthropic_tool_choice_any_and_tool(client):
    tools = [
        {"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS
    ]
    for choice, names in (
        ({"type": "any"}, {"get_weather", "get_time"}),
        ({"type": "tool", "name": "get_weather"}, {"get_weather"}),
    ):
        r = client.post(
            "/v1/messages",
            json={
                "model": "x",
                "messages": ASK,
                "max_tokens": 120,
                "temperature": 0,
                "tools": tools,
                "tool_choice": choice,
            },
        ).json()
        uses = [b for b in r["content"] if b["type"] == "tool_use"]
        assert r["stop_reason"] == "tool_use" and uses and uses[0]["name"] in names
        jsonschema.validate(
            uses[0]["input"], next(t["input_schema"] for t in tools if t["name"] == uses[0]["name"])
        )
    s = client.post(
        "/v1/messages",
        json={
            "model": "x",
            "messages": ASK,
            "max_tokens": 120,
            "temperature": 0,
            "tools": tools,
            "tool_choice": {"type": "any"},
            "stream": True,
        },
    )
    starts = [d["content_block"] for e, d in named_events(s.text) if e == "content_block_start"]
    assert any(b["type"] == "tool_use" for b in starts)


def test_anthropic_output_config_format_holds_the_answer_to_the_schema(client):
    """`output_config.format` (what the anthropic SDK's messages.parse sends) and the beta's
    `output_format`: the text block parses and validates, streamed the same; a bad schema, or
    both at once, a 400 in the Anthropic shape naming the field, from count_tokens too."""
    body = {"model": "x", "messages": ASK, "max_tokens": 160, "temperature": 0}
    fmt = {"type": "json_schema", "schema": SCHEMA}
    answers = []
    for extra in ({"output_config": {"format": fmt, "effort": "low"}}, {"output_format": fmt}):
        r = client.post("/v1/messages", json={**body, **extra})
        assert r.status_code == 200, r.text
        (block,) = r.json()["content"]
        assert block["type"] == "text" and r.json()["stop_reason"] == "end_turn"
        jsonschema.validate(json.loads(block["text"]), SCHEMA)
        answers.append(block["text"])
    assert answers[0] == answers[1]
    s = client.post("/v1/messages", json={**body, "output_config": {"format": fmt}, "stream": True})
    deltas = [d["delta"] for e, d in named_events(s.text) if e == "content_block_delta"]
    assert "".join(d["text"] for d in deltas) == answers[0]
    free = client.post("/v1/messages", json=body).json()["content"][0]["text"]
    assert free != answers[0]  # the random model's own text is not this JSON
    bad = {"type": "json_schema", "schema": {"type": "banana"}}
    counted = {"model": "x", "messages": ASK}
    for extra, fragment in (
        ({"output_config": {"format": bad}}, "output_config.format.schema"),
        ({"output_format": bad}, "output_format.schema"),
        ({"output_config": {"format": fmt}, "output_format": fmt}, "once"),
        ({"output_config": {"format": {"type": "yaml", "schema": {}}}}, "json_schema"),
    ):
        for route, ask in (("/v1/messages", body), ("/v1/messages/count_tokens", counted)):
            r = client.post(route, json={**ask, **extra})
            assert r.status_code == 400 and r.json()["type"] == "error", (extra, r.text)
            assert r.json()["error"]["type"] == "invalid_request_error"
            assert fragment in r.json()["error"]["message"], (fragment, r.text)
    n = client.post("/v1/messages/count_tokens", json={**counted, "output_config": {"format": fmt}})
    assert n.status_code == 200 and n.json()["input_tokens"] > 0


def test_responses_text_format_and_tool_choice(client):
    r = client.post(
        "/v1/responses",
        json={
            "input": "Weather?",
            "max_output_tokens": 160,
            "temperature": 0,
            "text": {
                "format": {"type": "json_schema", "name": "w", "schema": SCHEMA, "strict": True}
            },
        },
    ).json()
    jsonschema.validate(json.loads(r["output_text"]), SCHEMA)
    assert r["text"]["format"]["type"] == "json_schema" and r["text"]["format"]["schema"] == SCHEMA
    tools = [
        {
            "type": "function",
            "name": t["function"]["name"],
            "parameters": t["function"]["parameters"],
        }
        for t in TOOLS
    ]
    r = client.post(
        "/v1/responses",
        json={
            "input": "Weather?",
            "max_output_tokens": 120,
            "temperature": 0,
            "tools": tools,
            "tool_choice": {"type": "function", "name": "get_weather"},
        },
    )
    calls = [i for i in r.json()["output"] if i["type"] == "function_call"]
    assert calls and calls[0]["name"] == "get_weather"
    jsonschema.validate(json.loads(calls[0]["arguments"]), TOOLS[0]["function"]["parameters"])


def test_auto_with_a_schema_allows_a_call_or_the_json(client):
    c = chat(client, tools=TOOLS, response_format=fmt(SCHEMA))["choices"][0]
    if c["finish_reason"] == "tool_calls":
        assert c["message"]["tool_calls"][0]["function"]["name"] in {"get_weather", "get_time"}
    else:
        jsonschema.validate(json.loads(c["message"]["content"]), SCHEMA)


@pytest.mark.parametrize(
    "body,param,fragment",
    [
        ({"response_format": {"type": "yaml"}}, "response_format.type", "json_schema"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "required"),
        (
            {
                "response_format": fmt(
                    {
                        "type": "object",
                        "properties": {"a": {"type": "string", "pattern": "(?<=x)y"}},
                    }
                )
            },
            "response_format.json_schema.schema",
            "look-around",
        ),
        (
            {"response_format": fmt({"type": "banana"})},
            "response_format.json_schema.schema",
            "banana",
        ),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "nope",
        ),
        ({"tool_choice": "required"}, "tool_choice", "at least one"),
        ({"tool_choice": {"type": "function"}}, "tool_choice", "tool_choice must be"),
        (  # deeper than Python's stack (a 500 before)
            {"response_format": fmt(DEEP)},
            "response_format.json_schema.schema",
            "nested too deeply",
        ),
        # no finite value (a probe got 200, finish "stop", content '{"'): refused up front
        (
            {"response_format": fmt({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"})},
            "response_format.json_schema.schema",
            "recurse without end",
        ),
        (
            {
                "response_format": fmt(
                    {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
                )
            },
            "response_format.json_schema.schema",
            "recurse without end",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "t",
                            "parameters": {"type": "object", "properties": {"a": {"$ref": "#"}}},
                        },
                    }
                ],
                "tool_choice": "required",
            },
            "tools[0]",
            "recursive parameter schema",
        ),
    ],
)
def test_unenforceable_requests_are_400_before_generation(client, body, param, fragment):
    r = client.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and fragment in err["message"], err


def test_anthropic_and_responses_refuse_in_their_own_shapes(client):
    r = client.post(
        "/v1/messages",
        json={
            "model": "x",
            "messages": ASK,
            "max_tokens": 4,
            "tool_choice": {"type": "tool", "name": "nope"},
            "tools": [{"name": "a", "input_schema": {"type": "object"}}],
        },
    )
    assert (
        r.status_code == 400
        and r.json()["type"] == "error"
        and "nope" in r.json()["error"]["message"]
    )
    r = client.post(
        "/v1/responses",
        json={
            "input": "x",
            "text": {"format": {"type": "json_schema", "schema": {"type": "banana"}}},
        },
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "text.format.schema"


def test_batched_rows_with_and_without_constraints_equal_each_alone(tiny_dir):
    """Per-row matcher state: a batch mixing constrained and free rows gives each row the tokens
    it gets served alone."""
    _, gateway = make_client(batch=4, prompt_cache_gb=0)
    try:
        tok = gateway.loaded.tokenizer
        schema_g = G.json_schema(SCHEMA)
        other = G.json_schema(
            {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4}
        )
        prompts = [
            tok.encode(p)
            for p in ("Weather in Paris?", "List numbers.", "Hello there", "Weather in Rome?")
        ]
        grammars = [schema_g, other, None, schema_g]

        def jobs():
            return [
                Job(list(p), 96, None, Sampling(temperature=0.0), grammar=g, id=str(i))
                for i, (p, g) in enumerate(zip(prompts, grammars, strict=True))
            ]

        def run(batch):
            done, left = {}, threading.Semaphore(0)
            for j in batch:
                j.sink = lambda ev, j=j: (
                    (done.__setitem__(j.id, ev), left.release()) if isinstance(ev, Done) else None
                )
                gateway.submit(j)
            for _ in batch:
                assert left.acquire(timeout=120)
            return done

        alone = {}
        for j in jobs():
            alone.update(run([j]))
        together = run(jobs())
        assert {k: d.tokens for k, d in together.items()} == {k: d.tokens for k, d in alone.items()}
        assert gateway.batch.peak_rows >= 2
        for i in (0, 3):
            jsonschema.validate(json.loads(tok.decode(together[str(i)].tokens[:-1])), SCHEMA)
    finally:
        gateway.stop()


def test_logprobs_under_a_constraint_are_finite(client):
    body = chat(client, response_format=fmt(SCHEMA), logprobs=True, top_logprobs=20, max_tokens=24)
    entries = body["choices"][0]["logprobs"]["content"]
    assert entries and all(e["logprob"] > -1e4 for e in entries)
    assert all(t["logprob"] > -float("inf") for e in entries for t in e["top_logprobs"])
    assert any(len(e["top_logprobs"]) < 20 for e in entries)  # ruled-out tokens are no alternatives
    r = client.post(
        "/v1/completions",
        json={
            "prompt": "x",
            "max_tokens": 8,
            "temperature": 0,
            "logprobs": 5,
            "response_format": fmt(SCHEMA),
            "stream": True,
        },
    )
    assert r.status_code == 200 and "Infinity" not in r.text


def test_schemas_that_closing_could_break_still_compile():
    combined = {
        "allOf": [
            {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
            {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]},
        ]
    }
    assert G.closed(combined) == combined
    G.json_schema(combined)
    assert G.closed(SCHEMA) == SCHEMA  # already closed
    opened = {"type": "object", "properties": {"x": {"type": "object", "properties": {"y": {}}}}}
    assert G.closed(opened)["additionalProperties"] is False
    assert G.closed(opened)["properties"]["x"]["additionalProperties"] is False


def fake_loaded(tiny_tokenizer, family: str | None):
    markers = {
        "gemma4": ("<|tool_call>", "<tool_call|>"),
        "json_tools": ("<tool_call>", "</tool_call>"),
        "pythonic": ("[", "]"),
    }
    tool = ToolSyntax(*markers[family], lambda text, tools: None, family) if family else None
    return SimpleNamespace(tool=tool, tokenizer=tiny_tokenizer)


@pytest.fixture(scope="module")
def tokenizer(client):
    return client.app.state.gateway.loaded.tokenizer


@pytest.mark.parametrize(
    "params,fragment",
    [
        ({"type": "object", "required": 5}, "tools[0]"),
        ({"type": "object", "properties": [1]}, "tools[0]"),
        ({"type": "string", "minLength": "a"}, "tools[0]"),
        ("a string", "must be a JSON schema object"),
    ],
)
def test_malformed_tool_schemas_are_400_on_every_family(tokenizer, params, fragment):
    tools = [{"type": "function", "function": {"name": "f", "parameters": params}}]
    for family in ("gemma4", "json_tools"):
        with pytest.raises(APIError) as e:
            structured.grammar_for(
                structured.Shape(tool_choice="required"), tools, fake_loaded(tokenizer, family)
            )
        assert e.value.status == 400 and fragment in e.value.message and e.value.param == "tools[0]"


def test_unforced_tools_on_a_family_without_a_grammar_keep_the_schema(tokenizer):
    shape = structured.Shape(schema=SCHEMA)
    g = structured.grammar_for(shape, TOOLS, fake_loaded(tokenizer, "pythonic"))
    assert g is not None and "tool" not in g.what
    with pytest.raises(APIError) as e:
        structured.grammar_for(
            structured.Shape(tool_choice="required"), TOOLS, fake_loaded(tokenizer, "pythonic")
        )
    assert e.value.code == "tool_choice_not_enforceable"
    with pytest.raises(APIError) as e:
        structured.grammar_for(shape, None, fake_loaded(tokenizer, None), reasoning=True)
    assert e.value.code == "constraint_with_reasoning"
    huge = [
        {
            "type": "function",
            "function": {
                "name": "f",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "xs": {"type": "array", "items": {"type": "integer"}, "minItems": 100000}
                    },
                    "required": ["xs"],
                },
            },
        }
    ]
    g = structured.grammar_for(
        structured.Shape(tool_choice="required"), huge, fake_loaded(tokenizer, "gemma4")
    )
    assert len(g.text) < 20000  # not unrolled


def test_allowed_tools_limit_the_choice(client):
    only_time = {
        "type": "allowed_tools",
        "allowed_tools": {
            "mode": "required",
            "tools": [{"type": "function", "function": {"name": "get_time"}}],
        },
    }
    c = chat(client, tools=TOOLS, tool_choice=only_time)["choices"][0]
    assert c["finish_reason"] == "tool_calls" and {
        t["function"]["name"] for t in c["message"]["tool_calls"]
    } == {"get_time"}
    assert chat(
        client, tools=TOOLS, tool_choice={"type": "custom", "custom": {"name": "x"}}, max_tokens=4
    )


def test_odd_bodies_are_4xx_in_the_right_shape(client):
    r = client.post(
        "/v1/chat/completions",
        content=b'{"messages": [{"role": "user", "content": "\xff"}]}',
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and "error" in r.json()
    r = client.post(
        "/v1/chat/completions", content=b"\xff\xfe{}", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and "error" in r.json()
    assert client.get("/v1/messages").json()["type"] == "error"  # 405, Anthropic shape
    assert client.post("/v1/messages/nope", json={}).json()["error"]["type"] == "not_found_error"
    r = client.post("/v1/responses", json={"input": [{"role": "user", "content": ["x"]}]})
    assert r.status_code == 400 and "part" in r.json()["error"]["message"]
