"""`python -m mlxlab serve`: the HTTP server.

    python -m mlxlab serve                                  # gemma3-270m on http://127.0.0.1:8090
    python -m mlxlab serve model=tiny-qwen3 port=8091 memory_budget_gb=4 prompt_cache_gb=1

The port is checked before anything loads; the model loads on the engine thread while /health
answers 503; a ready line (URL, model, context ceiling, cache) is printed once it can serve.
Ctrl-C or SIGTERM drains: new requests get 503, in-flight ones get `drain_timeout_s` to finish,
then the process exits 0 (a second signal exits at once).
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time

from mlxlab.config import ServeConfig, UserError, run_hydra


def check_port(host: str, port: int) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as e:
            raise UserError(f"cannot listen on {host}:{port} ({e.strerror or e}); is another server "
                            "running there? pick another with port=...") from None


def ready_line(cfg: ServeConfig, gateway) -> str:
    loaded = gateway.loaded
    adm = loaded.admission
    cache = (f"prompt cache {cfg.prompt_cache_gb:g} GB" if loaded.cache.enabled else "prompt cache off")
    return (f"mlxlab serve: ready on http://{cfg.host}:{cfg.port}/v1 | model {cfg.model} | context ceiling "
            f"{adm.max_safe_context} tokens (memory budget {adm.budget_bytes / 1e9:.1f} GB"
            f"{'' if adm.explicit_budget else ', 75% of RAM'}) | {cache} | queue {cfg.max_queue}"
            f" | {'batch ' + str(cfg.batch) if gateway.batch else 'serial'}"
            f"{' | kv ' + loaded.kv.mode if loaded.kv.enabled else ''}")


def run(cfg: ServeConfig) -> None:
    import uvicorn

    from mlxlab.serve.app import create_app
    from mlxlab.serve.engine import Gateway

    check_port(cfg.host, cfg.port)
    gateway = Gateway(cfg).start()
    app = create_app(cfg, gateway)

    class Server(uvicorn.Server):
        """uvicorn, with a drain before the exit: new requests 503, in-flight ones finish."""

        draining_since: float | None = None

        def handle_exit(self, sig, frame):
            if self.draining_since is not None:  # second signal: leave now
                self.force_exit = True
                self.should_exit = True
                return
            self.draining_since = time.monotonic()
            app.state.draining = True
            print(f"mlxlab serve: draining ({gateway.pending} in flight, up to {cfg.drain_timeout_s:g} s)",
                  file=sys.stderr)
            threading.Thread(target=self._drain, daemon=True).start()

        def _drain(self):
            deadline = time.monotonic() + cfg.drain_timeout_s
            while gateway.pending and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.1)  # let the last responses flush
            self.should_exit = True

    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level="warning",
                            access_log=cfg.log_requests, timeout_graceful_shutdown=5)
    server = Server(config)

    failed = []

    def announce():
        gateway.ready.wait()
        if gateway.state == "ready":
            print(ready_line(cfg, gateway), file=sys.stderr, flush=True)
        else:  # the model or a start-time adapter did not load: nothing to serve
            failed.append(gateway.error)
            server.should_exit = True

    threading.Thread(target=announce, daemon=True).start()
    print(f"mlxlab serve: loading {cfg.model} (http://{cfg.host}:{cfg.port}/health answers 503 until ready)",
          file=sys.stderr, flush=True)
    server.run()
    gateway.stop(timeout=2)
    if failed:
        print(f"mlxlab serve: error: {failed[0]}", file=sys.stderr)
    else:
        print("mlxlab serve: stopped", file=sys.stderr)
    # Leave without running C++ static destructors: MLX aborts at exit ("terminate called without
    # an active exception") once a non-main thread has used its thread-local generation stream.
    # Everything worth keeping is flushed; the exit code is the drain's, not the teardown's.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if failed else 0)


def main(argv: list[str]) -> None:
    # `adapters.NAME=PATH` adds a key to a dict that starts empty; Hydra wants `+` for that.
    argv = ["+" + a if a.startswith("adapters.") and "=" in a else a for a in argv]
    run_hydra("serve", argv, run)
