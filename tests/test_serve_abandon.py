"""A client that gives up on an answer that is not streamed: it sends its request on a raw
socket and closes the socket without reading anything. The engine must stop that generation at
once (a decode step, or a prefill chunk), on every protocol and both lanes, so the next request
is served as on an idle server; the abandoned jobs are counted as cancelled in /stats and
/metrics. (It used to run to max_tokens: the routers polled `request.is_disconnected()` only
when no event had come for 0.25 s, and a generation sends one every few milliseconds.)"""

from __future__ import annotations

import json
import socket
import statistics
import time

import httpx
import pytest

from mlxlab.serve.engine.jobs import Job
from mlxlab.serve.engine.serial import SerialLane
from tests.helpers.serve import make_client, start_server

MAX_TOKENS = 1900  # tiny-gemma3's context is 2048
# A string of at least 4000 characters: the grammar keeps the end of turn away, so an answer
# that is not stopped runs to MAX_TOKENS (seconds), whatever the random tiny model prefers.
LONG = {
    "type": "object",
    "properties": {"a": {"type": "string", "minLength": 4000}},
    "required": ["a"],
}
USER = [{"role": "user", "content": "Write it."}]
BODIES = {
    "/v1/chat/completions": {
        "messages": USER,
        "max_tokens": MAX_TOKENS,
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": LONG}},
    },
    "/v1/completions": {
        "prompt": "Write it.",
        "max_tokens": MAX_TOKENS,
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": LONG}},
    },
    "/v1/messages": {
        "model": "any",
        "messages": USER,
        "max_tokens": MAX_TOKENS,
        "output_config": {"format": {"type": "json_schema", "schema": LONG}},
    },
    "/v1/responses": {
        "input": "Write it.",
        "max_output_tokens": MAX_TOKENS,
        "text": {"format": {"type": "json_schema", "name": "a", "schema": LONG}},
    },
}
# The request timed after the abandonment: a prompt of some 700 tokens, so its time to first
# token is mostly prefill, not the noise of a shared machine.
PROBE = " ".join(f"w{i % 50}" for i in range(250))
RATIO = 3.0  # the probe after an abandonment, against the same probe on the idle server


@pytest.fixture(scope="module", params=[1, 2], ids=["serial", "batch2"])
def server(request, tiny_dir):
    tiny_dir("gemma3")
    port, gateway, srv, thread = start_server(batch=request.param, max_tokens=MAX_TOKENS)
    yield f"http://127.0.0.1:{port}", request.param
    srv.should_exit = True
    thread.join(30)
    gateway.stop()


def ttft(url: str) -> float:
    """Seconds to the first content of a streamed chat answer to PROBE (read to its end)."""
    body = {
        "messages": [{"role": "user", "content": PROBE}],
        "max_tokens": 2,
        "temperature": 0,
        "stream": True,
    }
    t0, first = time.perf_counter(), None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():  # read to the end: the probe is not a cancelled job
            if first is None and '"content"' in line:
                first = time.perf_counter() - t0
    assert first is not None, "no content"
    return first


def abandon(port: int, path: str) -> socket.socket:
    """Send a request that is not streamed on a raw HTTP/1.1 (keep-alive) socket; read nothing."""
    body = json.dumps({**BODIES[path], "temperature": 0}).encode()
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(
        f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    return s


def queue(url: str) -> dict:
    return httpx.get(url + "/stats").json()["queue"]


def cancelled_metric(url: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith('mlxlab_jobs_finished_total{outcome="cancelled"}'):
            return float(line.split()[-1])
    raise AssertionError("no cancelled count in /metrics")


def abandoned_then_probed(url: str, path: str, rows: int) -> tuple[float, float]:
    """(the probe's time to first token on the idle server, the same right after `rows`
    requests, as many as the engine runs at once, were sent and their sockets closed while
    their answers were being generated)."""
    port = int(url.rsplit(":", 1)[1])
    idle = statistics.median(ttft(url) for _ in range(3))
    sockets = [abandon(port, path) for _ in range(rows)]
    deadline = time.time() + 60
    while queue(url)["running"] < rows:
        assert time.time() < deadline, "the abandoned requests did not start"
        time.sleep(0.02)
    time.sleep(0.3)  # well into their answers
    for s in sockets:
        s.close()  # gone without reading a byte
    return idle, ttft(url)


def settle(url: str) -> dict:
    deadline = time.time() + 120
    while (q := queue(url))["running"] or q["queued"]:
        assert time.time() < deadline
        time.sleep(0.05)
    return q


@pytest.mark.parametrize("path", list(BODIES))
def test_an_abandoned_answer_stops_and_the_next_request_does_not_wait(server, path):
    url, rows = server
    before, metric = settle(url), cancelled_metric(url)
    # Best of three tries: a shared machine's noise can slow one probe several-fold; an answer
    # that is not stopped (seconds of decoding against a probe of a fraction of one) fails each.
    tries = []
    for _ in range(3):
        idle, after = abandoned_then_probed(url, path, rows)
        tries.append(f"{after:.2f} s after the abandonment, {idle:.2f} s idle")
        if after < RATIO * idle:
            break
    else:
        raise AssertionError("; ".join(tries))
    now = settle(url)
    abandoned = rows * len(tries)
    assert now["cancelled"] - before["cancelled"] == abandoned
    assert cancelled_metric(url) - metric == abandoned
    # the abandoned answers stopped far short of MAX_TOKENS each
    assert now["completion_tokens"] - before["completion_tokens"] < abandoned * MAX_TOKENS / 4


def test_the_serial_lane_checks_for_cancellation_before_its_prefill(tiny_dir):
    """A job whose client is gone before its prompt is read runs no prefill chunk and no token
    (it used to prefill the whole prompt, store its checkpoint and sample one token)."""
    tiny_dir("gemma3")
    client, gateway = make_client(prefill_step=16)
    try:
        m = gateway.loaded
        lane = SerialLane(m, gateway.cfg)
        events = []
        job = Job(prompt=[2] + [7] * 200, max_tokens=4, sink=events.append)
        job.cancelled.set()
        inserts = m.cache.inserts
        done = lane.run(job)
        assert done.finish_reason == "cancelled" and done.completion_tokens == 0
        assert m.cache.inserts == inserts  # no checkpoint: nothing was prefilled
        assert events == []  # the Done is the gateway's to send, once it has counted the job
    finally:
        gateway.stop()
