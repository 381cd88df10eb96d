"""The request path every protocol shares, between its router and the engine.

    router: body --protocol.to_ask()--> Ask --prepare()--> Job --run()--> events --pump()--> encoder

- `Ask` is one generation request normalized at the edge of its protocol (chat messages in the
  chat-template form, or a completion prompt; the sampling fields the client gave; stops, tools,
  limits; the adapter spec already parsed). Nothing below re-parses a request.
- `prepare` runs the protocol's body -> Ask, takes a lease on the model the request names
  (`model_choice.lease_for`: loading it first when it is not loaded, engine/models.py; an
  unknown one is a 404 `model_not_found`), then `make_job` on the render thread (never on the
  event loop): it checks the per-request ceilings (messages, tools, top_logprobs), then the
  tools' parameter schemas (`check_request`), renders the prompt, resolves sampling
  defaults (request > serve flag > the model's generation_config.json > fallback), applies memory
  admission, builds the grammar a structured answer or a forced tool call needs
  (`structured.py`) and checks the adapters are mounted; every refusal is a 4xx `APIError`
  before anything is queued.
- `run` submits the job and yields its events; `pump` is the one Delta/Done/Failed dispatch,
  feeding a protocol's `Encoder` (its stream chunks), or the `Collector` for a response that is
  not streamed.

So stops, tools, the prompt cache and admission behave the same on every surface.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import json
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field

from fastapi.responses import StreamingResponse

from mlxlab.serve import vision
from mlxlab.serve.config import ServeConfig
from mlxlab.serve.engine.gateway import Gateway
from mlxlab.serve.engine.jobs import (
    AdapterSpec,
    Delta,
    Done,
    Event,
    Failed,
    Job,
    NotReady,
    QueueFull,
    Sampling,
    ShuttingDown,
    parse_adapter_spec,
)
from mlxlab.serve.engine.loaded import Loaded
from mlxlab.serve.engine.models import Lease
from mlxlab.serve.http import SSE_HEADERS, APIError, error_type
from mlxlab.serve.model_choice import check_adapters, lease_for, ready_loaded
from mlxlab.serve.structured import Shape, check_tool_schema, grammar_for

FALLBACK = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}
MAX_TOP_LOGPROBS = 20  # OpenAI's bound, on every protocol


# --- the normalized request ------------------------------------------------------------------


@dataclass
class SamplingAsk:
    """The sampling fields as the client sent them (None: not given)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    @classmethod
    def of(cls, body) -> SamplingAsk:
        """The fields a request model has (each protocol offers a subset)."""
        return cls(
            **{
                f.name: getattr(body, f.name)
                for f in dataclasses.fields(cls)
                if hasattr(body, f.name)
            }
        )


@dataclass
class Ask:
    """One generation request, normalized at the edge of its protocol."""

    messages: list[dict] | None = None  # chat, in the chat-template form (normalize_messages)
    messages_field: str = "messages"  # the request field they came from, for errors
    origins: list[str] | None = None  # the request field of each message (None: messages[i])
    prompt: str | list[int] | None = None  # a completion prompt: text or token ids
    tools: list[dict] | None = None  # function tools offered to the model
    tool_schemas: list[tuple] = field(default_factory=list)  # (schema, field) of every tool sent
    template_kwargs: dict | None = None
    max_tokens: int | None = None  # None: the serve default, clamped to what fits
    stops: list[str] = field(default_factory=list)
    sampling: SamplingAsk = field(default_factory=SamplingAsk)
    logprobs: bool = False
    top_logprobs: int = 0
    adapter: AdapterSpec = ()
    shape: Shape = field(default_factory=Shape)  # structured output, forced tool calls


def adapter_spec(spec: str | None) -> AdapterSpec:
    """The request's `adapter` field parsed ("none", "a", "a+b"); 400 when malformed."""
    try:
        return parse_adapter_spec(spec)
    except ValueError as e:
        raise APIError(400, str(e), param="adapter", code="unknown_adapter") from None


