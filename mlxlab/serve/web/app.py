"""The runs page's own app (`python -m mlxlab runs`): the pages and the runs API over a directory,
without a model (no chat, no mounting: `/` redirects to `/runs`), behind the same middleware as
`serve` (X-Request-ID, serve/guard.py's Host, Origin and key checks, body limits)."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException

from mlxlab.serve.config import ServeConfig
from mlxlab.serve.guard import Guard, Keys, load_keys
from mlxlab.serve.http import APIError, BodyLimit, Exchanges, InFlight, respond
from mlxlab.serve.openai.protocol import error_shape
from mlxlab.serve.web import router as web


def create_runs_app(cfg: ServeConfig, root: Path, keys: Keys | None = None) -> FastAPI:
    """The app listing the runs under `root`; `cfg` gives the HTTP side's settings (host, keys,
    allowed hosts and origins, body limits); `keys` default to `guard.load_keys(cfg)`."""
    app = FastAPI(title="mlxlab runs", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.cfg = cfg
    app.state.gateway = None
    app.state.draining = False
    app.state.in_flight = InFlight()
    app.state.runs_dir = Path(root).expanduser().resolve()

    def shape_for(path: str):
        return error_shape

    app.add_middleware(
        BodyLimit,
        max_bytes=int(cfg.max_body_mb * 1e6),
        timeout_s=cfg.read_timeout_s,
        shape_for=shape_for,
    )
    app.add_middleware(
        Guard, cfg=cfg, keys=load_keys(cfg) if keys is None else keys, shape_for=shape_for
    )
    app.add_middleware(Exchanges, counter=app.state.in_flight)
    app.include_router(web.pages_router)
    app.include_router(web.runs_router)

    @app.exception_handler(StarletteHTTPException)
    async def no_route(request: Request, exc: StarletteHTTPException):
        kind = {404: "not_found_error"}.get(exc.status_code, "invalid_request_error")
        return respond(APIError(exc.status_code, str(exc.detail), type=kind), error_shape)

    return app
