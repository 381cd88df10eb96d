"""Serving test helpers: an in-process server on a tiny model, SSE parsing, random adapters."""

from __future__ import annotations

import json
import socket
import threading
import time

from fastapi.testclient import TestClient

from mlxlab.config import LoraConfig
from mlxlab.serve.app import create_app
from mlxlab.serve.cli import DrainingServer, uvicorn_config
from mlxlab.serve.config import ServeConfig
from mlxlab.serve.engine.gateway import Gateway

SYSTEM = (
    "You are a careful assistant. You answer questions about the Python standard library "
    "precisely, with one short example, and you never invent module names or functions."
)


BASE_URL = "http://localhost"
"""The TestClient's base URL: a loopback Host, which the server (bound to loopback) accepts."""


def make_client(gateway: Gateway | None = None, **overrides) -> tuple[TestClient, Gateway]:
    """A started gateway (tiny-gemma3 unless overridden) and a TestClient over its app; with
    `gateway`, a new app over that one (the overrides then set the HTTP side only: keys, hosts)."""
    cfg = ServeConfig(**{"model": "tiny-gemma3", "memory_budget_gb": 2, **overrides})
    if gateway is None:
        gateway = Gateway(cfg.engine()).start()
        assert gateway.ready.wait(120) and gateway.state == "ready", gateway.error
    return TestClient(create_app(cfg, gateway), base_url=BASE_URL), gateway


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(**overrides) -> tuple[int, Gateway, DrainingServer, threading.Thread]:
    """A real uvicorn server, as `serve` configures it, on tiny-gemma3 (unless overridden), on a
    free loopback port, in a thread; stop it with `server.should_exit = True`."""
    port = free_port()
    cfg = ServeConfig(
        **{
            "model": "tiny-gemma3",
            "memory_budget_gb": 2,
            "port": port,
            "prompt_cache_gb": 0,
            **overrides,
        }
    )
    gateway = Gateway(cfg.engine()).start()
    assert gateway.ready.wait(120) and gateway.state == "ready", gateway.error
    app = create_app(cfg, gateway)
    server = DrainingServer(uvicorn_config(cfg, app), app, gateway, cfg.drain_timeout_s)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started and time.time() < deadline:
        time.sleep(0.05)
    return port, gateway, server, thread


def sse_events(text: str) -> list:
    """The JSON payloads of an OpenAI stream, which must end with [DONE]."""
    lines = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def streamed_content(events) -> str:
    return "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])


def named_events(text: str) -> list[tuple[str, dict]]:
    """(event name, payload) pairs of an Anthropic or Responses stream."""
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        out.append((lines["event"], json.loads(lines["data"])))
    return out


def make_adapter(model_dir, out, seed: int, targets=("q", "v"), layers=2, rank=4):
    """A LoRA adapter with random (non-zero) A and B, saved in mlx-lm's layout."""
    import mlx.core as mx
    from mlx_lm.utils import load

    from mlxlab.lora import apply as lora_apply
    from mlxlab.lora import io as lora_io

    model, _ = load(str(model_dir))
    plan = lora_apply.plan(
        model, LoraConfig(targets=list(targets), layers=layers, rank=rank, scale=2.0)
    )
    lora_apply.apply(model, plan, seed=seed)
    mx.random.seed(seed + 100)
    for _, m in lora_apply.lora_modules(model):
        m.lora_b = mx.random.normal(m.lora_b.shape) * 0.5
    return lora_io.save(model, plan, out)
