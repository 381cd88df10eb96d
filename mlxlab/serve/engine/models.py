"""The models a request may ask for, which of them are loaded, and the memory they share.

    serve model=A models.b=SPEC models.c=SPEC [models_from_cache=true] memory_budget_gb=...

- Names, entries, mount lists, what each model is and the reports of them: engine/entries.py,
  the registry `Models` builds on (`Entries`).
- States: unloaded -> queued -> loading -> loaded -> evicting -> unloaded; failed (the error is
  kept; the next request after `RETRY_FAILED_S` tries again). The default model loads at start
  and is pinned: never evicted or unloaded.
- Leases: a request holds one from before its prompt is rendered until its job leaves the
  engine (`Lease.release`), so a model with work in flight is never evicted; a lease also
  records the KV its request needs (`Lease.reserve`).
- Memory: `memory_budget_gb` is the server's. Every loaded (or loading) model's weights count
  against it (`others`, which each model's `Admission` reads), so each model's context ceiling
  is what is left beside the others. A load is planned (`plan_load`) from the model's weight
  bytes read from its files (engine/catalog.py): least recently used idle models are evicted
  until the new one fits beside the rest and the KV of every request in flight; a model that can
  never fit beside the pinned default is a 400 `model_too_large`, one that cannot fit now
  because the others are busy a 503 `insufficient_memory` (Retry-After), after waiting up to
  `LEASE_WAIT_S` for a busy model's lease to end (a job about to finish). The engine releases
  a job's lease before it sends the job's last event (`Gateway._finish`), so a request sent
  right after an answer never finds that answer's lease still held.

The loading itself is engine/loader.py's; the lanes of each loaded model are the gateway's.
Everything here is guarded by one lock (`Models.lock`): requests (the render thread, the event
loop), the loader thread and the engine thread all come here.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future

from mlxlab.serve.engine.admission import RESERVE_BYTES
from mlxlab.serve.engine.entries import HOLDING, Entries, Entry, ModelError
from mlxlab.serve.engine.settings import EngineSettings

LEASE_WAIT_S = 2.0
"""How long a load that cannot fit only because busy models' leases hold the budget waits for one
of them to end (a job about to finish) before its 503."""

RETRY_FAILED_S = 10.0
"""A model that failed to load answers its error for this long, then the next request retries."""


class Lease:
    """A request's hold on a loaded model (see the module docstring). `name`: the model's (its
    lanes'); `asked`: the name the request used for it, which its answer echoes (an alias's
    own; the model's when the one model answers any name)."""

    def __init__(self, models: Models, entry: Entry, asked: str | None = None):
        self.models, self.entry = models, entry
        self.asked = asked or entry.name
        self.loaded = entry.loaded
        self.need_bytes = 0
        self.open = True

    @property
    def name(self) -> str:
        return self.entry.name

    def reserve(self, tokens: int) -> None:
        """Record the KV bytes of its request (prompt + max_tokens = `tokens`); call it with
        `models.lock` held, together with the admission check it passed."""
        self.need_bytes = self.loaded.admission.per_row_bytes(tokens)

    def release(self) -> None:
        """Done with the model (idempotent)."""
        with self.models.lock:
            if not self.open:
                return
            self.open = False
            self.entry.leases.discard(self)
            self.entry.last_used = time.monotonic()
            self.models.released.notify_all()  # a load waiting for room plans again


class Models(Entries):
    """The models one server may serve (see the module docstring): the registry (`Entries`) with
    leases, the load queue, the memory plan and the state changes."""

    def __init__(self, cfg: EngineSettings):
        super().__init__(cfg)
        self.released = threading.Condition(self.lock)  # notified as each lease ends
        self.loads: queue.Queue = queue.Queue()  # entries to load, for the loader thread

    def unmount_or_lease(self, name: str | None, adapter_id: str) -> tuple[Entry, object]:
        """DELETE /v1/adapters' first step on the model `name` names (ModelError 404 for an
        unknown name), by its state, atomically: loaded -> (entry, a lease on it: unmount from
        its registry, then `forget`); queued or loading -> (entry, "loading": its load has read
        or will read the mount list: wait for it, then unmount as from a loaded model);
        otherwise (unloaded, failed, evicting: the next load reads the list) -> (entry, whether
        `adapter_id` was on its list, which it is taken off here: nothing is loaded for it)."""
        e = self.find(name)
        with self.lock:
            if e.state == "loaded":
                return e, self._lease(e)
            if e.state in ("queued", "loading"):
                return e, "loading"
            return e, self.forget(e, adapter_id)

    # --- leases -----------------------------------------------------------------------------

    def acquire(self, name: str | None) -> Future:
        """A future of a Lease on the model `name` names, loading it first if it is not loaded
        (ModelError at once for an unknown name or a recent failure; the future's exception
        for a load that fails or cannot fit)."""
        fut: Future = Future()
        e = self.find(name)  # outside the lock: it may scan the Hugging Face cache
        with self.lock:
            asked = name if name in self.aliases else e.name
            if e.state == "loaded":
                fut.set_result(self._lease(e, asked))
                return fut
            if e.state == "failed" and time.monotonic() - e.failed_at < RETRY_FAILED_S:
                raise self.failure(e)
            e.waiters.append((fut, asked))
            if e.state in ("unloaded", "failed"):
                self._queue(e)
        return fut

    def _lease(self, e: Entry, asked: str | None = None) -> Lease:
        lease = Lease(self, e, asked)
        e.leases.add(lease)
        e.last_used = time.monotonic()
        return lease

    def _queue(self, e: Entry) -> None:
        e.state = "queued"
        self.loads.put(e)

    @staticmethod
    def failure(e: Entry) -> ModelError:
        return ModelError(f"model {e.name!r} failed to load: {e.error}", 500, "model_load_failed")

    # --- memory -----------------------------------------------------------------------------

    def others(self, e: Entry) -> int:
        """Bytes the other models' weights hold (loaded, loading or being evicted)."""
        with self.lock:
            return sum(
                x.reserved for x in self.entries.values() if x is not e and x.state in HOLDING
            )

    def plan_load(self, e: Entry, weight_bytes: int, wait_s: float = 0.0) -> list[Entry]:
        """The models to evict so that `e` (its weights `weight_bytes`) fits, marked evicting,
        with `e`'s bytes reserved; ModelError when it cannot fit (see the module docstring).
        When only busy models' leases stand in the way, it waits up to `wait_s` (the loader:
        LEASE_WAIT_S) for a lease to end and plans again, before the 503."""
        deadline = time.monotonic() + wait_s
        with self.lock:
            while True:
                try:
                    return self._plan(e, weight_bytes)
                except ModelError as err:
                    left = deadline - time.monotonic()
                    if err.code != "insufficient_memory" or left <= 0:
                        raise
                    self.released.wait(left)  # a lease ended (or the time is up): plan again

    def _plan(self, e: Entry, weight_bytes: int) -> list[Entry]:
        with self.lock:
            pinned = sum(x.reserved for x in self.entries.values() if x.pinned and x is not e)
            budget = self.budget_bytes
            gb = 1e9
            if weight_bytes + pinned + RESERVE_BYTES > budget:
                beside = f" beside the default model's {pinned / gb:.2f} GB" if pinned else ""
                raise ModelError(
                    f"model {e.name!r} needs {weight_bytes / gb:.2f} GB for its weights, which "
                    f"cannot fit the memory budget of {budget / gb:.2f} GB{beside} (and "
                    f"{RESERVE_BYTES / gb:.2f} GB kept in reserve); raise serve.memory_budget_gb",
                    400,
                    "model_too_large",
                )
            resident = self.others(e)
            # the KV of every request in flight: batched rows hold theirs at the same time
            need = sum(lease.need_bytes for x in self.entries.values() for lease in x.leases)
            idle = sorted(
                (
                    x
                    for x in self.entries.values()
                    if x.state == "loaded" and not x.pinned and not x.busy and x is not e
                ),
                key=lambda x: x.last_used,
            )
            victims = []
            while resident + weight_bytes + RESERVE_BYTES + need > budget:
                if not idle:
                    busy = [x.name for x in self.entries.values() if x.state in HOLDING and x.busy]
                    raise ModelError(
                        f"model {e.name!r} ({weight_bytes / gb:.2f} GB) cannot be loaded now: "
                        f"the memory budget of {budget / gb:.2f} GB is held by models with "
                        f"requests in flight ({', '.join(busy) or 'none'}); retry shortly",
                        503,
                        "insufficient_memory",
                        retry_after=5,
                    )
                v = idle.pop(0)
                victims.append(v)
                resident -= v.reserved
            for v in victims:
                v.state = "evicting"
            e.state, e.reserved = "loading", weight_bytes
            return victims

    def idle_victims(self) -> list[Entry]:
        """Loaded models idle for `model_idle_s` or longer, marked evicting."""
        if not self.cfg.model_idle_s:
            return []
        now = time.monotonic()
        with self.lock:
            out = [
                x
                for x in self.entries.values()
                if x.state == "loaded"
                and not x.pinned
                and not x.busy
                and now - x.last_used >= self.cfg.model_idle_s
            ]
            for x in out:
                x.state = "evicting"
            return out

    # --- state changes (the loader and engine threads) ----------------------------------------

    def loaded(self, e: Entry, loaded, seconds: float | None) -> None:
        """`e` is loaded (`seconds`: how long it took; None at start for the default): its
        waiters get their leases."""
        with self.lock:
            e.loaded, e.state, e.error, e.facts = loaded, "loaded", None, None
            for gone in getattr(loaded.adapters, "not_remounted", ()):  # reported, not kept
                if e.mounts.get(gone["id"], (None,))[0] == gone["path"]:
                    del e.mounts[gone["id"]]
                e.not_remounted = [x for x in e.not_remounted if x["id"] != gone["id"]]
                e.not_remounted.append(dict(gone))
            e.reserved = loaded.admission.weights_bytes
            e.last_used = time.monotonic()
            if seconds is not None:
                e.loads += 1
                e.load_seconds += seconds
                e.last_load_seconds = seconds
            waiters, e.waiters = e.waiters, []
            for fut, asked in waiters:
                self._hand(fut, self._lease(e, asked))

    def _hand(self, fut: Future, lease: Lease) -> None:
        """Give a waiter its lease; one whose request has gone releases it at once."""
        if not fut.set_running_or_notify_cancel():
            lease.release()
            return
        fut.set_result(lease)

    def failed(self, e: Entry, error: Exception) -> None:
        """`e`'s load failed or was refused: its waiters get the error. A refusal for memory
        (`ModelError`) leaves it unloaded; any other failure is kept as its error."""
        with self.lock:
            e.loaded, e.reserved = None, 0
            if isinstance(error, ModelError):
                e.state, out = "unloaded", error
            else:
                e.state, e.error, e.failed_at = "failed", str(error), time.monotonic()
                e.failures += 1
                out = self.failure(e)
            waiters, e.waiters = e.waiters, []
            for fut, _ in waiters:
                if fut.set_running_or_notify_cancel():
                    fut.set_exception(out)

    def unloaded(self, e: Entry, reason: str) -> None:
        """`e` was evicted (`reason`: "lru" or "idle"); requests that came meanwhile reload it."""
        with self.lock:
            e.loaded, e.reserved, e.facts = None, 0, None
            if reason == "idle":
                e.idle_unloads += 1
            else:
                e.evictions += 1
            e.state = "unloaded"
            if e.waiters:
                self._queue(e)

    def finished(self, name: str, prompt_tokens: int, completion_tokens: int) -> None:
        """A job of model `name` left the engine (its counters)."""
        with self.lock:
            e = self.entries.get(name)
            if e is not None:
                e.requests += 1
                e.prompt_tokens += prompt_tokens
                e.completion_tokens += completion_tokens
