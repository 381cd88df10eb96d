"""End to end: `python -m mlxlab serve` as a subprocess on gemma3-270m, driven by the official
`openai` SDK and raw HTTP (streams, stops, tools, the prompt cache, admission, disconnects,
bad bodies, the drain on SIGTERM)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from tests.helpers.cli import REPO
from tests.helpers.serve import free_port

pytestmark = [pytest.mark.slow, pytest.mark.real_model]  # a subprocess server on gemma3-270m

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


def start_server(port: int, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "mlxlab", "serve", f"port={port}", *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ),
    )


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited early:\n{proc.stdout.read()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError("server did not become ready")


@pytest.fixture(scope="module")
def served(real_model_dir):
    port = free_port()
    # A long drain: on a shared CPU the drain test's answer may take more than the default 30 s.
    proc = start_server(port, "memory_budget_gb=6", "max_tokens=64", "drain_timeout_s=300")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc)
        yield url, proc, openai.OpenAI(base_url=f"{url}/v1", api_key="sk-anything", max_retries=0)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def ask(client, content, **kw):
    return client.chat.completions.create(
        model="gpt-4o", messages=[{"role": "user", "content": content}], temperature=0, **kw
    )


def test_chat_stream_and_completions(served):
    _, _, client = served
    r = ask(client, "Name the day after Monday.", max_tokens=16)
    text = r.choices[0].message.content
    assert r.model == "gemma3-270m" and text and r.usage.completion_tokens <= 16
    assert "<end_of_turn>" not in text and "<start_of_turn>" not in text
    chunks = list(
        ask(
            client,
            "Name the day after Monday.",
            max_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    c = client.completions.create(
        model="x", prompt="Monday, Tuesday, Wednesday,", max_tokens=4, temperature=0
    )
    assert "Thursday" in c.choices[0].text
    # the SDK's list of prompts and echo (each prompt's choice by index, the prompt echoed first)
    days = "Monday, Tuesday, Wednesday,"
    many = client.completions.create(
        model="x", prompt=[days, "January, February,"], max_tokens=4, temperature=0, echo=True
    )
    assert [ch.index for ch in many.choices] == [0, 1]
    assert many.choices[0].text == days + c.choices[0].text
    assert many.choices[1].text.startswith("January, February,")
    assert many.usage.prompt_tokens > c.usage.prompt_tokens


def test_stop_spanning_tokens(served):
    _, _, client = served
    prompt = "Monday, Tuesday, Wednesday,"
    full = (
        client.completions.create(model="x", prompt=prompt, max_tokens=8, temperature=0)
        .choices[0]
        .text
    )
    assert "Thursday, Friday" in full
    stop = "day, Fri"  # ends mid-token: "day" closes " Thursday", "Fri" starts " Friday"
    r = client.completions.create(
        model="x", prompt=prompt, max_tokens=8, temperature=0, stop=[stop]
    )
    assert r.choices[0].text == full[: full.index(stop)] and r.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model="x", prompt=prompt, max_tokens=8, temperature=0, stop=stop, stream=True
    )
    pieces = [c.choices[0].text for c in streamed if c.choices]
    assert "".join(pieces) == full[: full.index(stop)] and not any("Fri" in p for p in pieces)


def test_tool_call_round_trip(served):
    _, _, client = served
    history = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
        {"role": "assistant", "content": "It is 18 C and sunny in Paris."},
        {"role": "user", "content": "What is the weather in Berlin?"},
    ]
    r = client.chat.completions.create(
        model="x", messages=history, tools=TOOLS, temperature=0, max_tokens=40
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {
        "city": "Berlin"
    }
    assert "<tool_call>" not in (choice.message.content or "")
    # Streamed: the markup never streams, the call arrives as a tool_calls delta.
    chunks = list(
        client.chat.completions.create(
            model="x", messages=history, tools=TOOLS, temperature=0, max_tokens=40, stream=True
        )
    )
    assert not any("<tool_call" in (c.choices[0].delta.content or "") for c in chunks if c.choices)
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert (
        deltas[0].function.name == "get_weather"
        and chunks[-1].choices[0].finish_reason == "tool_calls"
    )
    # The round trip: the call and its result go back, the model answers.
    history += [
        {"role": "assistant", "content": "", "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "9 C, rain"},
    ]
    final = client.chat.completions.create(
        model="x", messages=history, tools=TOOLS, temperature=0, max_tokens=24
    )
    assert final.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert final.usage.prompt_tokens > r.usage.prompt_tokens


def test_second_turn_hits_the_prompt_cache(served):
    _, _, client = served
    doc = " ".join(f"Fact {i}: the value of item {i} is {i * 7}." for i in range(40))
    messages = [
        {"role": "system", "content": "Answer from the facts.\n" + doc},
        {"role": "user", "content": "What is the value of item 3?"},
    ]
    first = client.chat.completions.create(
        model="x", messages=messages, temperature=0, max_tokens=12
    )
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And item 5?"},
    ]
    second = client.chat.completions.create(
        model="x", messages=messages, temperature=0, max_tokens=12
    )
    assert first.usage.prompt_tokens > 500
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1


def test_admission_and_bad_bodies(served):
    url, _, client = served
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, "hi", max_tokens=10_000_000)
    assert (
        e.value.body["type"] == "memory_admission" and e.value.body["code"] == "context_over_budget"
    )
    for body in (
        b"{",
        b'{"messages": 3}',
        b'{"messages": [{"role": "user", "content": "x"}], "top_p": 0}',
        b'{"prompt": null}',
    ):
        for path in ("/v1/chat/completions", "/v1/completions"):
            r = httpx.post(
                url + path,
                content=body,
                headers={"content-type": "application/json", "x-request-id": "t-1"},
            )
            assert (
                r.status_code == 400
                and r.json()["error"]["message"]
                and r.headers["x-request-id"] == "t-1"
            )


def test_disconnect_mid_stream_frees_the_engine(served):
    url, _, client = served
    body = {
        "messages": [{"role": "user", "content": "Count from 1 to 500."}],
        "max_tokens": 2000,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if '"content"' in line and '"role"' not in line:
                break  # leave after the first token
    deadline = time.time() + 30
    while time.time() < deadline and httpx.get(url + "/stats").json()["queue"]["running"]:
        time.sleep(0.2)
    stats = httpx.get(url + "/stats").json()["queue"]
    assert stats["running"] == 0 and stats["cancelled"] >= 1 and stats["completion_tokens"] < 2000
    assert ask(client, "Say hi.", max_tokens=4).choices[0].message.content is not None


def test_anthropic_sdk(served):
    import anthropic

    url, _, client = served
    claude = anthropic.Anthropic(base_url=url, api_key="sk-ant-anything", max_retries=0)
    # (this SDK version has no `temperature` argument; the wire field goes in extra_body)
    msg = claude.messages.create(
        model="claude-sonnet-4-5",
        max_tokens=16,
        extra_body={"temperature": 0},
        messages=[{"role": "user", "content": "Name the day after Monday."}],
    )
    chat = ask(client, "Name the day after Monday.", max_tokens=16)
    assert msg.content[0].text == chat.choices[0].message.content and msg.stop_reason in (
        "end_turn",
        "max_tokens",
    )
    # Anthropic's input_tokens is the uncached part; the prompt is that plus the cache reads.
    prompt = msg.usage.input_tokens + msg.usage.cache_read_input_tokens
    assert prompt == chat.usage.prompt_tokens
    with claude.messages.stream(
        model="claude-x",
        max_tokens=16,
        extra_body={"temperature": 0},
        messages=[{"role": "user", "content": "Name the day after Monday."}],
    ) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == msg.content[0].text and final.usage.output_tokens == msg.usage.output_tokens
    count = claude.messages.count_tokens(
        model="x", messages=[{"role": "user", "content": "Name the day after Monday."}]
    )
    assert count.input_tokens == prompt
    tools = [
        {
            "name": "get_weather",
            "description": "Current weather for a city",
            "input_schema": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        }
    ]
    history = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": [
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "get_weather",
                    "input": {"city": "Paris"},
                }
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C, sunny"}
            ],
        },
        {"role": "assistant", "content": "It is 18 C and sunny in Paris."},
        {"role": "user", "content": "What is the weather in Berlin?"},
    ]
    call = claude.messages.create(
        model="x", max_tokens=40, extra_body={"temperature": 0}, tools=tools, messages=history
    )
    uses = [b for b in call.content if b.type == "tool_use"]
    assert (
        call.stop_reason == "tool_use"
        and uses[0].name == "get_weather"
        and uses[0].input == {"city": "Berlin"}
    )
    history += [
        {"role": "assistant", "content": [u.model_dump() for u in uses]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "9 C"}],
        },
    ]
    after = claude.messages.create(
        model="x", max_tokens=16, extra_body={"temperature": 0}, tools=tools, messages=history
    )
    assert (
        after.usage.input_tokens + after.usage.cache_read_input_tokens
        > call.usage.input_tokens + call.usage.cache_read_input_tokens
    )
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(
            model="x",
            max_tokens=8,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "toolu_nope", "content": "x"}
                    ],
                }
            ],
        )
    assert (
        e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    )


def test_openai_responses_sdk(served):
    _, _, client = served
    ask = {
        "model": "x",
        "instructions": "Answer briefly.",
        "input": "Name the day after Monday.",
        "max_output_tokens": 16,
        "temperature": 0,
    }
    first = client.responses.create(**ask)
    assert first.output_text and first.id.startswith("resp_")
    chat = client.chat.completions.create(
        model="x",
        temperature=0,
        max_tokens=16,
        messages=[
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Name the day after Monday."},
        ],
    )
    assert first.output_text == chat.choices[0].message.content
    scored = client.responses.create(
        **ask, include=["message.output_text.logprobs"], top_logprobs=3
    )
    part = scored.output[0].content[0]
    assert part.text == first.output_text and scored.top_logprobs == 3
    # one entry per answer token (the end of sequence, when it came, is counted but has none)
    assert len(part.logprobs) == scored.usage.output_tokens - (scored.status == "completed")
    assert all(len(lp.top_logprobs) == 3 and lp.logprob <= 0 for lp in part.logprobs)
    events = list(
        client.responses.create(
            model="x",
            input="And the day after that?",
            previous_response_id=first.id,
            max_output_tokens=16,
            temperature=0,
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] in (
        "response.completed",
        "response.incomplete",
    )
    final = events[-1].response
    assert (
        "".join(e.delta for e in events if e.type == "response.output_text.delta")
        == final.output_text
    )
    assert final.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 1
    assert client.responses.retrieve(first.id).id == first.id
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="x", input="x", previous_response_id="resp_doesnotexist")


def test_batched_server_with_concurrent_sdk_clients(served, real_model_dir):
    """`serve batch=4`: a tool round trip, a stream, an Anthropic message and a Responses call at
    the same time; each answer equals the serial server's (greedy); the rows shared the batch."""
    import anthropic

    _, _, serial = served
    port = free_port()
    proc = start_server(port, "memory_budget_gb=6", "max_tokens=64", "batch=4")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        claude = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
        history = [
            {"role": "user", "content": "What is the weather in Paris?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
            {"role": "assistant", "content": "It is 18 C and sunny in Paris."},
            {"role": "user", "content": "What is the weather in Berlin?"},
        ]
        calls = {
            "tool": lambda c: (
                c.chat.completions.create(
                    model="x", messages=history, tools=TOOLS, temperature=0, max_tokens=40
                )
                .choices[0]
                .message.tool_calls[0]
                .function
            ),
            "stream": lambda c: "".join(
                ch.choices[0].delta.content or ""
                for ch in c.chat.completions.create(
                    model="x",
                    temperature=0,
                    max_tokens=32,
                    stream=True,
                    messages=[{"role": "user", "content": "Tell a short story about a fox."}],
                )
                if ch.choices
            ),
            "responses": lambda c: (
                c.responses.create(
                    model="x",
                    input="Name the day after Monday.",
                    max_output_tokens=16,
                    temperature=0,
                ).output_text
            ),
        }
        results, errors = {}, []

        def go(name, fn):
            try:
                results[name] = fn(client)
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        def anthro():
            try:
                results["anthropic"] = (
                    claude.messages.create(
                        model="x",
                        max_tokens=16,
                        extra_body={"temperature": 0},
                        messages=[{"role": "user", "content": "Name a colour."}],
                    )
                    .content[0]
                    .text
                )
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=go, args=kv) for kv in calls.items()] + [
            threading.Thread(target=anthro)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not errors, errors
        assert results["tool"].name == "get_weather" and json.loads(results["tool"].arguments) == {
            "city": "Berlin"
        }
        for name in ("stream", "responses"):
            assert results[name] == calls[name](serial), name
        assert (
            results["anthropic"]
            == ask(serial, "Name a colour.", max_tokens=16).choices[0].message.content
        )
        batch = httpx.get(f"{url}/stats").json()["batch"]
        assert (
            batch["batched"]
            and batch["peak_rows"] >= 2
            and batch["rows_served"] == 4
            and batch["active_rows"] == 0
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0


def test_structured_output_and_forced_tools_with_the_sdks(served):
    """On the base model: json_schema output that validates (the openai and anthropic SDKs'
    parse() too), a tool call forced where the model answers in text, through the openai,
    anthropic and Responses SDKs."""
    import anthropic
    import jsonschema
    import pydantic

    url, _, client = served
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
            "genres": {
                "type": "array",
                "items": {"enum": ["drama", "comedy", "sci-fi"]},
                "minItems": 1,
                "maxItems": 2,
            },
        },
        "required": ["name", "year", "genres"],
        "additionalProperties": False,
    }
    question = [{"role": "user", "content": "Describe a film you like."}]
    r = client.chat.completions.create(
        model="x",
        messages=question,
        temperature=0,
        max_tokens=64,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "film", "schema": schema, "strict": True},
        },
    )
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)

    class Film(pydantic.BaseModel):
        name: str
        year: int

    parsed = client.beta.chat.completions.parse(
        model="x", messages=question, temperature=0, max_tokens=64, response_format=Film
    )
    assert isinstance(parsed.choices[0].message.parsed, Film)
    # Unforced, the base model answers this in text; forced, it calls the tool with valid arguments.
    chitchat = [{"role": "user", "content": "Hello! How are you today?"}]
    free = client.chat.completions.create(
        model="x", messages=chitchat, tools=TOOLS, temperature=0, max_tokens=32
    )
    assert free.choices[0].finish_reason != "tool_calls"
    forced = client.chat.completions.create(
        model="x",
        messages=chitchat,
        tools=TOOLS,
        temperature=0,
        max_tokens=48,
        tool_choice="required",
    )
    call = forced.choices[0].message.tool_calls[0].function
    assert forced.choices[0].finish_reason == "tool_calls" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), TOOLS[0]["function"]["parameters"])
    claude = anthropic.Anthropic(base_url=url, api_key="sk-ant-anything", max_retries=0)
    tools = [
        {
            "name": "get_weather",
            "description": "Current weather for a city",
            "input_schema": TOOLS[0]["function"]["parameters"],
        }
    ]
    msg = claude.messages.create(
        model="x",
        max_tokens=48,
        extra_body={"temperature": 0},
        tools=tools,
        tool_choice={"type": "any"},
        messages=chitchat,
    )
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert (
        msg.stop_reason == "tool_use" and uses[0].name == "get_weather" and "city" in uses[0].input
    )
    film = claude.messages.parse(
        model="x",
        max_tokens=64,
        messages=question,
        output_format=Film,
        extra_body={"temperature": 0},
    )  # sent as output_config.format
    assert film.stop_reason == "end_turn" and isinstance(film.parsed_output, Film)
    resp = client.responses.create(
        model="x",
        input="Hello! How are you today?",
        max_output_tokens=48,
        temperature=0,
        tools=[
            {
                "type": "function",
                "name": "get_weather",
                "parameters": TOOLS[0]["function"]["parameters"],
            }
        ],
        tool_choice="required",
    )
    assert [i.type for i in resp.output] == ["function_call"] and resp.output[
        0
    ].name == "get_weather"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="x",
            messages=question,
            max_tokens=8,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "bad", "schema": {"type": "nonsense"}},
            },
        )
    assert e.value.body["param"] == "response_format.json_schema.schema"


