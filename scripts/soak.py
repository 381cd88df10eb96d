"""Soak the server: concurrent clients mixing the three protocols, streamed and not, with
disconnects, cancels, bad input and adapters, for a number of requests or minutes; then the
errors, latency percentiles and the server's memory at the start and the end.

    python scripts/soak.py [--url http://127.0.0.1:8090] [--clients 8] [--requests 400]
                           [--minutes M] [--max-tokens 24] [--adapter NAME ...] [--json FILE]
    python scripts/soak.py --model tiny-gemma3 --serve batch=4 prompt_cache_gb=0.1 ...

Without `--url` it starts `python -m mlxlab serve model=<--model> <--serve ...>` on a free port
and stops it (SIGTERM) at the end; its memory is the process's RSS (psutil). With `--url` the
server is yours (its RSS is read when `--pid` is given).

Each request is one scenario drawn at random (seeded): OpenAI chat (streamed or not, sometimes
with a tool), completions, Anthropic messages (streamed or not), Responses (streamed or not,
sometimes chained with previous_response_id), structured output on each protocol (a JSON schema:
the answer must parse and validate, or be a prefix of such an answer when max_tokens cut it),
a stream the client drops after two events (each protocol), a request the client gives up on
(a short read timeout), a request that is not streamed sent on a raw socket that is closed
without reading anything (each protocol: the server must stop it), bad input (malformed JSON,
an unknown adapter, a NaN: a 4xx is expected), and, when `--adapter` names mounted adapters,
requests on them (every protocol). An answer is checked for its protocol's shape (a stream must
end with its final event). An *unexpected error* is any other status, a malformed answer, or an
exception that is not the scenario's deliberate disconnect. Memory: RSS after a warm-up (the
first `--warmup` requests) and at the end, and the peak seen, next to the prompt cache's bytes
(/stats) at the same times, and, with `--minutes`, a sample a minute; RSS may grow by what the
cache fills, up to `prompt_cache_gb`, so `rss_mb.growth_since_cache_full` is the growth from the
first sample where the cache was (nearly) full to the end. The server's own counts (requests,
cancelled, completion tokens) are reported too: every abandoned request must have been
cancelled, not generated to its max_tokens. Exits 1 on any unexpected error or if the server
died.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent

TOOL = {
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
TOPICS = ("the sea", "a robot", "a garden", "a comet", "a library", "a storm", "a fox", "rain")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Unexpected(Exception):
    """An answer the scenario did not expect."""


def _sse_data(r: httpx.Response) -> list[str]:
    return [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]


def _sse_events(r: httpx.Response) -> list[str]:
    return [line[7:] for line in r.text.splitlines() if line.startswith("event: ")]


def _expect(r: httpx.Response, status: int = 200) -> httpx.Response:
    if r.status_code != status:
        raise Unexpected(f"status {r.status_code} (expected {status}): {r.text[:200]}")
    return r


@dataclass
class Scenario:
    """One kind of request: its name, weight, and a function (client, rng, ctx) -> None that
    raises Unexpected on a wrong answer."""

    name: str
    weight: float
    run: object


def _messages(rng: random.Random) -> list[dict]:
    return [{"role": "user", "content": f"Write one sentence about {rng.choice(TOPICS)}."}]


def _adapter(body: dict, rng: random.Random, ctx) -> dict:
    """`body` on a mounted adapter (or two stacked) 40% of the time, when there are some."""
    if ctx["adapters"] and rng.random() < 0.4:
        picked = rng.sample(ctx["adapters"], k=min(len(ctx["adapters"]), rng.choice((1, 2))))
        body["adapter"] = "+".join(picked)
    return body


def chat(c, rng, ctx):
    body = {"messages": _messages(rng), "max_tokens": ctx["max_tokens"]}
    if rng.random() < 0.3:
        body["tools"] = [TOOL]
    _adapter(body, rng, ctx)
    data = _expect(c.post("/v1/chat/completions", json=body)).json()
    choice = data["choices"][0]
    if choice["finish_reason"] not in ("stop", "length", "tool_calls"):
        raise Unexpected(f"finish_reason {choice['finish_reason']!r}")
    if "usage" not in data or choice["message"]["role"] != "assistant":
        raise Unexpected("chat body without usage or assistant message")


def chat_stream(c, rng, ctx):
    body = {"messages": _messages(rng), "max_tokens": ctx["max_tokens"], "stream": True}
    body["stream_options"] = {"include_usage": True}
    data = _sse_data(_expect(c.post("/v1/chat/completions", json=body)))
    if not data or data[-1] != "[DONE]":
        raise Unexpected("chat stream did not end with [DONE]")
    chunks = [json.loads(x) for x in data[:-1]]
    if any("error" in x for x in chunks) or "usage" not in chunks[-1]:
        raise Unexpected(f"chat stream: {data[-2][:200]}")


def completion(c, rng, ctx):
    body = {"prompt": f"Once upon a time, {rng.choice(TOPICS)}", "max_tokens": ctx["max_tokens"]}
    _adapter(body, rng, ctx)
    data = _expect(c.post("/v1/completions", json=body)).json()
    if "text" not in data["choices"][0]:
        raise Unexpected("completion without text")


def anthropic(c, rng, ctx):
    body = {"model": "x", "max_tokens": ctx["max_tokens"], "messages": _messages(rng)}
    _adapter(body, rng, ctx)
    stream = rng.random() < 0.5
    r = _expect(c.post("/v1/messages", json={**body, "stream": stream}))
    if stream:
        events = _sse_events(r)
        if not events or events[-1] != "message_stop" or "error" in events:
            raise Unexpected(f"anthropic stream ended with {events[-1:]}")
    elif r.json().get("type") != "message":
        raise Unexpected(f"anthropic body: {r.text[:200]}")


def responses(c, rng, ctx):
    body = {"model": "x", "input": _messages(rng), "max_output_tokens": ctx["max_tokens"]}
    _adapter(body, rng, ctx)
    previous = ctx.get("last_response")
    if previous and rng.random() < 0.3:
        body["previous_response_id"] = previous
    if rng.random() < 0.5:
        events = _sse_events(_expect(c.post("/v1/responses", json={**body, "stream": True})))
        if not events or events[-1] not in ("response.completed", "response.incomplete"):
            raise Unexpected(f"responses stream ended with {events[-1:]}")
        return
    data = _expect(c.post("/v1/responses", json=body)).json()
    if data.get("object") != "response" or data.get("status") not in ("completed", "incomplete"):
        raise Unexpected(f"responses body: {json.dumps(data)[:200]}")
    ctx["last_response"] = data["id"]


CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "rain": {"type": "boolean"},
        "days": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["city", "rain", "days"],
}


def _valid_prefix(text: str, finish: str) -> None:
    """A structured answer: JSON that validates, or (cut by max_tokens) a start of one."""
    if finish in ("length", "max_tokens", "incomplete"):
        if text and not text.lstrip().startswith("{"):
            raise Unexpected(f"a cut structured answer that does not start an object: {text!r}")
        return
    try:
        got = json.loads(text)
    except ValueError:
        raise Unexpected(f"structured answer is not JSON: {text[:200]!r}") from None
    if not isinstance(got, dict) or set(got) != set(CITY["required"]):
        raise Unexpected(f"structured answer does not fit its schema: {text[:200]!r}")
    if not isinstance(got["rain"], bool) or not 0 <= got["days"] <= 9:
        raise Unexpected(f"structured answer breaks its schema: {text[:200]!r}")


def structured(c, rng, ctx):
    """A JSON-schema answer on one of the protocols (chat, completions, Anthropic, Responses)."""
    ask = [
        {"role": "user", "content": f"The weather in a town near {rng.choice(TOPICS)}, as JSON."}
    ]
    n = max(ctx["max_tokens"], 48)
    kind = rng.choice(("chat", "completion", "anthropic", "responses"))
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
    if kind == "chat":
        body = _adapter({"messages": ask, "max_tokens": n, "response_format": fmt}, rng, ctx)
        choice = _expect(c.post("/v1/chat/completions", json=body)).json()["choices"][0]
        _valid_prefix(choice["message"]["content"] or "", choice["finish_reason"])
    elif kind == "completion":
        body = {"prompt": ask[0]["content"], "max_tokens": n, "response_format": fmt}
        choice = _expect(c.post("/v1/completions", json=_adapter(body, rng, ctx))).json()
        _valid_prefix(choice["choices"][0]["text"], choice["choices"][0]["finish_reason"])
    elif kind == "anthropic":
        body = {"model": "x", "max_tokens": n, "messages": ask}
        body["output_config"] = {"format": {"type": "json_schema", "schema": CITY}}
        data = _expect(c.post("/v1/messages", json=_adapter(body, rng, ctx))).json()
        text = "".join(b.get("text", "") for b in data["content"] if b["type"] == "text")
        _valid_prefix(text, data["stop_reason"])
    else:
        body = {"model": "x", "input": ask, "max_output_tokens": n}
        body["text"] = {"format": {"type": "json_schema", "name": "city", "schema": CITY}}
        data = _expect(c.post("/v1/responses", json=_adapter(body, rng, ctx))).json()
        text = "".join(
            p.get("text", "")
            for item in data["output"]
            if item["type"] == "message"
            for p in item["content"]
        )
        _valid_prefix(text, data["status"])


STREAMS = {  # a long streamed request on each protocol, and the line that marks an event
    "/v1/chat/completions": ({"messages": None, "max_tokens": 256, "stream": True}, "data: "),
    "/v1/messages": (
        {"model": "x", "messages": None, "max_tokens": 256, "stream": True},
        "event: ",
    ),
    "/v1/responses": (
        {"model": "x", "input": None, "max_output_tokens": 256, "stream": True},
        "event: ",
    ),
}


def disconnect(c, rng, ctx):
    """Open a long stream (any protocol), read two events, drop the connection."""
    path = rng.choice(list(STREAMS))
    template, mark = STREAMS[path]
    body = {k: (_messages(rng) if v is None else v) for k, v in template.items()}
    with c.stream("POST", path, json=body) as r:
        _expect(r)
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith(mark)
            if seen >= 2:
                break


ABANDONED = {  # a long answer that is not streamed, on each protocol
    "/v1/chat/completions": lambda m: {"messages": m, "max_tokens": 512},
    "/v1/completions": lambda m: {"prompt": m[0]["content"], "max_tokens": 512},
    "/v1/messages": lambda m: {"model": "x", "messages": m, "max_tokens": 512},
    "/v1/responses": lambda m: {"model": "x", "input": m, "max_output_tokens": 512},
}


def abandon(c, rng, ctx):
    """A request that is not streamed, on a raw (keep-alive) socket closed without reading a
    byte, at once or after a moment: the server must stop its answer (counted as cancelled)."""
    path = rng.choice(list(ABANDONED))
    ask = [{"role": "user", "content": f"Count from 1 to 500 about {rng.choice(TOPICS)}."}]
    body = json.dumps(ABANDONED[path](ask)).encode()
    url = httpx.URL(str(c.base_url))
    with socket.create_connection((url.host, url.port), timeout=30) as s:
        s.sendall(
            f"POST {path} HTTP/1.1\r\nHost: {url.host}:{url.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        time.sleep(rng.choice((0.0, 0.05, 0.3)))
    with ctx["lock"]:
        ctx["abandoned"][0] += 1


def give_up(c, rng, ctx):
    """A request whose client stops waiting (its read timeout) before the answer."""
    body = {"messages": _messages(rng), "max_tokens": 256}
    try:
        c.post("/v1/chat/completions", json=body, timeout=httpx.Timeout(30, read=0.2))
    except httpx.ReadTimeout:
        return
    # A fast server may answer in time: that is fine too.


def bad_input(c, rng, ctx):
    if rng.random() < 0.5:
        r = c.post(
            "/v1/chat/completions",
            content=b'{"messages": [',
            headers={"content-type": "application/json"},
        )
        _expect(r, 400)
    elif rng.random() < 0.5:
        r = c.post("/v1/chat/completions", json={"messages": _messages(rng), "adapter": "nope"})
        _expect(r, 400)
    else:
        r = c.post(
            "/v1/completions",
            content=b'{"prompt": "x", "temperature": NaN}',
            headers={"content-type": "application/json"},
        )
        _expect(r, 400)
    if "error" not in r.json():
        raise Unexpected(f"error body: {r.text[:200]}")


SCENARIOS = [
    Scenario("chat", 3, chat),
    Scenario("chat_stream", 2, chat_stream),
    Scenario("completion", 1, completion),
    Scenario("anthropic", 2, anthropic),
    Scenario("responses", 2, responses),
    Scenario("structured", 2, structured),
    Scenario("disconnect", 1, disconnect),
    Scenario("give_up", 0.5, give_up),
    Scenario("abandon", 1, abandon),
    Scenario("bad_input", 1, bad_input),
]


@dataclass
class Report:
    counts: dict = field(default_factory=dict)
    latencies: dict = field(default_factory=dict)
    errors: list = field(default_factory=list)
    rss_mb: dict = field(default_factory=dict)
    prompt_cache_mb: dict = field(default_factory=dict)  # its bytes (/stats) at the same times
    requests: int = 0
    seconds: float = 0.0
    alive: bool = True
    timeline: list = field(default_factory=list)  # (minute, RSS MB, prompt cache MB)
    server: dict = field(default_factory=dict)  # /stats' queue counts over the soak

    def summary(self) -> dict:
        every = sorted(x for v in self.latencies.values() for x in v)

        def pct(xs, q):
            return xs[min(int(q * len(xs)), len(xs) - 1)] if xs else None

        return {
            "requests": self.requests,
            "seconds": round(self.seconds, 1),
            "unexpected_errors": len(self.errors),
            "first_errors": self.errors[:10],
            "counts": self.counts,
            "p50_s": pct(every, 0.5),
            "p99_s": pct(every, 0.99),
            "per_scenario_p50_s": {
                k: round(statistics.median(v), 3) for k, v in self.latencies.items() if v
            },
            "rss_mb": self.rss_mb,
            "prompt_cache_mb": self.prompt_cache_mb,
            "timeline": self.timeline,
            "server": self.server,
            "server_alive": self.alive,
        }


def rss_mb(pid: int | None) -> float | None:
    if pid is None:
        return None
    import psutil

    try:
        return psutil.Process(pid).memory_info().rss / 1e6
    except psutil.Error:
        return None


def stats(url: str) -> dict:
    try:
        return httpx.get(url + "/stats", timeout=30).json()
    except (httpx.HTTPError, ValueError):
        return {}


def cache_mb(url: str) -> float | None:
    """The prompt cache's bytes as /stats reports them (it may grow up to prompt_cache_gb)."""
    try:
        return stats(url)["prompt_cache"]["bytes"] / 1e6
    except (KeyError, TypeError):
        return None


