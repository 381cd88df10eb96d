"""HTTP plumbing every API folder shares: the protocol-neutral `APIError`, a route class that
answers a router's errors in that protocol's shape, the ASGI middleware that stamps
`X-Request-ID` and counts exchanges in flight (the drain waits on that count), and the one that
reads each request's body within a size cap and a deadline before the app sees it (`BodyLimit`).

Each protocol owns its error shape: its router is built with `protocol_route(shape)`, where
`shape(err) -> (status, body)`. The route answers, in that shape: `APIError`s raised by the
handler, body validation errors (400, the first problem named; a JSON route's body sent under
another Content-Type is a 400 that says so), a JSON body holding a lone UTF-16 surrogate or a
NaN/Infinity literal (400 naming the field, before the handler), unexpected exceptions (500),
and, while the server drains, every new request (503 + Retry-After).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import uuid
from collections.abc import Callable
from typing import Annotated

from fastapi import params
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BeforeValidator
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

Shape = Callable[["APIError"], tuple[int, dict]]


def _integral(value):
    """JSON has one kind of number: 16.0 is the integer 16, as JSON Schema's "integer" (which
    the OpenAPI schema publishes) says; pydantic's strict int would refuse it."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


Int = Annotated[int, BeforeValidator(_integral)]
"""An integer field of a request model (strict otherwise: no strings, no booleans)."""
OptInt = Annotated[int | None, BeforeValidator(_integral)]
"""An optional one. (Not `Int | None`: pydantic would then write a Field's bounds into the
JSON schema as `ge`/`le`, which JSON Schema does not know, instead of minimum/maximum.)"""


ERROR_TYPES = {404: "not_found_error", 500: "server_error", 503: "service_unavailable"}


def error_type(status: int) -> str:
    """The error `type` of a status the engine or a model chose (a 4xx otherwise: a bad request)."""
    return ERROR_TYPES.get(status, "invalid_request_error")


