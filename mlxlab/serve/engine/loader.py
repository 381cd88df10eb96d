"""The loader thread: a model other than the default loads here when a request first names it,
and idle ones are unloaded here (engine/models.py decides what fits and what is evicted).

    request --Models.acquire--> queued --loader: resolve, plan_load (evict LRU idle models),
    the lazy model built, its weights evaluated in slices on the engine thread (paced:
    engine/pacer.py), the tokenizer, the grammar vocabulary--> engine thread: Loaded.start
    (admission measured), its lanes attached --> loaded: the waiting requests get their leases

Only what reads files or builds without evaluating runs here (the lazy model, on the engine
thread's MLX stream: streams are per thread; the tokenizer, the grammar vocabulary), beside the
engine thread's generation for the other models; a model's random initialization uses this
thread's random state, never the engine's (a seeded request's). MLX must not evaluate on two
threads at once, so every evaluation (the weights' slices, decode copies, a vision tower),
every forward pass and everything that touches the lanes (measuring admission, attaching and
detaching lanes) is handed to the engine thread (`Gateway.between`), which runs it between two
decode steps. A load that fails (a corrupt file, a model that cannot fit) fails the requests
waiting for it and nothing else.
"""

from __future__ import annotations

import gc
import logging
import queue
import threading
import time

from mlxlab.models import zoo
from mlxlab.serve.engine.catalog import planned_bytes
from mlxlab.serve.engine.entries import Entry, ModelError
from mlxlab.serve.engine.loaded import Loaded
from mlxlab.serve.engine.models import LEASE_WAIT_S

log = logging.getLogger(__name__)

IDLE_TICK_S = 1.0
"""How often, at most, the loader looks for models idle past serve.model_idle_s."""


class Loader:
    def __init__(self, gateway):
        self.gateway = gateway
        self.models = gateway.models
        self._thread = threading.Thread(target=self._work, name="mlxlab-loader", daemon=True)

    def start(self) -> Loader:
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self.models.loads.put(None)
        if self._thread.ident is not None:  # started (not when the default model failed)
            self._thread.join(timeout)

    def _work(self) -> None:
        idle_s = self.models.cfg.model_idle_s
        tick = min(IDLE_TICK_S, idle_s / 4) if idle_s else None
        while True:
            try:
                e = self.models.loads.get(timeout=tick)
            except queue.Empty:
                e = False
            if e is None:
                return
            try:
                if e:
                    self._load(e)
                for victim in self.models.idle_victims():
                    self._unload(victim, "idle")
            except Exception as err:  # noqa: BLE001 - the loader goes on; the model's waiters get it
                log.exception("mlxlab serve: the loader failed (%s); it goes on", err)
                if e and e.state in ("queued", "loading"):
                    self.models.failed(e, err)

    def _load(self, e: Entry) -> None:
        import mlx.core as mx

        m, cfg = self.models, self.models.cfg
        began = time.monotonic()
        try:
            model_dir = zoo.resolve(e.spec)  # may build a zoo model or convert a GGUF
            size = planned_bytes(model_dir, cfg.dtype, cfg.decode_head)
            for victim in m.plan_load(e, size, wait_s=LEASE_WAIT_S):
                self._unload(victim, "lru")
            m.pacer.start()
            with mx.stream(self.gateway.stream):  # its arrays are the engine thread's to evaluate
                loaded = Loaded(
                    m.settings_for(e),
                    cache=self.gateway.cache,
                    name=e.name,
                    model_dir=model_dir,
                    pace=m.pacer.pace,
                    vocab=False,
                    deferred=True,
                    remount=m.remounts(e),
                )
            loaded.grammar_vocab()
            self.gateway.between(lambda: self.gateway.attach(e, loaded)).result()
        except Exception as err:  # noqa: BLE001 - the waiting requests get it; the server goes on
            if not isinstance(err, ModelError):
                log.warning("mlxlab serve: model %r failed to load: %s", e.name, err)
            m.failed(e, err)
            gc.collect()
            return
        seconds = time.monotonic() - began
        m.loaded(e, loaded, seconds)
        log.info("mlxlab serve: loaded model %r (%s) in %.1f s", e.name, e.spec, seconds)

    def _unload(self, e: Entry, reason: str) -> None:
        """Detach `e`'s lanes and model on the engine thread and free its memory (`reason`: lru
        or idle)."""
        try:
            self.gateway.between(lambda: self.gateway.detach(e, reason)).result()
        finally:
            if e.state == "evicting":  # the engine did not get to it (stopped, or it failed)
                self.models.unloaded(e, reason)
        log.info("mlxlab serve: unloaded model %r (%s)", e.name, reason)
