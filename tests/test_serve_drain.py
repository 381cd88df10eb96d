"""The SIGTERM drain on a real uvicorn server (tiny-gemma3, in-process): every response in flight,
streamed or not, reaches its slow client in full before the server exits; new requests get 503."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import threading
import time

import httpx
import pytest

from mlxlab.serve import answer
from tests.helpers.serve import start_server

pytestmark = pytest.mark.slow  # a real server and slow clients: ~15 s

MAX_TOKENS = 160


class SlowClient(threading.Thread):
    """Sends one request over a raw socket with a small receive buffer, then reads the answer a
    few KB at a time with pauses, until the server closes the connection."""

    def __init__(self, port: int, path: str, body: dict, pause_s: float = 0.04):
        super().__init__(daemon=True)
        self.port, self.path, self.body, self.pause_s = port, path, body, pause_s
        self.raw = b""
        self.first_byte = threading.Event()

    def run(self):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", self.port))
        payload = json.dumps(self.body).encode()
        s.sendall(
            f"POST {self.path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode()
            + payload
        )
        s.settimeout(120)
        while chunk := s.recv(4096):
            self.raw += chunk
            self.first_byte.set()
            time.sleep(self.pause_s)
        s.close()
        self.first_byte.set()

    def body_text(self) -> str:
        head, _, body = self.raw.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head[:200]
        if b"transfer-encoding: chunked" in head.lower():  # de-chunk
            out, rest = b"", body
            while rest:
                size, _, rest = rest.partition(b"\r\n")
                n = int(size, 16)
                if n == 0:
                    break
                out, rest = out + rest[:n], rest[n + 2 :]
            body = out
        return body.decode()


def test_drain_waits_for_every_answer_to_reach_its_slow_client(tiny_dir, monkeypatch):
    """Two streams read slowly, and one answer that is not streamed and is written 6 s after its
    generation ended (an event loop under load): the drain outlasts uvicorn's 5 s grace period,
    which the engine's queue alone (empty long before) would not."""
    tiny_dir("gemma3")
    collect = answer.collect

    async def late_collect(*args, **kwargs):
        got = await collect(*args, **kwargs)
        await asyncio.sleep(6)
        return got

    monkeypatch.setattr(answer, "collect", late_collect)
    port, gateway, server, thread = start_server(drain_timeout_s=90)
    try:
        # Large answers (20 top logprobs per token), no early end of sequence.
        no_eos = {str(t): -100 for t in gateway.loaded.eos}
        base = {
            "prompt": "def f(x):",
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "logprobs": 20,
            "logit_bias": no_eos,
        }
        chat = {
            "messages": [{"role": "user", "content": "Count."}],
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 20,
            "logit_bias": no_eos,
        }
        clients = [
            SlowClient(port, "/v1/completions", {**base, "stream": True}),
            SlowClient(port, "/v1/chat/completions", {**chat, "stream": True}),
            SlowClient(port, "/v1/completions", base),
        ]
        for c in clients:
            c.start()
        assert clients[0].first_byte.wait(60) and clients[1].first_byte.wait(60)
        deadline = time.time() + 30
        while gateway.counters["requests"] < 3 and time.time() < deadline:  # all three are in
            time.sleep(0.02)
        server.handle_exit(signal.SIGTERM, None)  # what uvicorn's signal handler calls
        refused = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "x"}, timeout=10
        )
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
        assert (
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).json()["status"] == "draining"
        )
        for c in clients:
            c.join(120)
        thread.join(60)
        assert not thread.is_alive() and server.drained.is_set()
        for c in clients[:2]:
            lines = [x for x in c.body_text().split("\n\n") if x.strip()]
            assert lines[-1] == "data: [DONE]", lines[-1][:200]
            finish = [
                json.loads(x[6:])["choices"][0]["finish_reason"]
                for x in lines[:-1]
                if json.loads(x[6:])["choices"]
            ]
            assert finish[-1] == "length"
        whole = json.loads(clients[2].body_text())
        assert whole["usage"]["completion_tokens"] == MAX_TOKENS
        assert len(whole["choices"][0]["logprobs"]["tokens"]) == MAX_TOKENS
        assert sum(len(c.raw) for c in clients) > 300_000  # far more than the sockets buffer
    finally:
        server.should_exit = True
        thread.join(30)
        gateway.stop()