class APIError(Exception):
    """An error to answer: HTTP status, message, and OpenAI-style type/param/code (each protocol's
    shape picks what it shows)."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type,
            param,
            code,
        )
        self.headers = headers or {}


def draining_error() -> APIError:
    return APIError(
        503,
        "the server is shutting down",
        type="service_unavailable",
        code="draining",
        headers={"Retry-After": "10"},
    )


def validation_error(exc: RequestValidationError) -> APIError:
    """A 400 naming the first problem (and how many more there are)."""
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return APIError(400, f"malformed JSON body: {first.get('msg')}")
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return APIError(400, f"{param + ': ' if param else ''}{first.get('msg')}{more}", param=param)


# What can put a lone UTF-16 surrogate in a parsed JSON string: a high surrogate escape not
# followed by a low one, a low one not after a high one, or the raw UTF-8 bytes of a surrogate
# (json.loads reads bytes with "surrogatepass"). A valid pair (an escaped emoji) matches none,
# so ordinary bodies are never parsed twice; a match is confirmed by a parse.
_LONE_SURROGATE = re.compile(
    rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F])"
    rb"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2}"
    rb"|\xed[\xa0-\xbf]"
)


def is_json_type(content_type: str | None) -> bool:
    """Whether FastAPI reads a body of this Content-Type as JSON: application/json or
    application/*+json, any case, parameters ignored (a missing header: no)."""
    kind = (content_type or "").split(";")[0].strip().lower()
    major, _, minor = kind.partition("/")
    return major == "application" and (minor == "json" or minor.endswith("+json"))


def unicode_problem(body: bytes) -> APIError | None:
    """A 400 for a JSON body whose strings hold a lone surrogate ("\\ud800" with no pair): valid
    JSON, but not text any tokenizer, template or log can encode. UTF-16 and UTF-32 bodies (which
    json.loads also reads) are always parsed to check."""
    if not (_LONE_SURROGATE.search(body) or b"\x00" in body[:4]):
        return None
    try:
        json.dumps(json.loads(body), ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return APIError(
            400,
            "the request body holds a lone UTF-16 surrogate (e.g. \\ud800 without its pair): "
            "not valid Unicode text",
        )
    except (ValueError, RecursionError):  # not JSON, or too deep: the route's own parse says so
        return None
    return None


class _Constant:
    """Where json.loads read a NaN, Infinity or -Infinity literal (`constant_problem`)."""

    def __init__(self, literal: str):
        self.literal = literal


def _where(path: list) -> str:
    """A body path as the server names fields: `messages[0].content`."""
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def constant_problem(body: bytes) -> APIError | None:
    """A 400 naming the field for a JSON body holding NaN, Infinity or -Infinity: Python's
    json.loads reads them (JSON has no such numbers, RFC 8259 6), and a NaN compares false
    with every bound, so a field's own check would say something misleading, or nothing. Only a
    body that holds one of those words (also inside a string: then it is fine) is parsed twice."""
    if b"NaN" not in body and b"Infinity" not in body:
        return None
    try:
        doc = json.loads(body, parse_constant=_Constant)
    except (ValueError, RecursionError):  # not JSON, or too deep: the route's own parse says so
        return None
    stack: list[tuple[list, object]] = [([], doc)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, _Constant):
            where = _where(path) or "body"
            return APIError(
                400,
                f"{where}: {value.literal} is not a JSON number (JSON has no NaN or Infinity)",
                param=where if path else None,
            )
        if isinstance(value, dict):
            stack.extend((path + [k], v) for k, v in reversed(list(value.items())))
        elif isinstance(value, list):
            stack.extend((path + [i], v) for i, v in reversed(list(enumerate(value))))
    return None


def respond(err: APIError, shape: Shape) -> JSONResponse:
    status, body = shape(err)
    return JSONResponse(body, status_code=status, headers=dict(err.headers))


ADMIN_REFUSAL = "admin_refusal"
"""The `request.state` field where serve/guard.py leaves what an admin route answers for the
request's credentials: an APIError, or None to go ahead."""
UNGUARDED = APIError(
    403, "admin routes are closed: the app runs without serve/guard.py", type="permission_error"
)

STREAMED = {
    200: {
        "description": "The answer; with `stream: true`, server-sent events in the protocol's "
        "event grammar",
        "content": {"application/json": {}, "text/event-stream": {}},
    }
}
"""OpenAPI `responses` of a route that can stream."""


def protocol_route(
    shape: Shape, error_model: type | None = None, drains: bool = True, admin: bool = False
) -> type[APIRoute]:
    """A route class whose errors take `shape`; `drains=False` keeps answering while draining
    (health checks); `admin=True` marks routes that change the server's state: they answer
    what serve/guard.py decided for the request's credentials (`serve.admin_key`) before their
    handler runs. `error_model`: the pydantic model of that shape's body, which the OpenAPI
    schema gives for 4XX and 5XX answers (so it says what the route really answers: 400, not
    FastAPI's 422)."""
    documented = (
        {
            "4XX": {"model": error_model, "description": "A request the server refuses"},
            "5XX": {"model": error_model, "description": "Busy, loading, draining, or a bug"},
        }
        if error_model is not None
        else {}
    )

    class ProtocolRoute(APIRoute):
        def __init__(self, path, endpoint, **kwargs):
            kwargs["responses"] = {**documented, **(kwargs.get("responses") or {})}
            super().__init__(path, endpoint, **kwargs)

        def get_route_handler(self):
            handler = super().get_route_handler()
            # a JSON body (not a form's): a body sent as another type is refused saying so
            json_body = self.body_field is not None and not isinstance(
                self.body_field.field_info, params.Form
            )

            async def route(request):
                if drains and request.app.state.draining:
                    return respond(draining_error(), shape)
                if admin:  # before the handler parses the body
                    refusal = request.scope.get("state", {}).get(ADMIN_REFUSAL, UNGUARDED)
                    if refusal is not None:
                        return respond(refusal, shape)
                kind = request.headers.get("content-type")
                try:
                    if json_body and is_json_type(kind):
                        body = await request.body()
                        problem = unicode_problem(body) or constant_problem(body)
                        if problem is not None:
                            return respond(problem, shape)
                    return await handler(request)
                except APIError as e:
                    return respond(e, shape)
                except RequestValidationError as e:
                    if json_body and not is_json_type(kind):
                        got = kind.split(";")[0].strip() if kind else "none"
                        return respond(  # FastAPI did not read it as JSON: say why
                            APIError(
                                400,
                                "the body must be JSON sent as Content-Type: application/json "
                                f"(got {got})",
                            ),
                            shape,
                        )
                    return respond(validation_error(e), shape)
                except StarletteHTTPException as e:  # e.g. a body that is not UTF-8
                    return respond(
                        APIError(e.status_code, str(e.detail), headers=dict(e.headers or {})),
                        shape,
                    )
                except Exception as e:  # noqa: BLE001 - a bug answers 500, the server carries on
                    log.exception("mlxlab serve: %s %s failed", request.method, request.url.path)
                    return respond(
                        APIError(500, f"internal error: {e}", type="server_error"), shape
                    )

            return route

    return ProtocolRoute


class InFlight:
    """How many HTTP exchanges are in flight (read by the drain from another thread)."""

    def __init__(self):
        self.count = 0


REQUEST_ID = re.compile(rb"[A-Za-z0-9._:+/=@-]{1,128}")
"""A client's X-Request-ID that is echoed: at most 128 letters, digits and `._:+/=@-` (UUIDs,
ULIDs, trace ids, base64); anything else is replaced, so a client cannot make the server emit
arbitrary header content."""


def request_id(given: bytes) -> str:
    """The X-Request-ID of an exchange: the client's when REQUEST_ID takes it, else a new one."""
    if REQUEST_ID.fullmatch(given):
        return given.decode("ascii")
    return f"req_{uuid.uuid4().hex}"


class Exchanges:
    """Pure ASGI middleware: stamps `X-Request-ID` (the client's, when it is an acceptable id
    (`REQUEST_ID`), or a new one) on every response
    and counts HTTP exchanges in flight in `counter`. An exchange ends when the app returns: it has
    handed its last body chunk to the server (whose write buffer may still hold it: the drain
    waits for those buffers too) or the client has gone."""

    def __init__(self, app, counter: InFlight):
        self.app, self.counter = app, counter

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        rid = request_id(headers.get(b"x-request-id", b""))

        async def stamped(message):
            if message["type"] == "http.response.start":
                message = {
                    **message,
                    "headers": [
                        *message.get("headers", []),
                        (b"x-request-id", rid.encode("ascii")),
                    ],
                }
            await send(message)

        self.counter.count += 1
        try:
            await self.app(scope, receive, stamped)
        finally:
            self.counter.count -= 1


DISCARD_FACTOR = 4
"""A body over the cap is read and thrown away (so its client, still sending, reads the 413)
up to this many times the cap; beyond it, or when Content-Length says so, the answer is at once
and the connection closes."""


SPOOL_BYTES = 1 << 20
"""A spooled body (BodyLimit's `routes`) stays in memory up to this size, then goes to disk."""


class BodyLimit:
    """Pure ASGI middleware: reads each request's whole body before the app runs, at most
    `max_bytes` of it (413 above) and within `timeout_s` of the request's start (408 after: a
    client that stalls or trickles its body holds no handler). Errors take the shape
    `shape_for(path)` names and close the connection. The app then reads the body from memory;
    later `receive` calls (a streaming response listening for the client leaving) go through.

    `routes`: paths with a cap of their own, path -> (max bytes, the flag that sets it), e.g.
    the audio uploads (serve.max_audio_mb): their bodies are spooled to a temporary file (in
    memory up to SPOOL_BYTES) rather than held in memory. A body whose Content-Length is over
    its cap is never kept, only read and dropped (or refused at once, as above).
    `max_bytes` may be a function, asked per request (the cap grows once a vision model is up)."""

    def __init__(
        self,
        app,
        max_bytes: int | Callable[[], int],
        timeout_s: float,
        shape_for: Callable[[str], Shape],
        routes: dict[str, tuple[int, str]] | None = None,
    ):
        self.app, self._max_bytes, self.timeout_s, self.shape_for = (
            app,
            max_bytes,
            timeout_s,
            shape_for,
        )
        self.routes = dict(routes or {})

    async def _refuse(self, scope, receive, send, err: APIError) -> None:
        err.headers = {**err.headers, "Connection": "close"}
        await respond(err, self.shape_for(scope.get("path", "")))(scope, receive, send)

    @property
    def max_bytes(self) -> int:
        return self._max_bytes() if callable(self._max_bytes) else self._max_bytes

    def _too_large(self, limit: int | None = None, flag: str | None = None) -> APIError:
        if limit is None:
            limit = self.max_bytes
            vision = "; serve.vision_body_mb on a vision model" if callable(self._max_bytes) else ""
            flag = f"serve.max_body_mb{vision}"
        return APIError(
            413,
            f"request body over {limit / 1e6:g} MB ({flag})",
            code="request_too_large",
        )

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if scope.get("path") in self.routes:
            return await self._spooled(scope, receive, send, *self.routes[scope["path"]])
        declared = None
        for name, value in scope.get("headers") or []:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = None
        expects = any(
            n == b"expect" and v.lower() == b"100-continue" for n, v in scope.get("headers") or []
        )
        if declared is not None and (
            declared > DISCARD_FACTOR * self.max_bytes
            or (expects and declared > self.max_bytes)  # refused before the client sends it
        ):
            return await self._refuse(scope, receive, send, self._too_large())
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        chunks: list[bytes] = []
        size = 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0.0))
            except asyncio.TimeoutError:
                return await self._refuse(
                    scope,
                    receive,
                    send,
                    APIError(
                        408,
                        f"the request body did not arrive within {self.timeout_s:g} s "
                        "(serve.read_timeout_s)",
                        code="request_timeout",
                    ),
                )
            if message["type"] != "http.request":  # the client left before sending it all
                return None
            body = message.get("body", b"")
            size += len(body)
            if size <= self.max_bytes:
                chunks.append(body)
            elif size > DISCARD_FACTOR * self.max_bytes:
                return await self._refuse(scope, receive, send, self._too_large())
            if not message.get("more_body", False):
                break
        if size > self.max_bytes:
            return await self._refuse(scope, receive, send, self._too_large())
        whole = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        pending = [whole]

        async def replay():
            return pending.pop() if pending else await receive()

        return await self.app(scope, replay, send)

    async def _spooled(self, scope, receive, send, limit: int, flag: str):
        """As `__call__`, for a route with its own cap: the body goes to a spooled temporary
        file and is replayed to the app from it, in SPOOL_BYTES chunks."""
        import tempfile

        declared, expects = None, False
        for name, value in scope.get("headers") or []:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = None
            elif name == b"expect" and value.lower() == b"100-continue":
                expects = True
        too_large = self._too_large(limit, flag)
        if declared is not None and (
            declared > DISCARD_FACTOR * limit or (expects and declared > limit)
        ):
            return await self._refuse(scope, receive, send, too_large)
        keep = declared is None or declared <= limit  # a body said to be too large is only dropped
        loop = asyncio.get_running_loop()
        # a route with a large cap (audio uploads) also gets a second per MB of it, so a full
        # upload needs about 1 MB/s (30 s alone would ask a 50 MB file for 13 Mbit/s)
        budget = self.timeout_s + limit / 1e6
        deadline = loop.time() + budget
        with tempfile.SpooledTemporaryFile(max_size=SPOOL_BYTES) as spool:
            size = 0
            while True:
                try:
                    message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0.0))
                except asyncio.TimeoutError:
                    return await self._refuse(
                        scope,
                        receive,
                        send,
                        APIError(
                            408,
                            f"the request body did not arrive within {budget:g} s "
                            f"(serve.read_timeout_s plus a second per MB of this route's "
                            f"{limit / 1e6:g} MB cap)",
                            code="request_timeout",
                        ),
                    )
                if message["type"] != "http.request":
                    return None
                body = message.get("body", b"")
                size += len(body)
                if keep and size <= limit:
                    spool.write(body)
                elif size > DISCARD_FACTOR * limit:
                    return await self._refuse(scope, receive, send, too_large)
                if not message.get("more_body", False):
                    break
            if size > limit:
                return await self._refuse(scope, receive, send, too_large)
            spool.seek(0)
            left = [size]

            async def replay():
                if left[0] < 0:
                    return await receive()
                chunk = spool.read(SPOOL_BYTES)
                left[0] -= len(chunk)
                more = left[0] > 0
                if not more:
                    left[0] = -1
                return {"type": "http.request", "body": chunk, "more_body": more}

            return await self.app(scope, replay, send)
