"""The HTTP app: one router per API folder over one engine.

    openai/     POST /v1/chat/completions, /v1/completions
    anthropic/  POST /v1/messages, /v1/messages/count_tokens
    responses/  POST /v1/responses, GET/DELETE /v1/responses/{id}
    admin/      GET /health, /v1/models[/{id}], /stats, /metrics, /openapi.json; the adapter API
    web/        GET / (chat page), /runs (runs page), /static/*; GET /v1/runs[/metrics|/info]
    audio/      POST /v1/audio/transcriptions, /v1/audio/translations (serve.stt_model)
    embeddings/ POST /v1/embeddings (serve.embeddings_model)

Routers reach the engine through `app.state` (`gateway`, `cfg`, `response_store`, `draining`,
`in_flight`, `metrics`). Every response carries `X-Request-ID` (the client's, or a new one); each router
answers its errors in its own protocol's shape (`http.protocol_route`); paths no router has get
404/405 in the shape `shape_for` picks (the Anthropic one under /v1/messages, else OpenAI's; a
405 with the `Allow` header listing the path's methods),
and so do the Host/Origin/API-key refusals of `guard.Guard` and the bodies over
serve.max_body_mb (413) or slower than serve.read_timeout_s (408), which `http.BodyLimit`
answers: both before any router runs.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from mlxlab.serve.admin import router as admin
from mlxlab.serve.anthropic import router as anthropic
from mlxlab.serve.anthropic.protocol import error_shape as anthropic_error_shape
from mlxlab.serve.audio import router as audio
from mlxlab.serve.config import ServeConfig
from mlxlab.serve.embeddings import router as embeddings
from mlxlab.serve.engine.gateway import Gateway
from mlxlab.serve.guard import Guard, Keys, load_keys
from mlxlab.serve.http import APIError, BodyLimit, Exchanges, InFlight, Shape, respond
from mlxlab.serve.metrics import Metrics, Requests
from mlxlab.serve.openai import router as openai
from mlxlab.serve.openai.protocol import error_shape
from mlxlab.serve.responses import router as responses
from mlxlab.serve.responses.store import ResponseStore
from mlxlab.serve.web import router as web


def shape_for(path: str) -> Shape:
    """The error shape for a request no route has answered (yet): the Anthropic shape under its
    prefix, else OpenAI's (which Responses and admin use too)."""
    return anthropic_error_shape if path.startswith("/v1/messages") else error_shape


def allowed_methods(routes: list, scope) -> str:
    """The `Allow` header of a 405: every method of every route whose path matches, across the
    routers (Starlette names only the first matching route's, and a path such as /v1/adapters
    has its GET and its POST in two routers)."""
    methods = set()
    for route in routes:
        match, _ = route.matches(scope)
        if match is not Match.NONE:
            methods |= set(getattr(route, "methods", None) or ())
    return ", ".join(sorted(methods))


def create_app(cfg: ServeConfig, gateway: Gateway, keys: Keys | None = None) -> FastAPI:
    """The app over a started gateway; `keys` default to `guard.load_keys(cfg)`."""
    # /openapi.json is an admin route (serve.openapi), answering like every other route.
    app = FastAPI(title="mlxlab", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.cfg = cfg
    app.state.gateway = gateway
    app.state.draining = False
    app.state.response_store = ResponseStore()
    app.state.in_flight = InFlight()
    app.state.metrics = Metrics(gateway, app.state.response_store)
    # The runs page's directory: serve.runs_dir, else (None) the loaded model's adapter root.
    app.state.runs_dir = Path(cfg.runs_dir).expanduser().resolve() if cfg.runs_dir else None

    def body_cap() -> int:  # a vision model takes base64 images up to serve.vision_body_mb
        vlm = gateway.loaded is not None and getattr(gateway.loaded, "vision", None) is not None
        return int(max(cfg.max_body_mb, cfg.vision_body_mb if vlm else 0) * 1e6)

    # The last added runs first: Exchanges (X-Request-ID, in-flight count), Requests (metrics:
    # every answer counted, refusals too), Guard (Host, Origin, keys: before any body is read),
    # BodyLimit (the body read within its cap and deadline), then the routers.
    app.add_middleware(
        BodyLimit,
        max_bytes=body_cap,
        timeout_s=cfg.read_timeout_s,
        shape_for=shape_for,
        # the audio uploads' own cap (the handbook's 50 MB), spooled to disk, not memory
        routes={p: (int(cfg.max_audio_mb * 1e6), "serve.max_audio_mb") for p in audio.ROUTES},
    )
    app.add_middleware(
        Guard, cfg=cfg, keys=load_keys(cfg) if keys is None else keys, shape_for=shape_for
    )
    app.add_middleware(Requests, metrics=app.state.metrics)
    app.add_middleware(Exchanges, counter=app.state.in_flight)
    routers = (
        admin.health_router,
        admin.router,
        admin.admin_router,
        openai.router,
        anthropic.router,
        responses.router,
        web.pages_router,
        web.runs_router,
        audio.router,
        embeddings.router,
    )
    for router in routers:
        app.include_router(router)
    routes = [route for router in routers for route in router.routes]

    @app.exception_handler(StarletteHTTPException)
    async def no_route(request: Request, exc: StarletteHTTPException):
        kind = {404: "not_found_error"}.get(exc.status_code, "invalid_request_error")
        headers = dict(exc.headers or {})
        if exc.status_code == 405:  # RFC 9110 15.5.6: the methods the path takes
            headers["Allow"] = allowed_methods(routes, request.scope) or headers.get("Allow", "")
        return respond(
            APIError(exc.status_code, str(exc.detail), type=kind, headers=headers),
            shape_for(request.url.path),
        )

    @app.exception_handler(Exception)
    async def crashed(request: Request, exc: Exception):
        return respond(
            APIError(500, f"internal error: {exc}", type="server_error"),
            shape_for(request.url.path),
        )

    return app