def text_of(content, where: str, text_kinds=("text", "input_text", "output_text")) -> str:
    """A message's content as text: a string, or text parts joined; images are refused (they
    belong in user messages: `vision.user_content`). `text_kinds`: the part types that carry
    text in the caller's protocol."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}: must be a string or a list of content parts", param=where)
    parts = []
    for part in content:
        if not isinstance(part, dict):
            raise APIError(400, f"{where}: each content part must be an object", param=where)
        kind = part.get("type")
        if kind in text_kinds:
            if not isinstance(part.get("text"), str):
                raise APIError(400, f"{where}: a text part needs a string 'text'", param=where)
            parts.append(part["text"])
        elif kind in ("image_url", "input_image", "image"):
            raise APIError(
                400,
                f"{where}: images are accepted in user messages only",
                param=where,
                code="vision_not_supported",
            )
        else:
            raise APIError(400, f"{where}: unsupported content part type {kind!r}", param=where)
    return "".join(parts)


def normalize_messages(messages: list[dict]) -> list[dict]:
    """OpenAI chat messages -> what chat templates take (text content, tool-call arguments as objects)."""
    out = []
    for i, m in enumerate(messages):
        role = "system" if m["role"] == "developer" else m["role"]
        where = f"messages[{i}].content"
        images = vision.user_content(m.get("content"), where) if role == "user" else None
        msg = {"role": role, "content": images or text_of(m.get("content"), where)}
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                fn = dict(c["function"])
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"] or "{}")
                    except json.JSONDecodeError as e:
                        raise APIError(
                            400,
                            f"messages[{i}].tool_calls: arguments are not JSON ({e})",
                            param=f"messages[{i}].tool_calls",
                        ) from None
                calls.append({"id": c.get("id"), "type": "function", "function": fn})
            msg["tool_calls"] = calls
        for key in ("name", "tool_call_id", "reasoning_content"):
            if m.get(key) is not None:
                msg[key] = m[key]
        out.append(msg)
    return out


# --- Ask -> Job ----------------------------------------------------------------------------------


def template_refusal(e: Exception, messages: list[dict], origins: list[str] | None) -> APIError:
    """The 400 for messages the chat template rejected: naming the first message that repeats
    the role before it (what templates that insist on alternating turns reject), if one does.
    Templates that render such turns (mlxlab's own, most others) get them as they are."""
    for i in range(1, len(messages)):
        role = messages[i]["role"]
        if role in ("user", "assistant") and messages[i - 1]["role"] == role:
            where = origins[i] if origins else f"messages[{i}]"
            return APIError(
                400,
                f"{where}: this model's chat template does not take two {role} messages in a "
                f"row (merge them into one): {e}",
                param=where,
            )
    return APIError(400, f"the chat template rejected these messages: {e}", param="messages")


def render_chat(
    loaded: Loaded,
    messages: list[dict],
    tools: list[dict] | None = None,
    template_kwargs: dict | None = None,
    origins: list[str] | None = None,
) -> tuple[list[int], int, bool]:
    """(prompt tokens, end of the system prompt in tokens or 0, starts inside a reasoning block);
    `origins`: the request field of each message, for errors."""
    tok = loaded.tokenizer
    if not getattr(tok, "chat_template", None):
        raise APIError(400, "the model has no chat template; use /v1/completions")
    kwargs = dict(template_kwargs or {})
    if tools:
        kwargs["tools"] = tools
    try:
        prompt = tok.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, **kwargs
        )
    except Exception as e:  # jinja's TemplateError and friends: the messages do not fit it
        raise template_refusal(e, messages, origins) from None
    prompt = list(prompt)
    checkpoint = 0
    n_system = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    if 0 < n_system < len(messages):
        try:
            head = tok.apply_chat_template(
                messages[:n_system] + [{"role": "user", "content": ""}], tokenize=True, **kwargs
            )
            checkpoint = next(
                (i for i, (a, b) in enumerate(zip(head, prompt, strict=False)) if a != b), 0
            )
        except Exception:
            checkpoint = 0
    reasoning = False
    if loaded.think:
        start = tok.rfind_think_start(prompt) if hasattr(tok, "rfind_think_start") else -1
        end = tok.rfind_think_end(prompt) if hasattr(tok, "rfind_think_end") else -1
        reasoning = start > end
    return prompt, checkpoint if checkpoint >= 16 else 0, reasoning


