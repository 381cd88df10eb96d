"""The front of the engine: one worker thread runs the models; requests reach it through the
gateway's bounded queue and a lane.

    HTTP handlers --Job--> Gateway (bounded queue, admission already passed) --> lane --> events
                                                                                 (thread-safe sink)

The worker thread loads the default model (`Loaded`), then runs jobs on its model's serial lane
(`serial.py`: one at a time, with the prompt cache) or, with `serve.batch=N`, its batched lane
(`batch.py`: rows join and leave between decode steps). Each loaded model has its own lanes
(`lanes`, by model name; a job names its model through its lease): `Gateway.lane_for` picks per
job; every lane runs on this one thread, so no two use a model at the same time; the batched
lanes of several models step in turn, one decode step each. Admin tasks (adapter mount/unmount)
are queued with `call` and run between jobs; the loader thread's tasks (engine/loader.py: each
slice of a load's MLX work, attaching a model it loaded, detaching one it evicts) with
`between`, run between decode steps, a serial job's included: MLX evaluates on this thread only.
The other models (serve `models.NAME=`) are engine/models.py's and engine/loader.py's.
"""

from __future__ import annotations

import gc
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from mlxlab.decode.speculative import Counts
from mlxlab.serve.engine.batch import BatchLane, batchable
from mlxlab.serve.engine.entries import Entry
from mlxlab.serve.engine.jobs import (
    Done,
    Failed,
    Job,
    JobError,
    NotReady,
    QueueFull,
    ShuttingDown,
)
from mlxlab.serve.engine.loaded import Loaded
from mlxlab.serve.engine.loader import Loader
from mlxlab.serve.engine.models import Models
from mlxlab.serve.engine.rows import heal_random_state
from mlxlab.serve.engine.serial import SerialLane
from mlxlab.serve.engine.settings import EngineSettings

log = logging.getLogger(__name__)


@dataclass
class Lanes:
    """One loaded model's lanes."""

    loaded: Loaded
    serial: SerialLane
    batch: BatchLane | None


_WAKE = object()  # put on the queue with each `between` task: an idle engine wakes to run it


class _Between:
    """A task the engine thread runs as soon as it sees it, between two decode steps."""

    def __init__(self, fn: Callable[[], object]):
        self.fn, self.future = fn, Future()

    def __call__(self) -> None:
        try:
            self.future.set_result(self.fn())
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            self.future.set_exception(e)