def cache_full(url: str) -> bool:
    """Whether the prompt cache holds (nearly) all it may (its bytes within 10% of its cap)."""
    cache = stats(url).get("prompt_cache") or {}
    cap = cache.get("max_bytes")
    return bool(cap) and cache.get("bytes", 0) >= 0.9 * cap


def soak(
    url: str,
    clients: int = 8,
    requests: int = 400,
    minutes: float | None = None,
    max_tokens: int = 24,
    adapters: tuple[str, ...] = (),
    pid: int | None = None,
    warmup: int = 40,
    seed: int = 0,
) -> Report:
    """Run the soak against `url`; `pid` is the server's process (for its RSS)."""
    report = Report()
    lock = threading.Lock()
    issued = 0
    deadline = time.monotonic() + 60 * minutes if minutes else None
    warm = threading.Event()
    peak = [0.0]

    def take() -> int | None:
        nonlocal issued
        with lock:
            if deadline is None and issued >= requests:
                return None
            if deadline is not None and time.monotonic() > deadline:
                return None
            issued += 1
            if issued == warmup + 1:
                warm.set()
            return issued

    abandoned = [0]

    def worker(k: int):
        rng = random.Random(seed * 1000 + k)
        ctx = {"max_tokens": max_tokens, "adapters": list(adapters)}
        ctx.update(lock=lock, abandoned=abandoned)
        with httpx.Client(base_url=url, timeout=300) as c:
            while take() is not None:
                sc = rng.choices(SCENARIOS, weights=[s.weight for s in SCENARIOS])[0]
                t0 = time.monotonic()
                try:
                    sc.run(c, rng, ctx)
                    ok = True
                except Unexpected as e:
                    ok, why = False, str(e)
                except Exception as e:  # noqa: BLE001 - every other failure is reported
                    ok, why = False, f"{type(e).__name__}: {e}"
                took = time.monotonic() - t0
                with lock:
                    report.requests += 1
                    report.counts[sc.name] = report.counts.get(sc.name, 0) + 1
                    if ok:
                        report.latencies.setdefault(sc.name, []).append(took)
                    else:
                        report.errors.append(f"{sc.name}: {why}")

    full_at: list = []  # (RSS MB) when the prompt cache was first seen full

    def sample_rss():
        last = time.monotonic()
        while not done.is_set():
            now = rss_mb(pid)
            if now is not None:
                peak[0] = max(peak[0], now)
                if not full_at and warm.is_set() and cache_full(url):
                    full_at.append((round((time.monotonic() - t0) / 60, 1), now))
            if minutes and time.monotonic() - last >= 60:
                last = time.monotonic()
                report.timeline.append(
                    (round((last - t0) / 60, 1), now and round(now, 1), cache_mb(url))
                )
            done.wait(0.5)

    before = stats(url).get("queue") or {}
    done = threading.Event()
    t0 = time.monotonic()
    sampler = threading.Thread(target=sample_rss, daemon=True)
    sampler.start()
    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(clients)]
    for t in threads:
        t.start()
    warm.wait(timeout=None if deadline is None else max(deadline - time.monotonic(), 0))
    report.rss_mb["after_warmup"] = rss_mb(pid)
    report.prompt_cache_mb["after_warmup"] = cache_mb(url)
    for t in threads:
        t.join()
    report.seconds = time.monotonic() - t0
    settle = time.monotonic() + 120  # let the server settle (abandoned answers end, caches trim)
    while time.monotonic() < settle:
        queue = stats(url).get("queue") or {}
        if not queue.get("running") and not queue.get("queued"):
            break
        time.sleep(0.5)
    time.sleep(1.0)
    after = stats(url).get("queue") or {}
    report.server = {
        k: after.get(k, 0) - before.get(k, 0)
        for k in ("requests", "completed", "cancelled", "failed", "completion_tokens")
    }
    report.server["abandoned_by_clients"] = abandoned[0]
    report.rss_mb["end"] = rss_mb(pid)
    report.prompt_cache_mb["end"] = cache_mb(url)
    done.set()
    report.rss_mb["peak"] = peak[0] or None
    start, end = report.rss_mb["after_warmup"], report.rss_mb["end"]
    report.rss_mb["growth"] = end - start if start is not None and end is not None else None
    if full_at and end is not None:
        report.rss_mb["cache_full_at_minute"], full = full_at[0]
        report.rss_mb["growth_since_cache_full"] = end - full
    try:
        report.alive = httpx.get(url + "/health", timeout=30).status_code == 200
    except httpx.HTTPError:
        report.alive = False
    return report


