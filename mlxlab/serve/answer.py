"""The output side of the request path (pipeline.py): a job's events to the client.

- `run` submits the job and yields its events (a queue-full or not-ready refusal is a 503; the
  client leaving cancels the job): `submit`, then `read`, which a caller may also call apart.
- `pump` is the one Delta/Done/Failed dispatch (`feed`), feeding a protocol's `Encoder` (its
  stream chunks), or the `Collector` for a response that is not streamed; `encode` does the same
  without a server, for tests.
- `collect` runs a job to the end for a response that is not streamed; `start` / `stream` answer a
  streamed one as server-sent events, refusals raised before the response has started.
- `shutting_down` / `failed_error`: what a failed or stopped job answers.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable

from fastapi.responses import StreamingResponse

from mlxlab.serve.engine.gateway import Gateway
from mlxlab.serve.engine.jobs import (
    Delta,
    Done,
    Event,
    Failed,
    Job,
    NotReady,
    QueueFull,
    ShuttingDown,
)
from mlxlab.serve.http import SSE_HEADERS, APIError, error_type

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
    events = submit(gateway, job)
    async with contextlib.aclosing(read(job, events, receive)) as evs:  # (its finally: now)
        async for ev in evs:
            yield ev


async def client_gone(receive) -> None:
    """Return once the client has left: the request's ASGI `receive` (its body already read)
    says `http.disconnect`, or cannot be read."""
    try:
        while (await receive())["type"] != "http.disconnect":
            pass
    except Exception:  # noqa: BLE001 - a connection that cannot be read is a client gone
        pass


async def read(job: Job, events: asyncio.Queue, receive=None) -> AsyncIterator[Event]:
    """The events of a submitted job (`submit`), to its Done or Failed; the job is cancelled if
    the consumer goes away, or (with `receive`) when the client leaves."""

    async def watch():
        await client_gone(receive)
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


def submit(gateway: Gateway, job: Job) -> asyncio.Queue:
    """Submit `job`, its events to arrive in the queue returned (`read` reads them); a full
    queue or a server not ready is raised here, as the APIError it answers."""
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

    return events


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