class Gateway:
    def __init__(self, cfg: EngineSettings, loader: Callable[[EngineSettings], Loaded] = Loaded):
        self.cfg = cfg
        self._loader = loader
        self._queue: queue.Queue = queue.Queue()
        self._pending = 0  # queued + running
        self._jobs: dict[int, Job] = {}  # queued or running, by id()
        self.closing: str | None = None  # set by abort_all: new jobs are refused with it
        self._lock = threading.Lock()
        self.state = "loading"  # loading | ready | failed | stopped
        self.error: str | None = None
        self.loaded: Loaded | None = None
        self.ready = threading.Event()
        self.started_at = time.time()
        self.counters = {
            "requests": 0,
            "completed": 0,
            "cancelled": 0,
            "failed": 0,
            "rejected_queue_full": 0,
            "prompt_tokens": 0,
            "completion_tokens": 0,
        }
        # Called with (job, its Done or None when it failed) as each job leaves the engine, on
        # the engine thread (the server's metrics observe timings here); must not raise.
        self.observers: list[Callable[[Job, Done | None], None]] = []
        self.running: Job | None = None  # on the serial lane
        self.serial: SerialLane | None = None
        self.batch: BatchLane | None = (
            None  # when serve.batch > 1 (and the KV cache is not quantized)
        )
        self.served_serial = 0
        self.speculation = Counts()  # drafted and accepted tokens of finished jobs, both lanes
        self.models = Models(cfg)  # the models requests may name (engine/models.py)
        self.lanes: dict[str, Lanes] = {}  # each loaded model's, by name (the engine thread's)
        self.cache = None  # the prompt cache every model shares: the default model's
        # this thread's MLX stream: the loader builds its lazy models on it (MLX's streams are per
        # thread: an array must be made on a stream of the thread that evaluates it)
        self.stream = None
        self.loader = Loader(self)
        self._between: queue.Queue = queue.Queue()  # the loader's tasks (`between`)
        # a load's slices of MLX work run here, between decode steps (engine/pacer.py)
        self.models.pacer.run = lambda fn: self.between(fn).result()
        self._thread = threading.Thread(target=self._work, name="mlxlab-engine", daemon=True)

    def start(self) -> Gateway:
        self._thread.start()
        return self

    def lanes_of(self, job: Job) -> Lanes:
        """The lanes of the model the job's lease holds (the default model's without a lease)."""
        lease = job.lease
        return self.lanes[lease.name if lease is not None else self.models.default.name]

    def lane_for(self, job: Job) -> str:
        """ "batch" when its model has a batched lane and the job can join it, else "serial"."""
        return "batch" if self.lanes_of(job).batch is not None and batchable(job) else "serial"

    def between(self, fn: Callable[[], object]) -> Future:
        """Run `fn` on the engine thread between two decode steps (the loader thread's tasks);
        a future of its result."""
        task = _Between(fn)
        if self.state in ("failed", "stopped"):
            task.future.set_exception(RuntimeError(f"the engine is {self.state}"))
        else:
            self._between.put(task)
            self._queue.put(_WAKE)
        return task.future

    def attach(self, e: Entry, loaded: Loaded) -> None:
        """On the engine thread: start `loaded` (admission measured, counting the other models'
        weights) and give it lanes under `e`'s name."""
        loaded.start()
        loaded.admission.bind(lambda: self.models.others(e))
        self.lanes[e.name] = self._lanes_for(loaded)

    def detach(self, e: Entry, reason: str) -> None:
        """On the engine thread: drop `e`'s lanes (it has no work in flight) and its model
        (`Models.unloaded`, `reason`: lru or idle), then free their memory: nothing references
        the model any more when the arrays are collected and MLX's cache cleared."""
        import mlx.core as mx

        self.lanes.pop(e.name, None)
        self.models.unloaded(e, reason)
        gc.collect()
        mx.clear_cache()

    def _lanes_for(self, loaded: Loaded) -> Lanes:
        cfg = loaded.cfg
        batch = None
        if cfg.decode.batch > 1 and not loaded.kv.enabled:
            batch = BatchLane(loaded, cfg, self._finish)
        elif cfg.decode.batch > 1:
            log.warning(
                "mlxlab serve: kv_quant is on, so every request to %s runs on the serial lane "
                "(quantized KV caches cannot be batched)",
                loaded.model_id,
            )
        return Lanes(loaded, SerialLane(loaded, cfg, self._run_between), batch)

    @property
    def pending(self) -> int:
        return self._pending

    def submit(self, job: Job) -> None:
        if self.closing is not None:
            raise ShuttingDown(self.closing)
        if self.state != "ready":
            raise NotReady(self.error or f"the engine is {self.state}")
        with self._lock:
            # what the loaded models can run at once: each one's batch rows, or its serial lane
            rows = sum(
                x.loaded.cfg.decode.batch if x.batch is not None else 1
                for x in list(self.lanes.values())
            )
            if self._pending >= self.cfg.max_queue + rows - 1:
                self.counters["rejected_queue_full"] += 1
                raise QueueFull(
                    f"{self._pending} requests are queued or running (max_queue={self.cfg.max_queue})"
                )
            self._pending += 1
            self._jobs[id(job)] = job
            self.counters["requests"] += 1
        self._queue.put(job)

    def abort_all(self, reason: str) -> int:
        """Abort every job queued or running (`Job.abort`) and refuse new ones with `reason`
        (a request still being prepared when the drain ran out); how many were aborted."""
        self.closing = reason
        with self._lock:
            jobs = list(self._jobs.values())
        for job in jobs:
            job.abort(reason)
        return len(jobs)

    async def call(self, fn: Callable[[], object]):
        """Run `fn` on the engine thread between jobs (never during a forward pass); await its result."""
        import asyncio

        if self.state != "ready":
            raise NotReady(self.error or f"the engine is {self.state}")
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def done(result, error):
            if not future.done():
                future.set_exception(error) if error else future.set_result(result)

        def task():
            try:
                result, error = fn(), None
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting handler
                result, error = None, e
            loop.call_soon_threadsafe(done, result, error)

        self._queue.put(task)
        return await future

    def stop(self, timeout: float = 5.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout)
        self.loader.stop(timeout)

    def _start_default(self) -> None:
        import mlx.core as mx

        self.stream = mx.default_stream(mx.default_device())
        began = time.monotonic()
        self.loaded = self._loader(self.cfg)
        default = self.models.default
        self.loaded.admission.bind(lambda: self.models.others(default))
        self.cache = self.loaded.cache
        lanes = self._lanes_for(self.loaded)
        self.serial, self.batch = lanes.serial, lanes.batch
        self.lanes[default.name] = lanes
        self.models.loaded(default, self.loaded, time.monotonic() - began)

    def _take(self):
        """The next item, waiting for one; the pacer hears that the engine is idle meanwhile."""
        try:
            return self._queue.get_nowait()
        except queue.Empty:
            pass
        self.models.pacer.busy(False)
        item = self._queue.get()
        self.models.pacer.busy(True)
        return item

    def _work(self) -> None:
        try:
            self._start_default()
            self.state = "ready"
        except BaseException as e:  # noqa: BLE001 - reported through /health
            self.state, self.error = "failed", f"failed to load: {e}"
            self.ready.set()
            return
        self.loader.start()
        self.ready.set()
        held = []  # an item that must wait for the batches to drain (serial job, admin task, stop)
        while True:
            self._run_between()
            batches = [x.batch for x in self.lanes.values() if x.batch is not None]
            batches = [b for b in batches if b.active]
            if batches:
                while not held:  # take what has arrived, without waiting
                    try:
                        item = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if item is _WAKE:
                        continue
                    if isinstance(item, Job) and self.lane_for(item) == "batch":
                        self._add_row(item)
                    else:
                        held.append(item)
                for batch in batches:  # the models take turns: a decode step each
                    try:
                        batch.step()
                    except Exception as e:  # noqa: BLE001 - the batch's requests fail, the engine carries on
                        log.exception("mlxlab serve: a batched forward pass failed")
                        heal_random_state()
                        batch.fail_all(f"generation failed: {e}")
                continue
            item = held.pop() if held else self._take()
            if item is _WAKE:
                continue
            if item is None:
                self.state = "stopped"
                self._refuse_between()
                return
            if not isinstance(item, Job):  # an admin task (adapter mount/unmount), a loader's
                item()
            elif self.lane_for(item) == "batch":
                self._add_row(item)
            else:
                self._run_serial(item)

    def _queued_between(self):
        """The loader's tasks queued now, taken one at a time."""
        while True:
            try:
                yield self._between.get_nowait()
            except queue.Empty:
                return

    def _run_between(self) -> None:
        """Run the loader's tasks that have arrived (before the next decode step or job)."""
        for task in self._queued_between():
            task()

    def _refuse_between(self) -> None:
        """The engine stopped: the loader's tasks still queued fail, so it never waits forever."""
        for task in self._queued_between():
            task.future.set_exception(RuntimeError("the engine is stopped"))

    def _cancelled_before_start(self, job: Job) -> bool:
        if job.cancelled.is_set():
            self._finish(job, None, None)
            return True
        return False

    def _add_row(self, job: Job) -> None:
        if self._cancelled_before_start(job):
            return
        try:
            self.lanes_of(job).batch.add(job)
        except JobError as e:
            self._finish(job, None, Failed(str(e), 400, e.code))
        except Exception as e:  # noqa: BLE001 - one request failed, the engine carries on
            log.exception("mlxlab serve: adding a row failed")
            heal_random_state()
            self._finish(job, None, f"generation failed: {e}")

    def _run_serial(self, job: Job) -> None:
        if self._cancelled_before_start(job):
            return
        self.running = job
        done, error = None, None
        self.served_serial += 1
        try:
            done = self.lanes_of(job).serial.run(job)
        except JobError as e:
            error = Failed(str(e), 400, e.code)
        except Exception as e:  # noqa: BLE001 - one request failed, the engine carries on
            log.exception("mlxlab serve: a request failed")
            heal_random_state()
            error = f"generation failed: {e}"
        finally:
            self.running = None
            self._finish(job, done, error)

    def _finish(self, job: Job, done: Done | None, error: str | Failed | None) -> None:
        """A job left the engine: count it, release its lease, then send its last event: `done`,
        or `error` (a message: a 500), or with neither (cancelled before it started) a Done of
        no tokens. Every path that ends a job comes here, and the event goes last, so a client
        that reads /stats or /metrics right after its answer finds the answer counted."""
        if error is not None:
            self.counters["failed"] += 1
        elif done is None or done.finish_reason == "cancelled":
            self.counters["cancelled"] += 1
        else:
            self.counters["completed"] += 1
        if done is not None:
            self.counters["prompt_tokens"] += done.prompt_tokens
            self.counters["completion_tokens"] += done.completion_tokens
            if done.speculation is not None:
                s = done.speculation
                self.speculation.record(
                    s["verify_steps"], s["drafted_tokens"], s["accepted_tokens"], s["forced_tokens"]
                )
                log.info(
                    "mlxlab serve: %d tokens in %.2f s; speculative: %d drafted, %d accepted "
                    "(%s), %d forced by the grammar, %d verify steps",
                    done.completion_tokens,
                    done.seconds,
                    s["drafted_tokens"],
                    s["accepted_tokens"],
                    f"{s['acceptance_rate']:.0%}" if s["acceptance_rate"] is not None else "-",
                    s["forced_tokens"],
                    s["verify_steps"],
                )
        with self._lock:
            self._pending -= 1
            self._jobs.pop(id(job), None)
        if job.lease is not None:  # the model may be evicted once its last job has left
            tokens = (done.prompt_tokens, done.completion_tokens) if done is not None else (0, 0)
            self.models.finished(job.lease.name, *tokens)
            job.lease.release()
        for observe in self.observers:
            try:
                observe(job, done if error is None else None)
            except Exception:  # noqa: BLE001 - an observer's bug costs its numbers, not the job
                log.exception("mlxlab serve: a job observer failed")
        if error is not None:
            job.sink(error if isinstance(error, Failed) else Failed(error))
        else:
            job.sink(done if done is not None else Done("cancelled", len(job.prompt), 0, 0))

    def batch_stats(self) -> dict:
        b = self.batch
        if b is None:
            return {
                "configured": self.cfg.decode.batch,
                "batched": False,
                "active_rows": int(self.running is not None),
                "served_serial": self.served_serial,
                "reason": "kv_quant is on" if self.cfg.decode.batch > 1 else None,
            }
        return {**b.stats(), "served_serial": self.served_serial}

    def speculation_stats(self) -> dict:
        """`speculative=` and its draft bound, and the drafted and accepted tokens of the jobs
        finished so far (both lanes)."""
        d = self.cfg.decode
        return {
            "mode": d.speculative,
            "draft_tokens": d.draft_tokens,
            "draft_model": self.cfg.draft_model,
            **self.speculation.as_dict(),
        }

    def stats(self) -> dict:
        batches = [x.batch for x in list(self.lanes.values()) if x.batch is not None]
        running = int(self.running is not None) + sum(b.running for b in batches)
        out = {
            "state": self.state,
            "queued": max(self._pending - running, 0),
            "running": running,
            "max_queue": self.cfg.max_queue,
            **self.counters,
        }
        return out