def start_server(model: str, serve_args: list[str], port: int, env=None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "mlxlab", "serve", f"model={model}", f"port={port}", *serve_args]
    # Its log goes to a file: a pipe nobody reads would fill and block the server's logging.
    log = tempfile.NamedTemporaryFile("w+", prefix="mlxlab-soak-", suffix=".log", delete=False)
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=log, text=True, env=env
    )
    proc.log_path = log.name
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            tail = Path(log.name).read_text()[-2000:]
            raise SystemExit(f"server failed: {' '.join(cmd)}\n{tail}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("server did not become ready")


def stop_server(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
        return -9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", help="a running server (default: start one)")
    ap.add_argument("--pid", type=int, help="the running server's process id, for its RSS")
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--serve", nargs="*", default=["batch=4"], help="serve overrides")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--minutes", type=float, help="run for this long instead of --requests")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--adapter", action="append", default=[], help="a mounted adapter's id")
    ap.add_argument("--warmup", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the report here")
    args = ap.parse_args()
    proc = None
    url, pid = args.url, args.pid
    if url is None:
        port = free_port()
        proc = start_server(args.model, args.serve, port, env=os.environ.copy())
        url, pid = f"http://127.0.0.1:{port}", proc.pid
    try:
        report = soak(
            url.rstrip("/"),
            args.clients,
            args.requests,
            args.minutes,
            args.max_tokens,
            tuple(args.adapter),
            pid,
            args.warmup,
            args.seed,
        )
    finally:
        exit_code = stop_server(proc) if proc is not None else None
    out = report.summary()
    out["server_exit_code"] = exit_code
    text = json.dumps(out, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    sys.exit(1 if out["unexpected_errors"] or not out["server_alive"] else 0)


if __name__ == "__main__":
    main()