def render_text(loaded: Loaded, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, list):
        vocab = loaded.tokenizer.vocab_size
        if any(t < 0 or t >= vocab for t in prompt):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        return list(prompt)
    tokens = list(loaded.tokenizer.encode(prompt))
    if not tokens:
        raise APIError(400, "prompt is empty", param="prompt")
    return tokens


def resolve_sampling(ask: SamplingAsk, cfg: ServeConfig, loaded: Loaded) -> Sampling:
    """Request > serve flag > the model's generation_config.json > built-in fallback."""
    values = {}
    for key in ("temperature", "top_p", "top_k", "min_p"):
        for source in (getattr(ask, key), getattr(cfg, key), loaded.generation_config.get(key)):
            if source is not None:
                values[key] = source
                break
        else:
            values[key] = FALLBACK[key]
    rep = ask.repetition_penalty
    if rep is None:
        rep = loaded.generation_config.get("repetition_penalty")
    bias = None
    if ask.logit_bias:
        bias = {}
        for k, v in ask.logit_bias.items():
            if not (k.isascii() and k.isdigit()) or int(k) >= loaded.tokenizer.vocab_size:
                raise APIError(
                    400, f"logit_bias key {k!r} is not a token id of this model", param="logit_bias"
                )
            bias[int(k)] = v
    return Sampling(
        temperature=float(values["temperature"]),
        top_p=float(values["top_p"]),
        top_k=int(values["top_k"]),
        min_p=float(values["min_p"]),
        seed=None if ask.seed is None else ask.seed % 2**64,  # MLX seeds are uint64
        repetition_penalty=rep if rep and rep != 1.0 else None,
        presence_penalty=ask.presence_penalty or None,
        frequency_penalty=ask.frequency_penalty or None,
        logit_bias=bias,
    )


def completion_limit(
    loaded: Loaded, cfg: ServeConfig, prompt_len: int, requested: int | None
) -> int:
    """max_tokens for the job; raises the memory-admission 400 when the request cannot fit."""
    ceiling = loaded.admission.max_safe_context
    if requested is None:
        room = ceiling - prompt_len
        if room >= 1:
            return min(cfg.max_tokens, room)
        requested = cfg.max_tokens
    reason = loaded.admission.check(prompt_len, requested)
    if reason:
        raise APIError(
            400, reason, type="memory_admission", param="max_tokens", code="context_over_budget"
        )
    return requested


def check_ceilings(cfg: ServeConfig, ask: Ask) -> None:
    """The per-request bounds on work that serve flags set (a 400 naming the limit)."""
    n = len(ask.messages or [])
    if n > cfg.max_messages:
        raise APIError(
            400,
            f"{ask.messages_field}: {n} messages exceed serve.max_messages ({cfg.max_messages})",
            param=ask.messages_field,
            code="too_many_messages",
        )
    tools = ask.tools or []
    n = max(len(tools), len(ask.tool_schemas))
    if n > cfg.max_tools:
        raise APIError(
            400,
            f"tools: {n} tools exceed serve.max_tools ({cfg.max_tools})",
            param="tools",
            code="too_many_tools",
        )
    if tools:
        size = len(json.dumps(tools, ensure_ascii=False).encode())
        if size > cfg.max_tools_kb * 1e3:
            raise APIError(
                400,
                f"tools: the tool definitions take {size / 1e3:.0f} KB, over serve.max_tools_kb "
                f"({cfg.max_tools_kb:g} KB)",
                param="tools",
                code="tools_too_large",
            )
    if ask.top_logprobs > MAX_TOP_LOGPROBS:
        raise APIError(
            400,
            f"top_logprobs: at most {MAX_TOP_LOGPROBS}, got {ask.top_logprobs}",
            param="top_logprobs",
        )


