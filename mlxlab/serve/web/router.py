"""The browser pages and the runs API.

Pages (`pages_router`): `GET /` (the chat page), `GET /runs` (the runs page) and
`GET /static/{name}` (their scripts and styles): static files from this package's `static/`
folder, no build step, nothing fetched from elsewhere, served with a Content-Security-Policy that
lets them load and call this origin only. They carry no data, so serve/guard.py lets them load
without the API key (a page that could not load could not ask for it); every call they make
needs it.

Runs API (`runs_router`), in the OpenAI error shape, confined to the runs directory
(`app.state.runs_dir`, else the adapter root of the loaded model: `serve.runs_dir`):

    GET /v1/runs                              the runs found, newest first, each a card
                                              (train/runs.py `describe`) and where to mount its
                                              adapter from (`mount_path`, relative to the
                                              adapter root; null when it lies outside) and on
                                              which model (`mount_model`: the served model
                                              the run trained from, `model_served`, else the
                                              default, which may refuse it: a 400 naming both)
    GET /v1/runs/metrics?run=ID&offset=N&file=F   metrics.jsonl records from byte N on
    GET /v1/runs/info?run=ID                  config.yaml and summary.json

A run id is a path relative to the runs directory; one that leaves it is a 403, one that names
no run a 404.
"""

from __future__ import annotations

import functools
import time
from importlib import resources
from pathlib import Path

from fastapi import APIRouter, Query, Request
from fastapi.responses import RedirectResponse, Response
from starlette.concurrency import run_in_threadpool

from mlxlab.serve.http import APIError, protocol_route
from mlxlab.serve.model_choice import ready_loaded
from mlxlab.serve.openai.protocol import OpenAIError, error_shape
from mlxlab.train import runs

pages_router = APIRouter(route_class=protocol_route(error_shape, OpenAIError))
runs_router = APIRouter(route_class=protocol_route(error_shape, OpenAIError))

CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}
PAGE_HEADERS = {
    "Cache-Control": "no-cache",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
    ),
}


@functools.cache
def static_files() -> dict[str, Path]:
    """name -> path of every file this package ships in static/ (the only names served)."""
    folder = Path(str(resources.files("mlxlab.serve.web"))) / "static"
    return {p.name: p for p in folder.iterdir() if p.is_file() and p.suffix in CONTENT_TYPES}


def page(name: str) -> Response:
    path = static_files().get(name)
    if path is None:
        raise APIError(404, f"no file {name!r} here", type="not_found_error", code="not_found")
    return Response(path.read_bytes(), media_type=CONTENT_TYPES[path.suffix], headers=PAGE_HEADERS)


@pages_router.get("/", include_in_schema=False)
async def chat_page(request: Request):
    if getattr(request.app.state, "gateway", None) is None:  # `mlxlab runs`: no model to chat with
        return RedirectResponse("/runs", status_code=307)
    return page("index.html")


@pages_router.get("/runs", include_in_schema=False)
async def runs_page():
    return page("runs.html")


@pages_router.get("/static/{name}", include_in_schema=False)
async def static(name: str):
    return page(name)


# --- the runs API ---------------------------------------------------------------------------


def runs_root(request: Request) -> Path:
    state = request.app.state
    root = getattr(state, "runs_dir", None)
    if root is not None:
        return root
    return ready_loaded(state.gateway).adapters.root


def gateway_of(request: Request):
    """The serving gateway, or None (`mlxlab runs`: no model; or not ready)."""
    gateway = getattr(request.app.state, "gateway", None)
    if gateway is None or gateway.state != "ready":
        return None
    return gateway


def checked(root: Path, run_id: str) -> Path:
    try:
        return runs.run_dir(root, run_id)
    except runs.RunError as e:
        kind = "not_found_error" if e.status == 404 else "permission_error"
        raise APIError(e.status, str(e), type=kind, param="run", code=e.code) from None


def mount_fields(card: dict, gateway, serving: dict) -> dict:
    """Where the page mounts a run's adapter from: its path relative to the adapter root, or
    None (no final adapter, no model here, or outside the root); the model it mounts on (the
    served model the run's `model` names, else the default) and the ids it is mounted as there
    (on its mount list: loaded or not). `serving`: run model -> entry, memoized per listing."""
    path = card.pop("adapter")
    out = {
        "adapter": path is not None,
        "mount_path": None,
        "mounted_as": [],
        "mount_model": None,
        "model_served": False,
    }
    if path is None or gateway is None:
        return out
    root = gateway.loaded.adapters.root  # the adapter root is the server's, every model's
    real = Path(path).resolve()
    if real == root or root in real.parents:
        out["mount_path"] = real.relative_to(root).as_posix()
    models = gateway.models
    trained = card.get("model")
    if not isinstance(trained, str):  # a config.yaml of another shape: no model named
        trained = None
    if trained not in serving:
        serving[trained] = models.serving(trained)
    entry = serving[trained]
    out["model_served"] = entry is not None
    entry = entry or models.default
    out["mount_model"] = entry.name
    with models.lock:
        loaded = entry.loaded if entry.state == "loaded" else None
        mounts = dict(entry.mounts)
    if loaded is not None:
        paths = {m.id: m.path for m in list(loaded.adapters.mounted.values())}
    else:  # its mount list: start-up and runtime mounts, each path resolved
        paths = {i: p for i, (p, _) in mounts.items()}
    out["mounted_as"] = [i for i, p in paths.items() if Path(p) == real]
    return out


def annotated(root: Path, gateway, now: float) -> list[dict]:
    """The run cards, each with its `mount_fields` (reads files: off the event loop)."""
    serving: dict = {}
    cards = runs.cards(root, now)
    for card in cards:
        card.update(mount_fields(card, gateway, serving))
    return cards


@runs_router.get("/v1/runs")
async def list_runs(request: Request):
    root = runs_root(request)
    gateway = gateway_of(request)
    cards = await run_in_threadpool(annotated, root, gateway, time.time())
    cfg = request.app.state.cfg
    return {
        "object": "list",
        "root": str(root),
        "model": cfg.model if gateway is not None else None,
        "can_mount": gateway is not None and cfg.allow_adapter_mount,
        "data": cards,
    }


@runs_router.get("/v1/runs/metrics")
async def run_metrics(
    request: Request,
    run: str = Query(min_length=1, max_length=4096),
    offset: int = Query(0, ge=0),
    file: str | None = Query(None, max_length=64),
):
    """metrics.jsonl records from byte `offset` on (complete lines only); `file` is the
    identity the previous answer gave: another file (rewritten by a resume) is read from 0 and
    answered with `reset: true`."""
    root = runs_root(request)
    path = checked(root, run)
    metrics = runs.run_file(root, path, runs.METRICS)
    got = None
    if metrics is not None:
        try:
            got = await run_in_threadpool(runs.read_metrics, metrics, offset, file)
        except OSError:  # removed since: as if not written yet
            got = None
    if got is None:  # config.yaml is written first: no step yet
        got = {"records": [], "offset": 0, "file": None, "reset": offset > 0, "more": False}
        got["bad_lines"] = 0
    return {"run": run, **got}


@runs_router.get("/v1/runs/info")
async def run_info(request: Request, run: str = Query(min_length=1, max_length=4096)):
    root = runs_root(request)
    path = checked(root, run)
    return {"run": run, **(await run_in_threadpool(runs.info, root, path))}
