"""HTTP plumbing every API folder shares: the protocol-neutral `APIError`, a route class that
answers a router's errors in that protocol's shape, and the ASGI middleware that stamps
`X-Request-ID` and counts exchanges in flight (the drain waits on that count).

Each protocol owns its error shape: its router is built with `protocol_route(shape)`, where
`shape(err) -> (status, body)`. The route answers, in that shape: `APIError`s raised by the
handler, body validation errors (400, the first problem named), unexpected exceptions (500),
and, while the server drains, every new request (503 + Retry-After).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

Shape = Callable[["APIError"], tuple[int, dict]]


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


def respond(err: APIError, shape: Shape) -> JSONResponse:
    status, body = shape(err)
    return JSONResponse(body, status_code=status, headers=dict(err.headers))


ADMIN_REFUSAL = "admin_refusal"
"""The `request.state` field where serve/guard.py leaves what an admin route answers for the
request's credentials: an APIError, or None to go ahead."""
UNGUARDED = APIError(
    403, "admin routes are closed: the app runs without serve/guard.py", type="permission_error"
)


def protocol_route(shape: Shape, drains: bool = True, admin: bool = False) -> type[APIRoute]:
    """A route class whose errors take `shape`; `drains=False` keeps answering while draining
    (health checks); `admin=True` marks routes that change the server's state: they answer
    what serve/guard.py decided for the request's credentials (`serve.admin_key`), before the
    body is read."""

    class ProtocolRoute(APIRoute):
        def get_route_handler(self):
            handler = super().get_route_handler()

            async def route(request):
                if drains and request.app.state.draining:
                    return respond(draining_error(), shape)
                if admin:  # before the body is read
                    refusal = request.scope.get("state", {}).get(ADMIN_REFUSAL, UNGUARDED)
                    if refusal is not None:
                        return respond(refusal, shape)
                try:
                    return await handler(request)
                except APIError as e:
                    return respond(e, shape)
                except RequestValidationError as e:
                    return respond(validation_error(e), shape)
                except StarletteHTTPException as e:  # e.g. a body that is not UTF-8
                    return respond(APIError(e.status_code, str(e.detail)), shape)
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


class Exchanges:
    """Pure ASGI middleware: stamps `X-Request-ID` (the client's, or a new one) on every response
    and counts HTTP exchanges in flight in `counter`. An exchange ends when the app returns: it has
    handed its last body chunk to the server (whose write buffer may still hold it: the drain
    waits for those buffers too) or the client has gone."""

    def __init__(self, app, counter: InFlight):
        self.app, self.counter = app, counter

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        rid = headers.get(b"x-request-id", b"").decode("latin-1") or f"req_{uuid.uuid4().hex}"

        async def stamped(message):
            if message["type"] == "http.response.start":
                message = {
                    **message,
                    "headers": [
                        *message.get("headers", []),
                        (b"x-request-id", rid.encode("latin-1")),
                    ],
                }
            await send(message)

        self.counter.count += 1
        try:
            await self.app(scope, receive, stamped)
        finally:
            self.counter.count -= 1
