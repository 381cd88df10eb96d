"""The request path every protocol shares, between its router and the engine.

    router: body --protocol.to_ask()--> Ask --prepare()--> Job --answer.run()--> events
        --answer.pump()--> encoder

- `Ask` (ask.py) is one generation request normalized at the edge of its protocol (chat messages
  in the chat-template form, or a completion prompt; the sampling fields the client gave; stops,
  tools, limits; the adapter spec already parsed). Nothing below re-parses a request.
- `prepare` (here) runs the protocol's body -> Ask, takes a lease on the model the request names
  (`model_choice.lease_for`: loading it first when it is not loaded, engine/models.py; an
  unknown one is a 404 `model_not_found`), then `make_job` on the render thread (never on the
  event loop): it checks the per-request ceilings (messages, tools, top_logprobs), then the
  tools' parameter schemas (`check_request`), renders the prompt, resolves sampling
  defaults (request > serve flag > the model's generation_config.json > fallback; the rendering
  and the defaults are ask.py's), applies memory admission, builds the grammar a structured
  answer or a forced tool call needs (`structured.py`) and checks the adapters are mounted; every
  refusal is a 4xx `APIError` before anything is queued.
- `run` (answer.py) submits the job and yields its events; `pump` is the one Delta/Done/Failed
  dispatch, feeding a protocol's `Encoder` (its stream chunks), or the `Collector` for a response
  that is not streamed (`collect`, `stream`).

So stops, tools, the prompt cache and admission behave the same on every surface.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
from collections.abc import Callable

from mlxlab.serve import vision
from mlxlab.serve.ask import Ask, completion_limit, render_chat, render_text, resolve_sampling
from mlxlab.serve.config import ServeConfig
from mlxlab.serve.engine.gateway import Gateway
from mlxlab.serve.engine.jobs import Job
from mlxlab.serve.engine.loaded import Loaded
from mlxlab.serve.engine.models import Lease
from mlxlab.serve.http import APIError
from mlxlab.serve.model_choice import check_adapters, lease_for, ready_loaded
from mlxlab.serve.structured import check_tool_schema, grammar_for

MAX_TOP_LOGPROBS = 20  # OpenAI's bound, on every protocol


# --- Ask -> Job ----------------------------------------------------------------------------------


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
