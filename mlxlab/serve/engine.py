"""The engine: one worker thread owns the model; requests reach it through a gateway and a lane.

    HTTP handlers --Job--> Gateway (bounded queue, admission already passed) --> lane --> events
                                                                                 (thread-safe sink)

The worker thread loads the model, then runs jobs on the serial lane (one at a time, with the
prompt cache) or, with `serve.batch=N`, on the batched lane (`batch.py`: rows join and leave
between decode steps). `Gateway.lane_for` picks per job; both lanes run on this one thread, so
they never use the model at the same time. `RowOutput` turns one job's tokens into events the same
way on both lanes.

A job's sink receives `Delta` events (content or reasoning text, optional logprobs), then
exactly one `Done` (finish reason, usage, tool calls) or `Failed`. Setting `job.cancelled`
(client gone) stops its generation before the next token.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

from mlxlab.config import ServeConfig


@dataclass
class Sampling:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[int, float] | None = None


@dataclass
class Delta:
    kind: str  # content | reasoning
    text: str
    logprobs: list[dict] | None = None


@dataclass
class Done:
    finish_reason: str  # stop | length | tool_calls | cancelled
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    tool_calls: list[dict] = field(default_factory=list)
    stop_sequence: str | None = None
    seconds: float = 0.0
    ttft: float = 0.0
    tokens: list[int] = field(default_factory=list)  # the generated token ids


@dataclass
class Failed:
    message: str


@dataclass
class Job:
    prompt: list[int]
    max_tokens: int
    sink: Callable[[object], None]
    sampling: Sampling = field(default_factory=Sampling)
    stops: list[str] = field(default_factory=list)
    tools: list | None = None
    reasoning: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    adapter: str = "none"
    checkpoint: int = 0  # store a prompt-cache checkpoint at this prefix length (end of the system prompt)
    id: str = ""
    cancelled: threading.Event = field(default_factory=threading.Event)


class QueueFull(Exception):
    pass


class JobError(Exception):
    """A job that cannot run as asked (e.g. its adapter was unmounted while it waited)."""


class NotReady(Exception):
    pass


class Loaded:
    """What the worker loads: model, tokenizer, and what is derived from them once."""

    def __init__(self, cfg: ServeConfig):
        import mlx.core as mx

        from mlxlab.models.zoo import load, resolve
        from mlxlab.serve import admission, kv_quant
        from mlxlab.serve.output import think_markers, tool_syntax
        from mlxlab.serve.prompt_cache import PromptCache

        self.model_dir = resolve(cfg.model)
        self.model, self.tokenizer = load(str(self.model_dir), cfg.dtype)
        self.model_id = cfg.model
        self.eos = set(self.tokenizer.eos_token_ids)
        self.tool = tool_syntax(self.tokenizer)
        self.think = think_markers(self.tokenizer)
        self.hidden = hidden_token_ids(self.tokenizer, self.tool, self.think)
        budget = int(cfg.memory_budget_gb * 1e9) if cfg.memory_budget_gb else None
        self.kv = kv_quant.parse(cfg.kv_quant, self.model, self.model_dir)
        self.admission = admission.measure(self.model, budget, cfg.prefill_step, self.kv)
        mx.set_memory_limit(self.admission.budget_bytes)
        self.cache = PromptCache(int(cfg.prompt_cache_gb * 1e9))
        self.generation_config = read_generation_config(self.model_dir)
        from mlxlab.serve.adapters import Adapters

        self.adapters = Adapters(self.model, cfg.adapter_root)
        for adapter_id, path in (cfg.adapters or {}).items():
            m = self.adapters.mount(adapter_id, path)
            print(f"mlxlab serve: mounted adapter {adapter_id!r} from {m.path} (rank {m.rank}, "
                  f"{len(m.modules)} modules)", file=sys.stderr)


def hidden_token_ids(tokenizer, tool, think) -> set[int]:
    """Special tokens whose text must never reach a client (<eos>, <start_of_turn>, ...), except
    the markers the output parser needs to see."""
    hidden = set(getattr(tokenizer, "all_special_ids", []) or [])
    backend = getattr(tokenizer, "_tokenizer", tokenizer)
    for tid, tok in (getattr(backend, "added_tokens_decoder", None) or {}).items():
        if getattr(tok, "special", False):
            hidden.add(int(tid))
    keep = set()
    for marker in ([tool.start, tool.end] if tool else []) + (list(think) if think else []):
        ids = tokenizer.encode(marker, add_special_tokens=False) if marker else []
        if len(ids) == 1:
            keep.add(ids[0])
    return hidden - keep


def read_generation_config(model_dir) -> dict:
    import json
    from pathlib import Path

    path = Path(model_dir) / "generation_config.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {k: data[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
            if isinstance(data.get(k), (int, float)) and not isinstance(data.get(k), bool)}


class SerialLane:
    """One request at a time, with the prompt cache: prefill what is not cached, then decode."""

    def __init__(self, loaded: Loaded, cfg: ServeConfig):
        self.m = loaded
        self.cfg = cfg

    def _prefill(self, cache, tokens: list[int]) -> None:
        import mlx.core as mx
        from mlx_lm.generate import generation_stream

        # On the stream generate_step uses: on a CPU the default stream ran this prefill ~4x slower
        # (tiny-gemma3, 400 tokens: 2.5 s vs 0.6 s).
        step = self.cfg.prefill_step
        with mx.stream(generation_stream):
            for at in range(0, len(tokens), step):
                self.m.model(mx.array(tokens[at:at + step])[None], cache=cache)
                mx.eval([c.state for c in cache])

    def run(self, job: Job) -> Done:
        m = self.m
        ids = check_adapters(m, job)
        m.adapters.selection.ids = ids
        try:
            return self._run(job, ids)
        finally:
            m.adapters.selection.clear()

    def _run(self, job: Job, ids: tuple[str, ...]) -> Done:
        import mlx.core as mx
        from mlx_lm.generate import generate_step

        m = self.m
        count_adapter_use(m, ids)
        out = RowOutput(m, job)
        namespace = cache_namespace(m, ids)
        cache, cached = m.cache.fetch(namespace, job.prompt)
        if cache is None:
            cache = m.kv.make_cache(m.model)
        out.cached = cached
        *pieces, (end, _, _) = prompt_segments(job, cached)
        for start, stop, kind in pieces:
            self._prefill(cache, job.prompt[start:stop])
            m.cache.insert(namespace, job.prompt[:stop], cache, kind=kind)
        if job.sampling.seed is not None:
            mx.random.seed(job.sampling.seed)
        sampler, processors = make_sampling(job.sampling)
        steps = generate_step(mx.array(job.prompt[end:]), m.model, max_tokens=job.max_tokens,
                              sampler=sampler, logits_processors=processors, prompt_cache=cache,
                              prefill_step_size=self.cfg.prefill_step)
        finish = None
        for token, logprobs in steps:
            finish = out.feed(int(token), logprobs)  # the token is in the cache already (one ahead)
            if finish:
                break
        steps.close()
        done = out.close(finish or "length")  # "length": generate_step ended the loop at max_tokens
        if done.finish_reason != "cancelled":
            # The cache holds prompt + every token generated (each was fed as the next one was computed).
            m.cache.insert(namespace, job.prompt + out.tokens, cache, copy_cache=False)
        return done


def prompt_segments(job: Job, cached: int) -> list[tuple[int, int, str | None]]:
    """The pieces of the prompt still to run, as (start, end, prompt-cache checkpoint kind), in
    both lanes: up to the end of the system prompt ("system": shared by every conversation with
    it), up to the last token ("user": the prefix of the next turn even when the answer does not
    re-tokenize the same way), then the last token alone (None: generation starts from it)."""
    end = len(job.prompt) - 1
    pieces, at = [], cached
    if job.checkpoint and at < job.checkpoint < end:
        pieces.append((at, job.checkpoint, "system"))
        at = job.checkpoint
    if at < end:
        pieces.append((at, end, "user"))
    pieces.append((end, len(job.prompt), None))
    return pieces


def count_adapter_use(m: Loaded, ids: tuple[str, ...]) -> None:
    for i in ids:
        m.adapters.mounted[i].requests += 1


def cache_namespace(m: Loaded, ids: tuple[str, ...]) -> tuple[str, str]:
    return (m.model_id, "+".join(ids) or "none")


def check_adapters(m: Loaded, job: Job) -> tuple[str, ...]:
    """The job's adapter ids, still mounted (one may have been unmounted while the job waited)."""
    from mlxlab.serve.adapters import parse_spec

    ids = parse_spec(job.adapter)
    try:
        m.adapters.check(ids)
    except KeyError as e:
        raise JobError(str(e).strip("'\"")) from None
    return ids