def test_port_taken_and_sigterm_drain(served, real_model_dir):
    url, proc, _ = served
    port = int(url.rsplit(":", 1)[1])
    clash = subprocess.run(
        [sys.executable, "-m", "mlxlab", "serve", f"port={port}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (
        clash.returncode == 1
        and "cannot listen" in clash.stderr
        and "Traceback" not in clash.stderr
    )
    # A request in flight when SIGTERM arrives still completes; new requests get 503; exit 0.
    result = {}

    def long_request():
        try:
            r = httpx.post(
                url + "/v1/chat/completions",
                timeout=300,
                json={
                    "messages": [{"role": "user", "content": "Count from 1 to 100."}],
                    "max_tokens": 48,
                    "temperature": 0,
                },
            )
            result["status"], result["text"] = r.status_code, r.text
            result["body"] = r.json()
        except Exception as e:  # reported by the assertion below
            result["error"] = repr(e)

    t = threading.Thread(target=long_request)
    t.start()
    deadline = time.time() + 180  # the CPU may be shared: wait until the request is decoding
    while time.time() < deadline and not httpx.get(url + "/stats").json()["queue"]["running"]:
        time.sleep(0.05)
    assert httpx.get(url + "/stats").json()["queue"]["running"], "the request never started"
    # An exchange that keeps the drain waiting however fast the answer above is: a request whose
    # body has not all arrived (it holds no generation; its client sends the rest, or leaves,
    # after the probe). Without it, a fast machine finished the answer and exited before a
    # probe sent 0.3 s after the signal arrived: a refused connection, not a 503.
    # Its `Expect: 100-continue` makes the server say when the app has it (counted in flight).
    holder = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=60)
    holder.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nExpect: 100-continue\r\n"
        b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    )
    assert holder.recv(64).startswith(b"HTTP/1.1 100"), "the holding request was not read"
    proc.send_signal(signal.SIGTERM)
    deadline = time.time() + 30  # the drain is on once /health says so (it answers throughout)
    while time.time() < deadline and httpx.get(url + "/health").json()["status"] != "draining":
        time.sleep(0.02)
    refused = httpx.post(
        url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}
    )
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
    holder.close()
    t.join(300)
    assert "error" not in result, result
    assert result["status"] == 200 and result["body"]["choices"][0]["finish_reason"] in (
        "length",
        "stop",
    )
    assert proc.wait(60) == 0
