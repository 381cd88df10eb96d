"""`python -m mlxlab serve`: the HTTP server.

    python -m mlxlab serve                                  # gemma3-270m on http://127.0.0.1:8090
    python -m mlxlab serve model=tiny-qwen3 port=8091 memory_budget_gb=4 prompt_cache_gb=1

The keys (serve.api_key, api_key_file, MLXLAB_API_KEY, admin_key) are read first: a key file that
is missing or holds no key is a one-line error; bound to a non-loopback host without a key, or
with cors_origins=[*] and no key, the server warns. The port is checked before anything loads; the model loads on the engine thread while /health
answers 503; a ready line (URL, model, context ceiling, cache) is logged once it can serve.
Ctrl-C or SIGTERM drains: new requests get 503; the server exits 0 once every request in flight
has been answered in full (each response's last byte handed to its socket) or its client has
gone, or after `drain_timeout_s`; a second signal exits at once. Request heads must arrive
within `read_timeout_s` (`HeaderTimeout`), and at most `max_connections` are served at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
import threading
import time

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from mlxlab.cli import run_hydra
from mlxlab.errors import UserError
from mlxlab.serve.app import create_app
from mlxlab.serve.config import ServeConfig
from mlxlab.serve.engine.gateway import Gateway
from mlxlab.serve.guard import Keys, is_loopback, load_keys

log = logging.getLogger(__name__)


def check_port(host: str, port: int) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as e:
            raise UserError(
                f"cannot listen on {host}:{port} ({e.strerror or e}); is another server "
                "running there? pick another with port=..."
            ) from None


def check_security(cfg: ServeConfig) -> Keys:
    """The configured keys (a UserError for a bad key file), with a warning for each way the
    settings leave the server open to others."""
    keys = load_keys(cfg)
    if keys.api:
        return keys
    if not is_loopback(cfg.host):
        mounts = cfg.allow_adapter_mount and keys.admin is None
        log.warning(
            "mlxlab serve: warning: listening on %s without an API key: anyone who can reach "
            "this address can use the model%s; set api_key=... (or MLXLAB_API_KEY, api_key_file=)",
            cfg.host,
            " and mount adapters" if mounts else "",
        )
    if "*" in cfg.cors_origins:
        log.warning(
            "mlxlab serve: warning: cors_origins=[*] without an API key: any web page open in a "
            "browser on this machine can use the server; set api_key=... or list the origins"
        )
    return keys


def ready_line(cfg: ServeConfig, gateway: Gateway) -> str:
    loaded = gateway.loaded
    adm = loaded.admission
    cache = (
        f"prompt cache {cfg.prompt_cache_gb:g} GB" if loaded.cache.enabled else "prompt cache off"
    )
    return (
        f"mlxlab serve: ready on http://{cfg.host}:{cfg.port}/v1 | model {cfg.model} | context ceiling "
        f"{adm.max_safe_context} tokens (memory budget {adm.budget_bytes / 1e9:.1f} GB"
        f"{'' if adm.explicit_budget else ', 75% of RAM'}) | {cache} | queue {cfg.max_queue}"
        f" | {'batch ' + str(cfg.batch) if gateway.batch else 'serial'}"
        f"{' | kv ' + loaded.kv.mode if loaded.kv.enabled else ''}"
        f" | adapter root {loaded.adapters.root}"
        f"{' | models ' + ', '.join(cfg.models) if cfg.models else ''}"
        f"{' | models from the HF cache' if cfg.models_from_cache else ''}"
    )


ABORT_GRACE_S = 10.0  # after the drain timeout: for aborted jobs to stop and answer


class DrainingServer(uvicorn.Server):
    """uvicorn, with a drain before the exit: the first signal turns new requests into 503s and
    waits until nothing is left in flight (up to the drain timeout, after which the unfinished
    answers are aborted with a 503), then exits; a second signal exits at once."""

    def __init__(self, config: uvicorn.Config, app, gateway: Gateway, drain_timeout_s: float):
        super().__init__(config)
        self.app, self.gateway, self.drain_timeout_s = app, gateway, drain_timeout_s
        self.draining_since: float | None = None
        self.drained = threading.Event()

    def handle_exit(self, sig, frame):
        if self.draining_since is not None:  # second signal: leave now
            self.force_exit = True
            self.should_exit = True
            return
        self.draining_since = time.monotonic()
        self.app.state.draining = True
        log.info(
            "mlxlab serve: draining (%d in flight, up to %g s)",
            self.app.state.in_flight.count,
            self.drain_timeout_s,
        )
        threading.Thread(target=self._drain, daemon=True).start()

    def busy(self) -> bool:
        """Whether a job is queued or running, an HTTP exchange is in flight, or a connection
        still has response bytes buffered that its client has not taken yet."""
        if self.gateway.pending or self.app.state.in_flight.count:
            return True
        try:
            connections = list(self.server_state.connections)
        except RuntimeError:  # the set changed while we copied it: look again
            return True
        for c in connections:
            transport = getattr(c, "transport", None)
            if transport is not None and transport.get_write_buffer_size():
                return True
        return False

    def _wait_idle(self, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while self.busy() and time.monotonic() < deadline:
            time.sleep(0.02)
        return not self.busy()

    def _drain(self):
        left = self.draining_since + self.drain_timeout_s - time.monotonic()
        if not self._wait_idle(left):
            # Out of time: the answers still being generated end now, and each client is told
            # why (a 503 in its protocol's shape, or a stream's error event) before uvicorn's
            # grace period would cancel the handlers mid-answer.
            n = self.gateway.abort_all(
                f"the server is shutting down: its drain timeout ({self.drain_timeout_s:g} s, "
                "serve.drain_timeout_s) ran out before this answer was complete; retry"
            )
            log.warning(
                "mlxlab serve: drain timeout (%g s): %d unfinished request(s) aborted",
                self.drain_timeout_s,
                n,
            )
            if not self._wait_idle(ABORT_GRACE_S):
                log.warning("mlxlab serve: leaving with requests in flight")
        self.drained.set()
        self.should_exit = True


class HeaderTimeout(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a deadline for request headers: a connection that has
    not sent a whole request head within `timeout_s` of opening (or of its previous response)
    is closed, so clients that trickle or stall their headers (slowloris) hold no connection
    slot. The body's own deadline is `http.BodyLimit`'s."""

    timeout_s = 30.0
    _deadline: asyncio.TimerHandle | None = None

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            log.info(
                "mlxlab serve: closed a connection that sent no request head within %gs",
                self.timeout_s,
            )
            self.transport.close()

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request head arrived
            self._disarm()

    def on_response_complete(self) -> None:
        self._arm()  # for the next request on this connection (a pipelined one disarms it)
        super().on_response_complete()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def handle_websocket_upgrade(self, event) -> None:
        self._disarm()  # the connection now belongs to the WebSocket protocol
        super().handle_websocket_upgrade(event)