# A render thread: prompt rendering and tokenization (seconds for a multi-megabyte prompt) run
# here, one at a time, never on the event loop, so one large request cannot stall the others.
_RENDER = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mlxlab-render")


async def off_loop(fn, *args):
    """`fn(*args)` on the render thread, awaited; its exceptions (APIError) raise here."""
    return await asyncio.get_running_loop().run_in_executor(_RENDER, functools.partial(fn, *args))


async def prepare(
    gateway: Gateway, cfg: ServeConfig, build: Callable[[], Ask], model: str | None = None
) -> Job:
    """`build()` (the protocol's body -> Ask), a lease on the model the request names (`model`:
    its `model` field), then `make_job`, on the render thread: what every router calls, so
    nothing that grows with the request runs on the event loop. The job holds the lease; the
    engine releases it when the job leaves (or `run`, when it is never queued)."""
    ask = await off_loop(build)
    lease = await lease_for(gateway, model)
    try:
        await vision.fetch_images(cfg, lease.loaded, ask)  # image URLs, when allowed (async)
        job = await off_loop(lambda: make_job(gateway, cfg, ask, lease))
    except BaseException:
        lease.release()
        raise
    job.lease = lease
    return job


def check_request(cfg: ServeConfig, ask: Ask) -> None:
    """What a request must pass before any rendering: the ceilings, then (bounded by them) each
    tool's parameter schema, offered or not, as OpenAI checks them."""
    check_ceilings(cfg, ask)
    for params, where in ask.tool_schemas:
        check_tool_schema(params, where)


def _text_chars(messages: list[dict] | None, prompt) -> int:
    """Characters of text in the messages (string contents and the `text` of content parts; not
    image data) or in a prompt string."""
    if messages is None:
        return len(prompt) if isinstance(prompt, str) else 0
    total = 0
    for m in messages:
        content = m.get("content")
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(
                len(p["text"])
                for p in content
                if isinstance(p, dict) and isinstance(p.get("text"), str)
            )
    return total


# Slack for normalizers that shorten text before it is split into tokens (NFKC composes
# characters): the length bound refuses only text far past the context.
LENGTH_SLACK = 4


def check_length(loaded: Loaded, ask: Ask) -> None:
    """A 400 before tokenizing for text too long to fit the context whatever its tokens: each
    token stands for at most `loaded.token_chars` characters, so a prompt of many megabytes is
    refused at once instead of holding the render thread for seconds."""
    field = ask.messages_field if ask.messages is not None else "prompt"
    chars = _text_chars(ask.messages, ask.prompt)
    at_least = chars // (loaded.token_chars * LENGTH_SLACK)
    ceiling = loaded.admission.max_safe_context
    if at_least > ceiling:
        loaded.admission.rejected += 1  # counted with the other context_over_budget refusals
        raise APIError(
            400,
            f"{field}: {chars} characters are more than {at_least} tokens, past this server's "
            f"context of {ceiling} tokens",
            type="memory_admission",
            param=field,
            code="context_over_budget",
        )


