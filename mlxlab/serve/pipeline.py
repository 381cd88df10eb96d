"""The request path every protocol shares: prompt rendering, sampling defaults, admission, and
running a job on the engine as an async stream of events.

Protocol routers (OpenAI chat and completions here; Anthropic Messages and OpenAI Responses
convert their bodies to the same chat messages) call these, so stop handling, tools, the prompt
cache and admission behave the same on every surface.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

from mlxlab.config import ServeConfig
from mlxlab.serve.engine import Delta, Done, Failed, Gateway, Job, NotReady, QueueFull, Sampling
from mlxlab.serve.protocol import APIError

FALLBACK = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}


def text_of(content, where: str, text_kinds=("text", "input_text", "output_text")) -> str:
    """A message's content as text: a string, or text parts joined; images are refused (no vision).
    `text_kinds`: the part types that carry text in the caller's protocol."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        kind = part.get("type")
        if kind in text_kinds:
            if not isinstance(part.get("text"), str):
                raise APIError(400, f"{where}: a text part needs a string 'text'", param=where)
            parts.append(part["text"])
        elif kind in ("image_url", "input_image", "image"):
            raise APIError(400, f"{where}: image input needs a vision model; this server runs a "
                                "text-only model", param=where, code="vision_not_supported")
        else:
            raise APIError(400, f"{where}: unsupported content part type {kind!r}", param=where)
    return "".join(parts)


def normalize_messages(messages: list[dict]) -> list[dict]:
    """OpenAI chat messages -> what chat templates take (text content, tool-call arguments as objects)."""
    out = []
    for i, m in enumerate(messages):
        role = "system" if m["role"] == "developer" else m["role"]
        msg = {"role": role, "content": text_of(m.get("content"), f"messages[{i}].content")}
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                fn = dict(c["function"])
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"] or "{}")
                    except json.JSONDecodeError as e:
                        raise APIError(400, f"messages[{i}].tool_calls: arguments are not JSON ({e})",
                                       param=f"messages[{i}].tool_calls") from None
                calls.append({"id": c.get("id"), "type": "function", "function": fn})
            msg["tool_calls"] = calls
        for key in ("name", "tool_call_id", "reasoning_content"):
            if m.get(key) is not None:
                msg[key] = m[key]
        out.append(msg)
    return out


def render_chat(loaded, messages: list[dict], tools: list[dict] | None = None,
                template_kwargs: dict | None = None) -> tuple[list[int], int, bool]:
    """(prompt tokens, end of the system prompt in tokens or 0, starts inside a reasoning block)."""
    tok = loaded.tokenizer
    if not getattr(tok, "chat_template", None):
        raise APIError(400, "the model has no chat template; use /v1/completions")
    kwargs = dict(template_kwargs or {})
    if tools:
        kwargs["tools"] = tools
    try:
        prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
    except Exception as e:  # jinja's TemplateError and friends: the messages do not fit the template
        raise APIError(400, f"the chat template rejected these messages: {e}", param="messages") from None
    prompt = list(prompt)
    checkpoint = 0
    n_system = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    if 0 < n_system < len(messages):
        try:
            head = tok.apply_chat_template(messages[:n_system] + [{"role": "user", "content": ""}],
                                           tokenize=True, **kwargs)
            checkpoint = next((i for i, (a, b) in enumerate(zip(head, prompt, strict=False)) if a != b), 0)
        except Exception:
            checkpoint = 0
    reasoning = False
    if loaded.think:
        start = tok.rfind_think_start(prompt) if hasattr(tok, "rfind_think_start") else -1
        end = tok.rfind_think_end(prompt) if hasattr(tok, "rfind_think_end") else -1
        reasoning = start > end
    return prompt, checkpoint if checkpoint >= 16 else 0, reasoning


def render_text(loaded, prompt) -> list[int]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        vocab = loaded.tokenizer.vocab_size
        if any(t < 0 or t >= vocab for t in prompt):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        return list(prompt)
    text = prompt[0] if isinstance(prompt, list) else prompt
    return list(loaded.tokenizer.encode(text))


def sampling(req, cfg: ServeConfig, loaded) -> Sampling:
    """Request > serve flag > the model's generation_config.json > built-in fallback."""
    values = {}
    for key in ("temperature", "top_p", "top_k", "min_p"):
        for source in (getattr(req, key, None), getattr(cfg, key), loaded.generation_config.get(key)):
            if source is not None:
                values[key] = source
                break
        else:
            values[key] = FALLBACK[key]
    rep = getattr(req, "repetition_penalty", None)
    if rep is None:
        rep = loaded.generation_config.get("repetition_penalty")
    bias = None
    if getattr(req, "logit_bias", None):
        bias = {}
        for k, v in req.logit_bias.items():
            if not k.lstrip("-").isdigit() or not 0 <= int(k) < loaded.tokenizer.vocab_size:
                raise APIError(400, f"logit_bias key {k!r} is not a token id of this model", param="logit_bias")
            bias[int(k)] = v
    return Sampling(temperature=float(values["temperature"]), top_p=float(values["top_p"]),
                    top_k=int(values["top_k"]), min_p=float(values["min_p"]),
                    seed=getattr(req, "seed", None), repetition_penalty=rep if rep and rep != 1.0 else None,
                    presence_penalty=getattr(req, "presence_penalty", None) or None,
                    frequency_penalty=getattr(req, "frequency_penalty", None) or None, logit_bias=bias)