def uvicorn_config(cfg: ServeConfig, app) -> uvicorn.Config:
    """uvicorn's settings for `cfg`: h11 with the header deadline, the connection cap."""
    protocol = type("HeaderTimeout", (HeaderTimeout,), {"timeout_s": cfg.read_timeout_s})
    # The drain has already waited for every response; uvicorn's own grace period only closes
    # the idle connections.
    return uvicorn.Config(
        app,
        host=cfg.host,
        port=cfg.port,
        log_level="warning",
        access_log=cfg.log_requests,
        timeout_graceful_shutdown=5,
        http=protocol,
        limit_concurrency=cfg.max_connections,
    )


def run(cfg: ServeConfig) -> None:
    keys = check_security(cfg)
    check_port(cfg.host, cfg.port)
    gateway = Gateway(cfg.engine()).start()
    app = create_app(cfg, gateway, keys)
    server = DrainingServer(uvicorn_config(cfg, app), app, gateway, cfg.drain_timeout_s)
    failed = []

    def announce():
        gateway.ready.wait()
        if gateway.state == "ready":
            log.info(ready_line(cfg, gateway))
        else:  # the model or a start-time adapter did not load: nothing to serve
            failed.append(gateway.error)
            server.should_exit = True

    threading.Thread(target=announce, daemon=True).start()
    log.info(
        "mlxlab serve: loading %s (http://%s:%d/health answers 503 until ready)",
        cfg.model,
        cfg.host,
        cfg.port,
    )
    server.run()
    gateway.stop(timeout=2)
    if failed:
        log.error("mlxlab serve: error: %s", failed[0])
    else:
        log.info("mlxlab serve: stopped")
    # Leave without running C++ static destructors: MLX aborts at exit ("terminate called without
    # an active exception") once a non-main thread has used its thread-local generation stream.
    # Everything worth keeping is flushed; the exit code is the drain's, not the teardown's.
    for handler in logging.getLogger().handlers + logging.getLogger("mlxlab").handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if failed else 0)


def main(argv: list[str]) -> None:
    # `adapters.NAME=PATH`, `models.NAME=SPEC` and `model_adapters.MODEL.ID=PATH` add a key to a
    # dict that starts empty; Hydra wants `+` for that.
    added = ("adapters.", "models.", "model_adapters.")
    argv = ["+" + a if a.startswith(added) and "=" in a else a for a in argv]
    run_hydra("serve", argv, run)