def make_job(gateway: Gateway, cfg: ServeConfig, ask: Ask, lease: Lease | None = None) -> Job:
    """The engine job for `ask` on the model `lease` holds (the default without one); a 4xx
    APIError for anything that cannot run, before queueing."""
    check_request(cfg, ask)
    loaded = lease.loaded if lease is not None else ready_loaded(gateway)
    check_length(loaded, ask)
    checkpoint, reasoning = 0, False
    seen = vision.plan(cfg, loaded, ask)  # images: checked, numbered, through the processor
    images = seen is not None and seen.inputs is not None
    if images:
        prompt, reasoning = seen.prompt, seen.reasoning
    elif ask.messages is not None:
        messages = seen.messages if seen is not None else ask.messages
        prompt, checkpoint, reasoning = render_chat(
            loaded, messages, ask.tools, ask.template_kwargs, ask.origins
        )
    else:
        prompt = render_text(loaded, ask.prompt)
    # The admission check and the KV reservation together, under the models' lock: no load is
    # planned between them (so none evicts or crowds out what this request was admitted with).
    with gateway.models.lock:
        if images:
            limit = vision.completion_limit(
                loaded, cfg, len(prompt), ask.max_tokens, seen.image_bytes
            )
        else:
            limit = completion_limit(loaded, cfg, len(prompt), ask.max_tokens)
        if lease is not None:
            lease.reserve(len(prompt) + limit)
    if not images:
        seen = vision.text_job(loaded, ask, prompt, seen)  # a VLM only mlx-vlm runs
    sampling = resolve_sampling(ask.sampling, cfg, loaded)
    grammar = grammar_for(ask.shape, ask.tools, loaded, reasoning)
    check_adapters(gateway, loaded, ask.adapter)
    return Job(
        prompt=prompt,
        max_tokens=limit,
        sink=None,
        sampling=sampling,
        stops=ask.stops,
        tools=ask.tools,
        reasoning=reasoning,
        logprobs=ask.logprobs,
        top_logprobs=ask.top_logprobs,
        checkpoint=checkpoint,
        adapter=ask.adapter,
        grammar=grammar,
        vision=seen.inputs if seen is not None else None,
        preamble=seen.preamble if seen is not None else "",
        default_limit=ask.max_tokens is None,
        slow_s=cfg.read_timeout_s,
    )


# --- Job -> events -> encoders -------------------------------------------------------------------


_GONE = object()  # the client of a response that is not streamed left


async def run(gateway: Gateway, job: Job, receive=None) -> AsyncIterator[Event]:
    """Submit `job` and yield its events; the job is cancelled if the consumer goes away.

    `receive`: the request's ASGI receive, its body already read (`http.BodyLimit`), for a
    response that is not streamed: a task awaits it while the job runs, and the client leaving
    (`http.disconnect`: it closed the connection, whether or not it read anything) cancels the
    job at once, so the engine stops it before its next token or prefill chunk. (A streamed
    response is cancelled by the server when its client leaves.) This used to poll
    `request.is_disconnected()` when no event had come for 0.25 s, which a generation sending
    a token every few milliseconds never gave it: an abandoned answer ran to max_tokens.
    """
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()

    def sink(ev):
        try:
            loop.call_soon_threadsafe(events.put_nowait, ev)
        except RuntimeError:  # the event loop is gone (shutdown): nobody is listening
            job.cancelled.set()

    job.sink = sink
    try:
        gateway.submit(job)
    except (QueueFull, NotReady) as e:
        if job.lease is not None:  # never queued: the engine will not release it
            job.lease.release()
        if isinstance(e, QueueFull):
            raise APIError(
                503,
                f"server busy: {e}",
                type="service_unavailable",
                code="queue_full",
                headers={"Retry-After": "2"},
            ) from None
        if isinstance(e, ShuttingDown):
            raise failed_error(shutting_down(str(e))) from None
        raise APIError(
            503, str(e), type="service_unavailable", code="not_ready", headers={"Retry-After": "5"}
        ) from None

    async def watch():
        try:
            while (await receive())["type"] != "http.disconnect":
                pass
        except Exception:  # noqa: BLE001 - a connection that cannot be read is a client gone
            pass
        job.cancelled.set()
        events.put_nowait(_GONE)

    watcher = asyncio.ensure_future(watch()) if receive is not None else None
    preamble = job.preamble  # the image table: sent before the model's first text
    try:
        while True:
            ev = await events.get()
            if ev is _GONE:
                return
            if isinstance(ev, Done) and ev.finish_reason == "cancelled" and job.aborted:
                ev = shutting_down(job.aborted)
            if preamble and not isinstance(ev, Failed):
                yield Delta("content", preamble)
            preamble = ""
            yield ev
            if isinstance(ev, (Done, Failed)):
                return
    finally:
        job.cancelled.set()  # a no-op when the job has finished
        if watcher is not None:
            watcher.cancel()