def make_sampling(s: Sampling):
    """(sampler, logits processors) for one row, built by mlx-lm."""
    from mlx_lm.sample_utils import make_logits_processors, make_sampler

    sampler = make_sampler(temp=s.temperature, top_p=s.top_p if s.top_p < 1.0 else 0.0,
                           min_p=s.min_p, top_k=s.top_k)
    processors = make_logits_processors(s.logit_bias, s.repetition_penalty, 64,
                                        s.presence_penalty, 64, s.frequency_penalty, 64)
    return sampler, processors


class RowOutput:
    """One job's output side, the same in both lanes: token -> (eos, hidden tokens, streaming
    detokenizer, stop strings, tool/reasoning parser) -> Delta events; `close` sends the Done."""

    def __init__(self, m: Loaded, job: Job):
        from mlxlab.serve.output import OutputParser

        self.m, self.job = m, job
        self.parser = OutputParser(job.stops, m.tool, job.tools, m.think, job.reasoning)
        self.detok = m.tokenizer.detokenizer  # a fresh copy per call
        self.detok.reset()
        self.tokens: list[int] = []
        self.cached = 0
        self.t0 = time.perf_counter()
        self.ttft = 0.0

    def _send(self, deltas, lp=None) -> None:
        for i, (kind, text) in enumerate(deltas):
            self.job.sink(Delta(kind, text, lp if i == len(deltas) - 1 else None))
        if not deltas and lp:
            self.job.sink(Delta("content", "", lp))

    def feed(self, token: int, logprobs) -> str | None:
        """Take one generated token; the finish reason when the row must stop here, else None."""
        job = self.job
        if not self.tokens:
            self.ttft = time.perf_counter() - self.t0
        self.tokens.append(token)
        if job.cancelled.is_set():
            return "cancelled"
        if token in self.m.eos:
            return "stop"
        lp = token_logprobs(self.m.tokenizer, token, logprobs, job.top_logprobs) if job.logprobs else None
        if token in self.m.hidden:
            self._send([], lp)
            return None
        self.detok.add_token(token)
        self._send(self.parser.feed(self.detok.last_segment), lp)
        return "stop" if self.parser.stopped is not None else None

    def close(self, finish: str) -> Done:
        parser = self.parser
        self.detok.finalize()
        if parser.stopped is None and finish != "cancelled":
            self._send(parser.feed(self.detok.last_segment) + parser.finish())
        if parser.calls and finish != "cancelled":
            finish = "tool_calls"
        done = Done(finish, len(self.job.prompt), len(self.tokens), self.cached, parser.calls,
                    parser.stopped, time.perf_counter() - self.t0, self.ttft, list(self.tokens))
        self.job.sink(done)
        return done


