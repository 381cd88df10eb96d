"""Who may talk to the server: API keys, and the Host and Origin checks that keep web pages out.

`Guard` is pure ASGI middleware (it never buffers a stream), installed inside `Exchanges` (so a
refusal still carries X-Request-ID and counts as an exchange) and in front of routing (so a
refusal reads no body and runs no route). Per request, in order:

1. Host (DNS rebinding): bound to loopback, the `Host` header must name loopback (localhost,
   127.0.0.1, [::1], any port) or an entry of `serve.allowed_hosts`; bound elsewhere, the
   allow-list applies if it is set. Else 403.
2. CORS preflight (OPTIONS with `Origin` and `Access-Control-Request-Method`): 204 with the CORS
   headers for an allowed origin, else 403. No key is asked for: browsers send none on one.
3. Origin: a state-changing request (POST/PUT/PATCH/DELETE) whose `Origin` is not allowed: 403.
   Allowed: an entry of `serve.cors_origins` (`*`: any), or the request's own scheme://Host (a
   page this server serves). SDKs send no Origin.
4. API key (`serve.api_key` or MLXLAB_API_KEY, plus `serve.api_key_file`): every route but
   GET/HEAD /health and the browser pages' static files (`PAGES`) wants
   `Authorization: Bearer <key>` or `x-api-key: <key>`, else 401 with `WWW-Authenticate: Bearer`.
   With `serve.admin_key` (or MLXLAB_ADMIN_KEY), the routes built with
   `protocol_route(..., admin=True)` open with that key only (an API key gets 403); the admin key
   opens every other route too.

Keys are compared as SHA-256 digests with `hmac.compare_digest`, against every configured key
(no early exit, lengths hidden). No key is ever logged or echoed. Answers to an allowed origin,
refusals included, carry `Access-Control-Allow-Origin` (the origin echoed) and `Vary: Origin`.
Errors take the protocol's shape from `shape_for(path)` (serve/app.py, the one place that picks
it); a refused WebSocket handshake is closed with code 1008.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from starlette.responses import Response

from mlxlab.errors import UserError
from mlxlab.serve.config import ServeConfig, check_api_key
from mlxlab.serve.http import ADMIN_REFUSAL, APIError, Shape, respond

STATE_CHANGING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
CORS_METHODS = "GET, HEAD, POST, DELETE, OPTIONS"
CORS_HEADERS = ("authorization", "x-api-key", "content-type", "anthropic-version", "x-request-id")
"""Request headers a preflight always allows (plus any others the browser asks for)."""
EXPOSED = "x-request-id, retry-after"
"""Response headers a cross-origin page may read."""
HEADER_NAME = re.compile(r"[a-z0-9!#$%&'*+.^_`|~-]+")
PAGES = frozenset({"/", "/runs"})
"""The browser pages (serve/web), open without a key like /health: their HTML, scripts and styles
(`/static/<name>`) carry no data, and a page that could not load could not ask for the key. Every
call the pages make needs it."""


def is_page(path: str) -> bool:
    return path in PAGES or (path.startswith("/static/") and "/" not in path[8:])


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("latin-1")).digest()


@dataclass(frozen=True)
class Keys:
    """The configured keys, as digests: `api` (any opens the API), `admin` (or None)."""

    api: tuple[bytes, ...] = ()
    admin: bytes | None = None

    def __repr__(self) -> str:  # never the digests either
        return f"Keys(api={len(self.api)}, admin={self.admin is not None})"

    def role(self, presented: list[str]) -> str | None:
        """The role the presented credentials open: admin, api or None. Every presented value is
        compared with every key, each pair in constant time."""
        admin = api = False
        for value in presented:
            d = digest(value)
            if self.admin is not None:
                admin |= hmac.compare_digest(d, self.admin)
            for key in self.api:
                api |= hmac.compare_digest(d, key)
        return "admin" if admin else ("api" if api else None)


def read_key_file(path: str) -> list[str]:
    """The keys in a file, one a line; `#` comments and blank lines ignored. A missing or
    unreadable file, a file with no key, or a line that cannot be a key is a UserError (naming
    the line, never the key)."""
    where = f"serve.api_key_file={path}"
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{where}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    keys = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if line and not line.startswith("#"):
            check_api_key(line, f"{where}:{n}")
            keys.append(line)
    if not keys:
        raise UserError(f"{where}: the file holds no key (one a line; # starts a comment)")
    return keys


def load_keys(cfg: ServeConfig, environ: Mapping[str, str] = os.environ) -> Keys:
    """The keys `cfg` and the environment configure: `api_key` (else MLXLAB_API_KEY) and the lines
    of `api_key_file`; `admin_key` (else MLXLAB_ADMIN_KEY). An empty variable counts as unset."""
    api = []
    key = cfg.api_key if cfg.api_key is not None else environ.get("MLXLAB_API_KEY") or None
    if key is not None:
        check_api_key(key, "serve.api_key" if cfg.api_key is not None else "MLXLAB_API_KEY")
        api.append(key)
    if cfg.api_key_file is not None:
        api += read_key_file(cfg.api_key_file)
    admin = cfg.admin_key if cfg.admin_key is not None else environ.get("MLXLAB_ADMIN_KEY") or None
    if admin is not None:
        check_api_key(admin, "serve.admin_key" if cfg.admin_key is not None else "MLXLAB_ADMIN_KEY")
        if admin in api:
            raise UserError("the admin key must differ from every API key")
    return Keys(tuple(dict.fromkeys(digest(k) for k in api)), digest(admin) if admin else None)


def host_name(value: str) -> str:
    """A Host header's (or a bind address's) name: lower case, without port, brackets or a
    trailing dot (`[::1]:8090` -> `::1`, `LocalHost.:80` -> `localhost`)."""
    value = value.strip().lower()
    if value.startswith("["):
        value = value[1:].partition("]")[0]
    elif value.count(":") == 1:
        value = value.partition(":")[0]
    return value.rstrip(".")


def is_loopback(name: str) -> bool:
    """Whether a host name or address means this machine only (localhost, 127.0.0.0/8, ::1)."""
    name = host_name(name)
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def error(status: int, message: str, code: str, **headers: str) -> APIError:
    kind = {401: "authentication_error", 403: "permission_error"}[status]
    return APIError(status, message, type=kind, code=code, headers=headers)


class Guard:
    """Pure ASGI middleware: the Host, Origin and API-key checks of this module's docstring."""

    def __init__(self, app, cfg: ServeConfig, keys: Keys, shape_for: Callable[[str], Shape]):
        self.app, self.keys, self.shape_for = app, keys, shape_for
        self.hosts = frozenset(host_name(h) for h in cfg.allowed_hosts)
        self.any_host = "*" in cfg.allowed_hosts
        self.loopback = is_loopback(cfg.host)
        self.origins = frozenset(o.lower() for o in cfg.cors_origins)
        self.any_origin = "*" in cfg.cors_origins

    def host_allowed(self, host: str | None) -> bool:
        if host is None or self.any_host:  # no Host (HTTP/1.0): no name a rebinding could use
            return True
        name = host_name(host)
        if name in self.hosts:
            return True
        return is_loopback(name) if self.loopback else not self.hosts

    def host_refused(self, host: str) -> APIError:
        why = (
            "the server is bound to loopback and answers to loopback names (localhost, "
            "127.0.0.1, [::1]) and those in serve.allowed_hosts only"
            if self.loopback
            else "it is not in serve.allowed_hosts"
        )
        return error(403, f"Host {host!r} is not allowed: {why}", "host_not_allowed")

    def origin_allowed(self, origin: str, scope, host: str | None) -> bool:
        origin = origin.lower()
        same = host is not None and origin == f"{scope.get('scheme', 'http')}://{host}".lower()
        return same or self.any_origin or origin in self.origins

    def refusal(self, scope, headers: dict[str, str], cors: bool):
        """(what answers this request instead of the app: an error, a preflight's 204; or None,
        and then what an admin route answers: an error, or None)."""
        method, path = scope.get("method", "GET"), scope.get("path", "")
        host, origin = headers.get("host"), headers.get("origin")
        if not self.host_allowed(host):
            return self.host_refused(host), None
        if method == "OPTIONS" and origin and "access-control-request-method" in headers:
            if not cors:
                return origin_refused(origin), None
            asked = HEADER_NAME.findall(headers.get("access-control-request-headers", "").lower())
            preflight = Response(
                status_code=204,
                headers={
                    "access-control-allow-methods": CORS_METHODS,
                    "access-control-allow-headers": ", ".join(
                        dict.fromkeys([*CORS_HEADERS, *asked])
                    ),
                    "access-control-max-age": "600",
                },
            )
            return preflight, None
        # A WebSocket handshake is a GET that opens a two-way channel: held to the Origin rule.
        changing = method in STATE_CHANGING or scope.get("type") == "websocket"
        if origin and changing and not cors:
            return origin_refused(origin), None
        if method in ("GET", "HEAD") and (path == "/health" or is_page(path)):  # open without a key
            return None, None
        return self.credentials(headers)

    def credentials(self, headers: dict[str, str]) -> tuple[APIError | None, APIError | None]:
        """What the request's credentials get: (the refusal on any route, the refusal on an admin
        route); None where they open it."""
        keys = self.keys
        if not keys.api and keys.admin is None:
            return None, None
        presented = [
            v for v in (bearer(headers.get("authorization")), headers.get("x-api-key")) if v
        ]
        role = keys.role(presented)
        words = "invalid API key" if presented else "no API key given"
        unknown = error(
            401,
            f"{words}: send Authorization: Bearer <key> or x-api-key: <key>",
            "invalid_api_key",
            **{"WWW-Authenticate": "Bearer"},
        )
        anywhere = unknown if keys.api and role is None else None
        if keys.admin is None or role == "admin":
            return anywhere, anywhere
        if role == "api":
            return anywhere, error(
                403, "this route needs the admin key (serve.admin_key)", "admin_key_required"
            )
        return anywhere, unknown

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        origin = headers.get("origin")
        cors = bool(origin) and self.origin_allowed(origin, scope, headers.get("host"))
        refused, admin = self.refusal(scope, headers, cors)
        if refused is None:  # admin routes answer `admin` themselves (http.protocol_route)
            # In place: the servers give each request its own state dict, and middleware
            # outside this one (metrics) reads the route the router leaves in this scope.
            scope.setdefault("state", {})[ADMIN_REFUSAL] = admin
        if scope["type"] == "websocket":
            if refused is None:
                return await self.app(scope, receive, send)
            return await send({"type": "websocket.close", "code": 1008})
        if cors:
            send = with_cors(send, origin)
        if refused is None:
            return await self.app(scope, receive, send)
        if isinstance(refused, APIError):
            refused = respond(refused, self.shape_for(scope["path"]))
        await refused(scope, receive, send)


def origin_refused(origin: str) -> APIError:
    return error(
        403,
        f"origin {origin!r} may not call this server: it is not in serve.cors_origins",
        "origin_not_allowed",
    )


def bearer(value: str | None) -> str | None:
    """The token of `Authorization: Bearer <token>` (scheme in any case), or None."""
    scheme, _, token = (value or "").strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


def with_cors(send, origin: str):
    """`send`, with the CORS headers of an allowed `origin` added to the response's start."""
    extra = [
        (b"access-control-allow-origin", origin.encode("latin-1")),
        (b"access-control-expose-headers", EXPOSED.encode()),
        (b"vary", b"Origin"),
    ]

    async def cors_send(message):
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), *extra]}
        await send(message)

    return cors_send