class Encoder:
    """A protocol's view of one job's events: each method returns the wire chunks (SSE text) to
    send for it. Encoders are pure, so tests drive them without a model (`encode`)."""

    def start(self) -> list[str]:
        return []

    def delta(self, ev: Delta) -> list[str]:
        return []

    def done(self, ev: Done) -> list[str]:
        return []

    def failed(self, ev: Failed) -> list[str]:
        return []

    def end(self) -> list[str]:
        return []


def feed(encoder: Encoder, ev: Event) -> list[str]:
    """The one Delta/Done/Failed dispatch."""
    if isinstance(ev, Delta):
        return encoder.delta(ev)
    if isinstance(ev, Done):
        return encoder.done(ev)
    return encoder.failed(ev)


def encode(encoder: Encoder, events: Iterable[Event]) -> list[str]:
    """Every chunk `encoder` sends for `events` (what `pump` streams), without a server."""
    return [*encoder.start(), *(c for ev in events for c in feed(encoder, ev)), *encoder.end()]


async def pump(events: AsyncIterator[Event], encoder: Encoder) -> AsyncIterator[str]:
    for chunk in encoder.start():
        yield chunk
    async for ev in events:
        for chunk in feed(encoder, ev):
            yield chunk
    for chunk in encoder.end():
        yield chunk


def shutting_down(reason: str) -> Failed:
    """What a job the shutdown stopped (aborted, or refused at submit) answers."""
    return Failed(reason, 503, "shutting_down")


def failed_error(ev: Failed) -> APIError:
    """The APIError a failed job answers (each protocol's shape maps it): its status and code."""
    headers = {"Retry-After": "10"} if ev.status == 503 else {}
    return APIError(
        ev.status, ev.message, type=error_type(ev.status), code=ev.code, headers=headers
    )


class Collector(Encoder):
    """The encoder of a response that is not streamed: gathers the text, reasoning and logprobs;
    a failure is a 500."""

    def __init__(self):
        self.parts: dict[str, list[str]] = {"content": [], "reasoning": []}
        self.logprobs: list[dict] = []
        self.content_logprobs: list[dict] = []  # the answer text's own (not reasoning, markup)
        self.finished: Done | None = None

    def delta(self, ev: Delta) -> list[str]:
        self.parts["reasoning" if ev.kind == "reasoning" else "content"].append(ev.text)
        self.logprobs.extend(ev.logprobs or [])
        if ev.kind == "content":
            self.content_logprobs.extend(ev.logprobs or [])
        return []

    def done(self, ev: Done) -> list[str]:
        self.finished = ev
        return []

    def failed(self, ev: Failed) -> list[str]:
        raise failed_error(ev)

    @property
    def content(self) -> str:
        return "".join(self.parts["content"])

    @property
    def reasoning(self) -> str:
        return "".join(self.parts["reasoning"])


async def collect(gateway: Gateway, job: Job, receive) -> Collector:
    """Run a job to the end for a response that is not streamed; `receive`: the request's
    (`request.receive`), whose disconnect cancels the job (`run`)."""
    got = Collector()
    async for _ in pump(run(gateway, job, receive), got):
        pass
    if got.finished is None:
        raise APIError(499, "client closed the request")
    return got


_END = object()


async def start(gateway: Gateway, job: Job) -> AsyncIterator[Event]:
    """The events of a job for a streamed response, its first event already awaited: submitting
    happens here, so queue-full and not-ready errors, and a job that failed before its first
    token, are raised before the response has started (and answer as plain JSON errors)."""
    events = run(gateway, job)
    try:
        first = await events.__anext__()
    except StopAsyncIteration:
        first = _END
    if isinstance(first, Failed):
        Collector().failed(first)

    async def chained():
        if first is _END:
            return
        yield first
        async for ev in events:
            yield ev

    return chained()


async def stream(gateway: Gateway, job: Job, encoder: Encoder):
    """A streamed response: the job's events through `encoder`, as server-sent events."""
    events = await start(gateway, job)
    return StreamingResponse(
        pump(events, encoder), media_type="text/event-stream", headers=SSE_HEADERS
    )