def test_answers_unfinished_at_the_drain_timeout_are_aborted_with_a_503(tiny_dir):
    """A drain timeout shorter than the answers: each client is told the server is shutting
    down, in its protocol's shape (a 503 before a response started, a stream's error event
    after), instead of uvicorn cancelling the handler (a plain-text 500)."""
    tiny_dir("gemma3")
    port, gateway, server, thread = start_server(drain_timeout_s=0.2, batch=2)
    url = f"http://127.0.0.1:{port}"
    try:
        no_eos = {str(t): -100 for t in gateway.loaded.eos}
        chat = {
            "messages": [{"role": "user", "content": "Count."}],
            "max_tokens": 2000,
            "temperature": 0,
            "logit_bias": no_eos,
        }
        got: dict = {}
        streaming = threading.Event()

        def post(name, path, body):
            got[name] = httpx.post(url + path, json=body, timeout=120)

        def stream():  # started first, so it holds a row and has streamed before the signal
            with httpx.stream(
                "POST", url + "/v1/chat/completions", json={**chat, "stream": True}, timeout=120
            ) as r:
                text = ""
                for piece in r.iter_text():
                    text += piece
                    streaming.set()
                got["stream"] = (r.status_code, text)
            streaming.set()

        first = threading.Thread(target=stream)
        first.start()
        assert streaming.wait(60)
        threads = [
            first,
            threading.Thread(target=post, args=("chat", "/v1/chat/completions", chat)),
            threading.Thread(
                target=post,
                args=(
                    "anthropic",
                    "/v1/messages",
                    {"model": "x", "max_tokens": 2000, "messages": chat["messages"]},
                ),
            ),
        ]
        # The chat takes the second row; the Anthropic message (which cannot ban end of
        # sequence) waits for a row, so it is still queued when the drain runs out.
        threads[1].start()
        deadline = time.time() + 60
        while gateway.stats()["running"] < 2 and time.time() < deadline:
            time.sleep(0.02)
        threads[2].start()
        while gateway.counters["requests"] < 3 and time.time() < deadline:
            time.sleep(0.02)
        server.handle_exit(signal.SIGTERM, None)
        for t in threads:
            t.join(120)
        thread.join(60)
        assert not thread.is_alive() and server.drained.is_set()
        chat_r = got["chat"]
        assert chat_r.status_code == 503, chat_r.text[:300]
        error = chat_r.json()["error"]
        assert error["code"] == "shutting_down" and "drain timeout" in error["message"]
        # The queued one: overloaded (529, as Anthropic's API answers a 503).
        anthropic_r = got["anthropic"]
        assert anthropic_r.status_code == 529, anthropic_r.text[:300]
        assert anthropic_r.json()["error"]["type"] == "overloaded_error"
        status, text = got["stream"]
        assert status == 200
        events = [x[6:] for x in text.split("\n\n") if x.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "shutting_down"
        assert gateway.pending == 0
    finally:
        server.should_exit = True
        thread.join(30)
        gateway.stop()


def test_after_the_drain_timeout_a_request_still_being_prepared_is_refused(tiny_dir):
    """One that reached the engine after abort_all (it was rendering, or reading its body)
    gets the same 503 instead of starting a generation uvicorn would then cut."""
    from tests.helpers.serve import make_client

    tiny_dir("gemma3")
    client, gateway = make_client()
    try:
        assert gateway.abort_all("the server is shutting down (test)") == 0
        for path, body in (
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
            (
                "/v1/messages",
                {"model": "x", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]},
            ),
        ):
            r = client.post(path, json=body)
            assert r.status_code in (503, 529) and "shutting down" in r.text, r.text
        assert (
            client.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "Hi"}], "stream": True},
            ).status_code
            == 503
        )
    finally:
        gateway.stop()
