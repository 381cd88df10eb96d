"""The engine: one worker thread owns the model; requests reach it through a gateway and a lane.

    HTTP handlers --Job--> Gateway (bounded queue, admission already passed) --> lane --> events
                                                                                 (thread-safe sink)

The worker thread loads the model, then runs jobs one at a time on the serial lane; the HTTP
event loop only renders prompts, queues jobs and forwards events, so it never waits on MLX.
`Gateway.lane_for` is where a batched lane (rows joining and leaving between decode steps) will
be chosen for the requests that can batch; both lanes would run on this same thread, so they
never use the model at the same time. Adapters will change which LoRA deltas the lane applies
per job; the job already carries its adapter spec, which namespaces the prompt cache.

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
        from mlxlab.serve import admission
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
        self.admission = admission.measure(self.model, budget, cfg.prefill_step)
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

    name = "serial"

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
        from mlxlab.serve.adapters import parse_spec

        m = self.m
        ids = parse_spec(job.adapter)
        try:
            m.adapters.check(ids)  # it may have been unmounted while the job waited
        except KeyError as e:
            raise JobError(str(e).strip("'\"")) from None
        m.adapters.selection.ids = ids
        try:
            return self._run(job, ids)
        finally:
            m.adapters.selection.ids = ()

    def _run(self, job: Job, ids: tuple[str, ...]) -> Done:
        import mlx.core as mx
        from mlx_lm.generate import generate_step
        from mlx_lm.models.cache import make_prompt_cache
        from mlx_lm.sample_utils import make_logits_processors, make_sampler

        from mlxlab.serve.output import OutputParser

        m, s = self.m, job.sampling
        for i in ids:
            m.adapters.mounted[i].requests += 1
        t0 = time.perf_counter()
        namespace = (m.model_id, "+".join(ids) or "none")
        cache, cached = m.cache.fetch(namespace, job.prompt)
        if cache is None:
            cache = make_prompt_cache(m.model)
        # Prefill all but the last prompt token here, storing checkpoints on the way: the end of
        # the system prompt (shared by every conversation with it) and the end of this prompt
        # (the prefix of the next turn even when the answer does not re-tokenize the same way).
        end = len(job.prompt) - 1
        if job.checkpoint and cached < job.checkpoint < end:
            self._prefill(cache, job.prompt[cached:job.checkpoint])
            m.cache.insert(namespace, job.prompt[:job.checkpoint], cache, kind="system")
            cached_now = job.checkpoint
        else:
            cached_now = cached
        if cached_now < end:
            self._prefill(cache, job.prompt[cached_now:end])
            m.cache.insert(namespace, job.prompt[:end], cache, kind="user")
        if s.seed is not None:
            mx.random.seed(s.seed)
        sampler = make_sampler(temp=s.temperature, top_p=s.top_p if s.top_p < 1.0 else 0.0,
                               min_p=s.min_p, top_k=s.top_k)
        processors = make_logits_processors(s.logit_bias, s.repetition_penalty, 64,
                                            s.presence_penalty, 64, s.frequency_penalty, 64)
        parser = OutputParser(job.stops, m.tool, job.tools, m.think, job.reasoning)
        detok = m.tokenizer.detokenizer
        detok.reset()
        out_tokens: list[int] = []
        finish, ttft = "length", 0.0

        def send(deltas, lp=None):
            for i, (kind, text) in enumerate(deltas):
                job.sink(Delta(kind, text, lp if i == len(deltas) - 1 else None))
            if not deltas and lp:
                job.sink(Delta("content", "", lp))

        steps = generate_step(mx.array(job.prompt[end:]), m.model, max_tokens=job.max_tokens,
                              sampler=sampler, logits_processors=processors, prompt_cache=cache,
                              prefill_step_size=self.cfg.prefill_step)
        for token, logprobs in steps:
            if not out_tokens:
                ttft = time.perf_counter() - t0
            token = int(token)
            out_tokens.append(token)  # fed to the cache already (generate_step runs one ahead)
            if job.cancelled.is_set():
                finish = "cancelled"
                break
            if token in m.eos:
                finish = "stop"
                break
            lp = self._logprobs(token, logprobs, job.top_logprobs) if job.logprobs else None
            if token in m.hidden:
                send([], lp)
                continue
            detok.add_token(token)
            send(parser.feed(detok.last_segment), lp)
            if parser.stopped is not None:
                finish = "stop"
                break
        detok.finalize()  # finish stays "length" when generate_step ended the loop at max_tokens
        if parser.stopped is None and finish != "cancelled":
            send(parser.feed(detok.last_segment) + parser.finish())
        steps.close()
        if parser.calls and finish != "cancelled":
            finish = "tool_calls"
        if finish != "cancelled":
            # The cache holds prompt + every token generated (each was fed as the next one was computed).
            m.cache.insert(namespace, job.prompt + out_tokens, cache, copy_cache=False)
        done = Done(finish, len(job.prompt), len(out_tokens), cached, parser.calls, parser.stopped,
                    time.perf_counter() - t0, ttft)
        job.sink(done)
        return done

    def _logprobs(self, token: int, logprobs, top: int) -> list[dict]:
        import mlx.core as mx

        tok = self.m.tokenizer

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
        self.running: Job | None = None
        self._thread = threading.Thread(target=self._work, name="mlxlab-engine", daemon=True)

    def start(self) -> Gateway:
        self._thread.start()
        return self

    def lane_for(self, job: Job) -> str:
        return "serial"

    @property
    def pending(self) -> int:
        return self._pending

    def submit(self, job: Job) -> None:
        if self.state != "ready":
            raise NotReady(self.error or f"the engine is {self.state}")
        with self._lock:
            if self._pending >= self.cfg.max_queue:
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
            lanes = {"serial": SerialLane(self.loaded, self.cfg)}
            self.state = "ready"
        except BaseException as e:  # noqa: BLE001 - reported through /health
            self.state, self.error = "failed", f"failed to load: {e}"
            self.ready.set()
            return
        self.ready.set()
        while True:
            job = self._queue.get()
            if job is None:
                self.state = "stopped"
                return
            if not isinstance(job, Job):  # an admin task (adapter mount/unmount)
                job()
                continue
            self.running = job
            try:
                if job.cancelled.is_set():
                    job.sink(Done("cancelled", len(job.prompt), 0, 0))
                    self.counters["cancelled"] += 1
                else:
                    done = lanes[self.lane_for(job)].run(job)
                    self.counters["cancelled" if done.finish_reason == "cancelled" else "completed"] += 1
                    self.counters["prompt_tokens"] += done.prompt_tokens
                    self.counters["completion_tokens"] += done.completion_tokens
            except JobError as e:
                self.counters["failed"] += 1
                job.sink(Failed(str(e)))
            except Exception as e:  # noqa: BLE001 - one request failed, the engine carries on
                traceback.print_exc()
                self.counters["failed"] += 1
                job.sink(Failed(f"generation failed: {e}"))
            finally:
                self.running = None
                with self._lock:
                    self._pending -= 1

    def stats(self) -> dict:
        out = {"state": self.state, "queued": max(self._pending - (self.running is not None), 0),
               "running": int(self.running is not None), "max_queue": self.cfg.max_queue,
               **self.counters}
        return out