def token_logprobs(tok, token: int, logprobs, top: int) -> list[dict]:
    import mlx.core as mx

    def entry(tid: int, lp: float) -> dict:
        text = tok.decode([tid])
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    e = entry(token, logprobs[token].item())
    if top:
        ids = mx.argpartition(-logprobs, top - 1)[:top]
        vals = logprobs[ids]
        pairs = sorted(zip(ids.tolist(), vals.tolist(), strict=True), key=lambda p: -p[1])
        e["top_logprobs"] = [entry(i, v) for i, v in pairs]
    else:
        e["top_logprobs"] = []
    return [e]


class Gateway:
    """The front of the engine: a bounded queue to the worker that owns the model."""

    def __init__(self, cfg: ServeConfig, loader: Callable[[ServeConfig], Loaded] = Loaded):
        self.cfg = cfg
        self._loader = loader
        self._queue: queue.Queue = queue.Queue()
        self._pending = 0  # queued + running
        self._lock = threading.Lock()
        self.state = "loading"  # loading | ready | failed | stopped
        self.error: str | None = None
        self.loaded: Loaded | None = None
        self.ready = threading.Event()
        self.started_at = time.time()
        self.counters = {"requests": 0, "completed": 0, "cancelled": 0, "failed": 0,
                         "rejected_queue_full": 0, "prompt_tokens": 0, "completion_tokens": 0}
        self.running: Job | None = None  # on the serial lane
        self.serial: SerialLane | None = None
        self.batch = None  # BatchLane when serve.batch > 1 (and the KV cache is not quantized)
        self.served_serial = 0
        self._thread = threading.Thread(target=self._work, name="mlxlab-engine", daemon=True)

    def start(self) -> Gateway:
        self._thread.start()
        return self

    def lane_for(self, job: Job) -> str:
        """"batch" when a batched lane runs and the job can join it, else "serial"."""
        from mlxlab.serve.batch import batchable

        return "batch" if self.batch is not None and batchable(job) else "serial"

    @property
    def pending(self) -> int:
        return self._pending

    def submit(self, job: Job) -> None:
        if self.state != "ready":
            raise NotReady(self.error or f"the engine is {self.state}")
        with self._lock:
            rows = self.cfg.batch if self.batch is not None else 1
            if self._pending >= self.cfg.max_queue + rows - 1:
                self.counters["rejected_queue_full"] += 1
                raise QueueFull(f"{self._pending} requests are queued or running (max_queue={self.cfg.max_queue})")
            self._pending += 1
            self.counters["requests"] += 1
        self._queue.put(job)

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

    def _work(self) -> None:
        try:
            self.loaded = self._loader(self.cfg)
            self.serial = SerialLane(self.loaded, self.cfg)
            if self.cfg.batch > 1 and not self.loaded.kv.enabled:
                from mlxlab.serve.batch import BatchLane

                self.batch = BatchLane(self.loaded, self.cfg, self._finish)
            elif self.cfg.batch > 1:
                print("mlxlab serve: kv_quant is on, so every request runs on the serial lane "
                      "(quantized KV caches cannot be batched)", file=sys.stderr)
            self.state = "ready"
        except BaseException as e:  # noqa: BLE001 - reported through /health
            self.state, self.error = "failed", f"failed to load: {e}"
            self.ready.set()
            return
        self.ready.set()
        held = []  # an item that must wait for the batch to drain (serial job, admin task, stop)
        while True:
            batch = self.batch
            if batch is not None and batch.active:
                while not held:  # take what has arrived, without waiting
                    try:
                        item = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if isinstance(item, Job) and self.lane_for(item) == "batch":
                        self._add_row(item)
                    else:
                        held.append(item)
                try:
                    batch.step()
                except Exception as e:  # noqa: BLE001 - the batch's requests fail, the engine carries on
                    traceback.print_exc()
                    batch.fail_all(f"generation failed: {e}")
                continue
            item = held.pop() if held else self._queue.get()
            if item is None:
                self.state = "stopped"
                return
            if not isinstance(item, Job):  # an admin task (adapter mount/unmount)
                item()
            elif self.lane_for(item) == "batch":
                self._add_row(item)
            else:
                self._run_serial(item)

    def _cancelled_before_start(self, job: Job) -> bool:
        if job.cancelled.is_set():
            job.sink(Done("cancelled", len(job.prompt), 0, 0))
            self._finish(job, None, None)
            return True
        return False

    def _add_row(self, job: Job) -> None:
        if self._cancelled_before_start(job):
            return
        try:
            self.batch.add(job)
        except JobError as e:
            self._finish(job, None, str(e))
        except Exception as e:  # noqa: BLE001 - one request failed, the engine carries on
            traceback.print_exc()
            self._finish(job, None, f"generation failed: {e}")

    def _run_serial(self, job: Job) -> None:
        if self._cancelled_before_start(job):
            return
        self.running = job
        done, error = None, None
        try:
            done = self.serial.run(job)
            self.served_serial += 1
        except JobError as e:
            error = str(e)
        except Exception as e:  # noqa: BLE001 - one request failed, the engine carries on
            traceback.print_exc()
            error = f"generation failed: {e}"
        finally:
            self.running = None
            self._finish(job, done, error)

    def _finish(self, job: Job, done: Done | None, error: str | None) -> None:
        """Count a job that left the engine; `error` is sent to it as Failed."""
        if error is not None:
            self.counters["failed"] += 1
            job.sink(Failed(error))
        elif done is None or done.finish_reason == "cancelled":
            self.counters["cancelled"] += 1
        else:
            self.counters["completed"] += 1
        if done is not None:
            self.counters["prompt_tokens"] += done.prompt_tokens
            self.counters["completion_tokens"] += done.completion_tokens
        with self._lock:
            self._pending -= 1

    def batch_stats(self) -> dict:
        b = self.batch
        if b is None:
            return {"configured": self.cfg.batch, "batched": False, "active_rows": int(self.running is not None),
                    "served_serial": self.served_serial,
                    "reason": "kv_quant is on" if self.cfg.batch > 1 else None}
        return {**b.stats(), "served_serial": self.served_serial}

    def stats(self) -> dict:
        running = int(self.running is not None) + (self.batch.running if self.batch else 0)
        out = {"state": self.state, "queued": max(self._pending - running, 0), "running": running,
               "max_queue": self.cfg.max_queue, **self.counters}
        return out