def completion_limit(loaded, cfg: ServeConfig, prompt_len: int, requested: int | None) -> int:
    """max_tokens for the job; raises the memory-admission 400 when the request cannot fit."""
    ceiling = loaded.admission.max_safe_context
    if requested is None:
        room = ceiling - prompt_len
        if room >= 1:
            return min(cfg.max_tokens, room)
        requested = cfg.max_tokens
    reason = loaded.admission.check(prompt_len, requested)
    if reason:
        raise APIError(400, reason, type="memory_admission", param="max_tokens", code="context_over_budget")
    return requested


def chat_job(gateway: Gateway, cfg: ServeConfig, messages: list[dict], req, *, tools: list[dict] | None = None,
             stops: list[str] | None = None, limit: int | None = None, logprobs: bool = False,
             top_logprobs: int = 0, template_kwargs: dict | None = None) -> Job:
    """A job for chat `messages` (already normalized); `req` supplies the sampling fields."""
    loaded = ready_loaded(gateway)
    prompt, checkpoint, reasoning = render_chat(loaded, messages, tools, template_kwargs)
    return make_job(loaded, cfg, prompt, req, tools=tools, stops=stops, limit=limit, logprobs=logprobs,
                    top_logprobs=top_logprobs, reasoning=reasoning, checkpoint=checkpoint)


def make_job(loaded, cfg: ServeConfig, prompt: list[int], req, *, tools: list[dict] | None = None,
             stops: list[str] | None = None, limit: int | None = None, logprobs: bool = False,
             top_logprobs: int = 0, reasoning: bool = False, checkpoint: int = 0) -> Job:
    """A job for token `prompt`: admission, sampling defaults and the adapter spec checked here."""
    limit = completion_limit(loaded, cfg, len(prompt), limit)
    return Job(prompt=prompt, max_tokens=limit, sink=None, sampling=sampling(req, cfg, loaded), stops=stops or [],
               tools=tools, reasoning=reasoning, logprobs=logprobs, top_logprobs=top_logprobs,
               checkpoint=checkpoint, adapter=adapter_spec(loaded, getattr(req, "adapter", None)))


def adapter_spec(loaded, spec: str | None) -> str:
    """The request's `adapter` field checked against the mounted adapters: "none", "a" or "a+b"."""
    from mlxlab.serve.adapters import parse_spec

    try:
        ids = parse_spec(spec)
        loaded.adapters.check(ids)
    except (ValueError, KeyError) as e:
        raise APIError(400, str(e).strip("'\""), param="adapter", code="unknown_adapter") from None
    return "+".join(ids) or "none"


def ready_loaded(gateway: Gateway):
    if gateway.state != "ready":
        raise APIError(503, gateway.error or f"the model is {gateway.state}; try again shortly",
                       type="service_unavailable", code="not_ready", headers={"Retry-After": "5"})
    return gateway.loaded


async def run(gateway: Gateway, job: Job, is_disconnected=None) -> AsyncIterator[object]:
    """Submit `job` and yield its events; the job is cancelled if the consumer goes away.

    `is_disconnected` (an async callable) is polled while waiting, for responses that are not
    streamed (a streamed response is cancelled by the server when its client leaves).
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
    except QueueFull as e:
        raise APIError(503, f"server busy: {e}", type="service_unavailable", code="queue_full",
                       headers={"Retry-After": "2"}) from None
    except NotReady as e:
        raise APIError(503, str(e), type="service_unavailable", code="not_ready",
                       headers={"Retry-After": "5"}) from None
    try:
        while True:
            if is_disconnected is None:
                ev = await events.get()
            else:
                try:
                    ev = await asyncio.wait_for(events.get(), timeout=0.25)
                except asyncio.TimeoutError:
                    if await is_disconnected():
                        job.cancelled.set()
                        return
                    continue
            yield ev
            if isinstance(ev, (Done, Failed)):
                return
    finally:
        job.cancelled.set()  # a no-op when the job has finished


@dataclass
class Collected:
    content: str
    reasoning: str
    logprobs: list
    done: Done


async def collect(gateway: Gateway, job: Job, is_disconnected) -> Collected:
    """Run a job to the end for a response that is not streamed."""
    content, reasoning, logprobs, done = [], [], [], None
    async for ev in run(gateway, job, is_disconnected):
        if isinstance(ev, Delta):
            (reasoning if ev.kind == "reasoning" else content).append(ev.text)
            logprobs.extend(ev.logprobs or [])
        elif isinstance(ev, Done):
            done = ev
        elif isinstance(ev, Failed):
            raise APIError(500, ev.message, type="server_error")
    if done is None:
        raise APIError(499, "client closed the request")
    return Collected("".join(content), "".join(reasoning), logprobs, done)


_END = object()


async def start(gateway: Gateway, job: Job) -> AsyncIterator[object]:
    """The events of a job for a streamed response, its first event already awaited: submitting
    happens here, so queue-full and not-ready errors are raised before the response has started
    (and answer as plain JSON errors)."""
    events = run(gateway, job)
    try:
        first = await events.__anext__()
    except StopAsyncIteration:
        first = _END

    async def chained():
        if first is _END:
            return
        yield first
        async for ev in events:
            yield ev

    return chained()
