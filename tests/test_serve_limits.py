"""Request limits: body size (413) and read deadlines (408, dropped connections) before any
router runs, per-request ceilings (400 naming the limit), and prompt rendering off the event loop
so one large request does not stall the others."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

from tests.helpers.serve import make_client, start_server

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
TOOL = {
    "type": "function",
    "function": {"name": "f", "parameters": {"type": "object", "properties": {}}},
}


@pytest.fixture(scope="module")
def small(tiny_dir):
    """A server whose body cap is 2 KB and whose ceilings are small."""
    tiny_dir("gemma3")
    client, gateway = make_client(max_body_mb=0.002, max_messages=3, max_tools=2, max_tools_kb=1)
    yield client
    gateway.stop()


def test_a_body_over_the_cap_is_a_413_in_each_protocol_shape(small):
    big = "x" * 3000
    r = small.post(
        "/v1/chat/completions", json={**CHAT, "messages": [{"role": "user", "content": big}]}
    )
    assert r.status_code == 413 and r.headers["connection"] == "close"
    err = r.json()["error"]
    assert err["code"] == "request_too_large" and "serve.max_body_mb" in err["message"]
    r = small.post(
        "/v1/messages",
        json={"model": "x", "max_tokens": 2, "messages": [{"role": "user", "content": big}]},
    )
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    # Far over the cap by its Content-Length: refused without reading it.
    r = small.post(
        "/v1/chat/completions",
        content=b"{" + b" " * 20_000 + b"}",
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 413
    # No Content-Length (chunked): counted as it arrives.
    chunks = (b" " * 1000 for _ in range(5))
    r = small.post(
        "/v1/chat/completions", content=chunks, headers={"content-type": "application/json"}
    )
    assert r.status_code == 413
    # Under the cap, everything works as before.
    assert small.post("/v1/chat/completions", json=CHAT).status_code == 200


def test_per_request_ceilings_are_400s_naming_the_limit(small):
    four = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}] * 2
    r = small.post("/v1/chat/completions", json={**CHAT, "messages": four})
    err = r.json()["error"]
    assert (
        r.status_code == 400 and err["code"] == "too_many_messages" and err["param"] == "messages"
    )
    assert "serve.max_messages (3)" in err["message"]
    r = small.post("/v1/responses", json={"model": "x", "input": four, "max_output_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    r = small.post("/v1/messages", json={"model": "x", "max_tokens": 2, "messages": four})
    assert r.status_code == 400 and "max_messages" in r.json()["error"]["message"]
    r = small.post("/v1/chat/completions", json={**CHAT, "tools": [TOOL, TOOL, TOOL]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_tools"
    described = {**TOOL, "function": {**TOOL["function"], "description": "d" * 1200}}
    r = small.post("/v1/chat/completions", json={**CHAT, "tools": [described]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "tools_too_large"
    assert small.post("/v1/chat/completions", json={**CHAT, "tools": [TOOL]}).status_code == 200
    # The ceilings come before any tool schema is compiled (each compile costs time).
    bad = {**TOOL, "function": {"name": "g", "parameters": {"type": 12}}}
    r = small.post("/v1/chat/completions", json={**CHAT, "tools": [bad, bad, bad]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_tools"
    r = small.post("/v1/chat/completions", json={**CHAT, "tools": [bad]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_schema"
    # Counting tokens is held to the same ceilings.
    r = small.post("/v1/messages/count_tokens", json={"model": "x", "messages": four})
    assert r.status_code == 400 and "max_messages" in r.json()["error"]["message"]


@pytest.fixture(scope="module")
def server(tiny_dir):
    """A real uvicorn server with a 1 s read deadline and a 4 MB body cap."""
    tiny_dir("gemma3")
    port, gateway, srv, thread = start_server(read_timeout_s=1, max_body_mb=4)
    yield port, gateway
    srv.should_exit = True
    thread.join(30)
    gateway.stop()


def _closed_within(sock: socket.socket, seconds: float) -> tuple[bool, bytes]:
    """Whether the server closed `sock` within `seconds`, and what it sent before."""
    sock.settimeout(seconds)
    got = b""
    try:
        while chunk := sock.recv(4096):
            got += chunk
        return True, got
    except TimeoutError:
        return False, got
    except ConnectionResetError:
        return True, got


@pytest.mark.slow
def test_stalled_headers_and_trickled_bodies_are_dropped_while_others_are_served(server):
    port, _ = server
    url = f"http://127.0.0.1:{port}"
    slowloris = socket.create_connection(("127.0.0.1", port))
    slowloris.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n")  # no end
    trickle = socket.create_connection(("127.0.0.1", port))
    trickle.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
        b'Content-Type: application/json\r\nContent-Length: 500\r\n\r\n{"messages": '
    )
    # Meanwhile an ordinary client is served.
    assert httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=30).status_code == 200
    closed, sent = _closed_within(slowloris, 10)
    assert closed and sent == b""
    closed, sent = _closed_within(trickle, 10)
    assert closed and sent.startswith(b"HTTP/1.1 408")
    assert b"serve.read_timeout_s" in sent
    # A keep-alive connection that, after one answer, stalls its next request head is dropped.
    idle = socket.create_connection(("127.0.0.1", port))
    idle.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
    idle.settimeout(10)
    first = idle.recv(65536)
    assert first.startswith(b"HTTP/1.1 200")
    idle.sendall(b"GET /health HTTP/1.1\r\nHost: loc")  # and no more
    closed, _ = _closed_within(idle, 10)
    assert closed
    idle.close()
    slowloris.close()
    trickle.close()


@pytest.mark.slow
def test_health_answers_while_a_large_prompt_and_a_huge_body_are_refused(server):
    """A 3 MB prompt (far past the context whatever its tokens) is refused before it is
    tokenized (`pipeline.check_length`: it once held the render thread for seconds), a 20 MB
    body by its Content-Length mid-upload; /health answers quickly all the while."""
    port, _ = server
    url = f"http://127.0.0.1:{port}"
    words = " ".join(f"w{i}" for i in range(400_000))  # ~3 MB
    done: dict = {}

    def large():
        big = {"messages": [{"role": "user", "content": words}], "max_tokens": 1}
        done["large"] = httpx.post(url + "/v1/chat/completions", json=big, timeout=120)

    def huge():  # 20 MB against the 4 MB cap: refused by its Content-Length, mid-upload
        body = b'{"messages": "' + b"x" * 20_000_000 + b'"}'
        try:
            done["huge"] = httpx.post(
                url + "/v1/chat/completions",
                content=body,
                headers={"content-type": "application/json"},
                timeout=120,
            ).status_code
        except httpx.TransportError:  # the connection closed while the client still sent
            done["huge"] = "closed"

    threads = [threading.Thread(target=large), threading.Thread(target=huge)]
    for t in threads:
        t.start()
    latencies = []
    while (any(t.is_alive() for t in threads) or len(latencies) < 3) and len(latencies) < 20:
        t0 = time.monotonic()
        assert httpx.get(url + "/health", timeout=30).status_code == 200
        latencies.append(time.monotonic() - t0)
        time.sleep(0.1)
    for t in threads:
        t.join(120)
    assert done["huge"] in (413, "closed")
    refused = done["large"]
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_over_budget"
    assert "characters are more than" in refused.json()["error"]["message"]  # not tokenized
    assert max(latencies) < 2.0, latencies  # the event loop never waited


def test_a_body_announced_over_the_cap_with_expect_100_continue_is_never_asked_for():
    """The client waits for '100 Continue' before sending: refusing at once costs it nothing,
    while reading (which makes the server send 100 Continue) would upload the body for nothing."""
    import asyncio

    from mlxlab.serve.http import BodyLimit
    from mlxlab.serve.openai.protocol import error_shape

    async def app(scope, receive, send):  # never reached
        raise AssertionError("the app ran")

    async def receive():
        raise AssertionError("the body was asked for")

    sent = []

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions",
        "headers": [(b"content-length", b"2000"), (b"expect", b"100-continue")],
    }
    limit = BodyLimit(app, max_bytes=1000, timeout_s=5, shape_for=lambda path: error_shape)
    asyncio.run(limit(scope, receive, send))
    assert sent[0]["status"] == 413
