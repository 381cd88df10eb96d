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
sometimes chained with previous_response_id), a stream the client drops after two events, a
request the client gives up on (a short read timeout), bad input (malformed JSON, an unknown
adapter: a 4xx is expected), and, when `--adapter` names mounted adapters, requests on them. An
answer is checked for its protocol's shape (a stream must end with its final event). An
*unexpected error* is any other status, a malformed answer, or an exception that is not the
scenario's deliberate disconnect. Memory: RSS after a warm-up (the first `--warmup` requests)
and at the end, and the peak seen, next to the prompt cache's bytes (/stats) at the same times:
RSS may grow by what the cache fills, up to `prompt_cache_gb`. Exits 1 on any unexpected error or if the server died.
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


def chat(c, rng, ctx):
    body = {"messages": _messages(rng), "max_tokens": ctx["max_tokens"]}
    if rng.random() < 0.3:
        body["tools"] = [TOOL]
    if ctx["adapters"] and rng.random() < 0.4:
        body["adapter"] = rng.choice(ctx["adapters"])
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
    data = _expect(c.post("/v1/completions", json=body)).json()
    if "text" not in data["choices"][0]:
        raise Unexpected("completion without text")


def anthropic(c, rng, ctx):
    body = {"model": "x", "max_tokens": ctx["max_tokens"], "messages": _messages(rng)}
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


def disconnect(c, rng, ctx):
    """Open a long stream, read two events, drop the connection."""
    body = {"messages": _messages(rng), "max_tokens": 256, "stream": True}
    with c.stream("POST", "/v1/chat/completions", json=body) as r:
        _expect(r)
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen >= 2:
                break


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
    else:
        r = c.post("/v1/chat/completions", json={"messages": _messages(rng), "adapter": "nope"})
        _expect(r, 400)
    if "error" not in r.json():
        raise Unexpected(f"error body: {r.text[:200]}")


SCENARIOS = [
    Scenario("chat", 3, chat),
    Scenario("chat_stream", 2, chat_stream),
    Scenario("completion", 1, completion),
    Scenario("anthropic", 2, anthropic),
    Scenario("responses", 2, responses),
    Scenario("disconnect", 1, disconnect),
    Scenario("give_up", 0.5, give_up),
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


def cache_mb(url: str) -> float | None:
    """The prompt cache's bytes as /stats reports them (it may grow up to prompt_cache_gb)."""
    try:
        return httpx.get(url + "/stats", timeout=30).json()["prompt_cache"]["bytes"] / 1e6
    except (httpx.HTTPError, KeyError, ValueError):
        return None


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

    def worker(k: int):
        rng = random.Random(seed * 1000 + k)
        ctx = {"max_tokens": max_tokens, "adapters": list(adapters)}
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

    def sample_rss():
        while not done.is_set():
            now = rss_mb(pid)
            if now is not None:
                peak[0] = max(peak[0], now)
            done.wait(0.5)

    done = threading.Event()
    sampler = threading.Thread(target=sample_rss, daemon=True)
    sampler.start()
    t0 = time.monotonic()
    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(clients)]
    for t in threads:
        t.start()
    warm.wait(timeout=None if deadline is None else max(deadline - time.monotonic(), 0))
    report.rss_mb["after_warmup"] = rss_mb(pid)
    report.prompt_cache_mb["after_warmup"] = cache_mb(url)
    for t in threads:
        t.join()
    report.seconds = time.monotonic() - t0
    time.sleep(1.0)  # let the server settle (cancelled rows end, caches trim)
    report.rss_mb["end"] = rss_mb(pid)
    report.prompt_cache_mb["end"] = cache_mb(url)
    done.set()
    report.rss_mb["peak"] = peak[0] or None
    start, end = report.rss_mb["after_warmup"], report.rss_mb["end"]
    report.rss_mb["growth"] = end - start if start is not None and end is not None else None
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
