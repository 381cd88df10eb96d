"""Status and admin routes: `GET /health` (503 while loading or draining), `GET /v1/models[/{id}]`,
`GET /stats`, `GET /metrics` (Prometheus), `GET /openapi.json` (`serve.openapi`), and the adapter
API (`GET/POST /v1/adapters`, `DELETE /v1/adapters/{id}`, `GET /v1/adapters/available`; each
adapter is mounted on one served model: `model` in the body, `?model=` on DELETE). Errors
answer in the OpenAI shape. The routes that change the server's state (mount, unmount) are on
`admin_router`, which `serve.admin_key` guards."""

from __future__ import annotations

import asyncio
import time
from datetime import datetime, timezone

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from mlxlab.errors import UserError
from mlxlab.lora import io as lora_io
from mlxlab.serve import sidecars
from mlxlab.serve.admin.protocol import Health, MountRequest
from mlxlab.serve.engine.adapters import Adapters
from mlxlab.serve.engine.entries import ModelError
from mlxlab.serve.http import APIError, protocol_route
from mlxlab.serve.metrics import CONTENT_TYPE
from mlxlab.serve.model_choice import lease_for, model_error, ready_loaded
from mlxlab.serve.openai.protocol import OpenAIError, error_shape
from mlxlab.train import runs

health_router = APIRouter(route_class=protocol_route(error_shape, drains=False))
router = APIRouter(route_class=protocol_route(error_shape, OpenAIError))
admin_router = APIRouter(route_class=protocol_route(error_shape, OpenAIError, admin=True))


@health_router.head("/health", include_in_schema=False)  # HEAD: the same answer, no body
@health_router.get(
    "/health",
    responses={
        200: {"model": Health, "description": "Ready"},
        503: {"model": Health, "description": "Loading, failed to load, or draining"},
    },
)
async def health(request: Request):
    state = request.app.state
    g = state.gateway
    ok = g.state == "ready" and not state.draining
    body = {
        "status": "ok" if ok else ("draining" if state.draining else g.state),
        "model": state.cfg.model,
    }
    if g.error:
        body["error"] = g.error
    return JSONResponse(body, status_code=200 if ok else 503)


CARD_FIELDS = ("default", "state", "loaded", "size_bytes", "context_length", "vision")
"""What a chat model's /v1/models entry says beside OpenAI's fields (engine/entries.py `describe`)."""


def model_card(request: Request, info: dict) -> dict:
    """A chat model's /v1/models entry from `Models.describe`: whether it is loaded, its size
    (weights' bytes; from its files when unloaded), its context length (the admission ceiling
    when loaded, the model's own otherwise)."""
    gateway = request.app.state.gateway
    card = {
        "id": info["id"],
        "object": "model",
        "created": int(gateway.started_at),
        "owned_by": "mlxlab",
        **{k: info.get(k) for k in CARD_FIELDS},
    }
    if info["default"]:
        card.update(sidecars.chat_card(request))
    return card


async def chat_cards(request: Request) -> list[dict]:
    """Every chat model's entry (reading unloaded models' files: off the event loop)."""
    gateway = request.app.state.gateway
    if gateway.state != "ready":  # the default model is loading (or failed): its id alone
        info = {"id": request.app.state.cfg.model, "default": True, "loaded": False}
        return [model_card(request, {**info, "state": gateway.state})]
    listing = await asyncio.get_running_loop().run_in_executor(None, gateway.models.listing)
    return [model_card(request, info) for info in listing]


def both_shapes(card: dict) -> dict:
    """A /v1/models entry that reads as OpenAI's `Model` and as Anthropic's `ModelInfo` (whose
    SDK requires `type`, `display_name`, `created_at` as RFC 3339 and `lifecycle`)."""
    created = datetime.fromtimestamp(card["created"], timezone.utc)
    context = card.get("context_length")
    return {
        **card,
        "type": "model",
        "display_name": card["id"],
        "created_at": created.isoformat().replace("+00:00", "Z"),
        "lifecycle": "active",
        **({"max_input_tokens": context} if context else {}),
    }


@router.get("/v1/models")
async def models(request: Request):
    """OpenAI's list and Anthropic's page in one body (`first_id`, `last_id`, `has_more`)."""
    # (The speech and embedding models' `type` says their kind, as docs/serving.md has it.)
    cards = [*map(both_shapes, await chat_cards(request)), *sidecars.cards(request)]
    return {
        "object": "list",
        "data": cards,
        "first_id": cards[0]["id"] if cards else None,
        "last_id": cards[-1]["id"] if cards else None,
        "has_more": False,
    }


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request):
    beside = next((c for c in sidecars.cards(request) if c["id"] == model_id), None)
    if beside is not None:
        return beside
    card = next((c for c in await chat_cards(request) if c["id"] == model_id), None)
    if card is None:
        raise model_error(request.app.state.gateway.models.not_found(model_id))
    return both_shapes(card)


@router.get("/openapi.json", include_in_schema=False)
async def openapi(request: Request):
    """The server's OpenAPI schema: every route with its request model and error shape. Served
    on purpose (`serve.openapi`, default on: API fuzzers read it); interactive /docs stay off."""
    if not request.app.state.cfg.openapi:
        raise APIError(404, "Not Found", type="not_found_error")
    return request.app.openapi()


@router.get(
    "/metrics",
    response_class=PlainTextResponse,
    responses={200: {"description": "Prometheus text format", "content": {CONTENT_TYPE: {}}}},
)
async def metrics(request: Request):
    """The server's metrics in Prometheus' text format (`serve/metrics.py`)."""
    return Response(request.app.state.metrics.exposition(), media_type=CONTENT_TYPE)


@router.get("/stats")
async def stats(request: Request):
    state = request.app.state
    g, cfg = state.gateway, state.cfg
    loaded = g.loaded
    return {
        "server": {
            "model": cfg.model,
            "started_at": g.started_at,
            "uptime_s": round(time.time() - g.started_at, 1),
            "state": g.state,
            "draining": state.draining,
            "host": cfg.host,
            "port": cfg.port,
        },
        "prompt_cache": loaded.cache.stats() if loaded else None,
        "admission": loaded.admission.stats() if loaded else None,
        "queue": g.stats(),
        "response_store": state.response_store.stats(),
        "adapters": loaded.adapters.stats() if loaded else None,  # the default model's
        "adapters_by_model": {  # each loaded model's (not_remounted: since any earlier load)
            name: {**m.adapters.stats(), "not_remounted": g.models.not_remounted(name)}
            for name, m in g.models.loaded_models()
        },
        "batch": g.batch_stats(),
        "speculative": g.speculation_stats(),
        "kv_quant": loaded.kv.stats() if loaded else None,
        "vision": loaded.vision.stats() if loaded and loaded.vision else None,
        "models": g.models.stats(),
    }


def check_mutable(request: Request) -> None:
    if not request.app.state.cfg.allow_adapter_mount:
        raise APIError(
            403,
            "runtime adapter mounting is switched off (serve.allow_adapter_mount=false)",
            type="permission_error",
            code="mount_disabled",
        )


def registry(request: Request) -> Adapters:
    """The default model's registry (the adapter root is the server's, shared by every model)."""
    return ready_loaded(request.app.state.gateway).adapters


@router.get("/v1/adapters")
async def listing(request: Request, model: str | None = None):
    """Every loaded model's adapters (`model`: one model's), each card naming its model."""
    gateway = request.app.state.gateway
    ready_loaded(gateway)
    loaded = gateway.models.loaded_models()
    if model is not None:
        try:
            name = gateway.models.find(model, create=False).name
        except ModelError as e:
            raise model_error(e) from None
        loaded = [(n, m) for n, m in loaded if n == name]
    return {
        "adapters": [
            {**a.card(), "model": name}
            for name, m in loaded
            for a in list(m.adapters.mounted.values())
        ]
    }


@router.get("/v1/adapters/available")
async def available(request: Request):
    reg = registry(request)
    return {"root": str(reg.root), "adapters": reg.available()}


def trained_elsewhere(gateway, path, model: str) -> str:
    """What the message of a refused mount on `model` adds when the adapter is a training
    run's (runs.trained_from): the model it trained from, and whether and under which name it
    is served here; nothing when that is `model` itself (another name or directory of it: the
    mismatch is then the files', which the error says) or cannot be told."""
    trained = runs.trained_from(path)
    if not isinstance(trained, str) or not trained or trained == model:
        return ""
    there = gateway.models.serving(trained)
    if there is not None and there.name == model:
        return ""
    if there is not None:
        return f" (it was trained from {trained!r}, served here as {there.name!r}: mount it there)"
    return f" (it was trained from {trained!r}, which is not served here)"


def hint_or_nothing(gateway, path, model: str) -> str:
    """`trained_elsewhere`, or nothing where it fails (a hint never turns a 400 into a 500)."""
    try:
        return trained_elsewhere(gateway, path, model)
    except Exception:  # noqa: BLE001 - only a hint
        return ""


@admin_router.post("/v1/adapters")
async def mount(body: MountRequest, request: Request):
    """Mount on `body.model` (default: the default model), loading it first if it is not."""
    check_mutable(request)
    gateway = request.app.state.gateway
    lease = await lease_for(gateway, body.model)  # held while mounting: it cannot be evicted
    try:
        reg = lease.loaded.adapters
        try:
            path = reg.confine(body.path)
        except PermissionError as e:
            raise APIError(
                403, str(e), type="permission_error", param="path", code="outside_adapter_root"
            ) from None
        try:
            found = path.exists()
        except OSError:  # e.g. a name too long for the file system: nothing can be there
            found = False
        if not found:  # what it names is not there: a 404, as for any missing resource
            raise APIError(
                404,
                f"no adapter directory {body.path!r} under the adapter root {reg.root}",
                type="not_found_error",
                param="path",
                code="adapter_path_not_found",
            )
        try:
            mounted = await gateway.call(lambda: reg.mount(body.id, path))
        except UserError as e:  # lora_io.BaseMismatch: trained on another base model
            hint = ""
            if isinstance(e, lora_io.BaseMismatch):
                hint = await asyncio.get_running_loop().run_in_executor(
                    None, hint_or_nothing, gateway, path, lease.name
                )
            raise APIError(
                400,
                f"adapter {body.id!r} cannot be mounted on model {lease.name!r}{hint}: {e}",
                param="path",
                code="adapter_model_mismatch"
                if isinstance(e, lora_io.BaseMismatch)
                else "invalid_adapter",
            ) from None
        gateway.models.mounted(lease.entry, mounted.id, mounted.path)  # its later loads too
        return {**mounted.card(), "model": lease.name}
    finally:
        lease.release()


@admin_router.delete("/v1/adapters/{adapter_id}")
async def unmount(adapter_id: str, request: Request, model: str | None = None):
    """Unmount from `model` (default: the default model). A model that is not loaded is not
    loaded for this: an adapter on its mount list (mounted at runtime or at start, remounted by
    its next load) is taken off the list. A model queued or loading is waited for (its load has
    read the list), then unmounted from as a loaded one."""
    check_mutable(request)
    gateway = request.app.state.gateway
    ready_loaded(gateway)
    for _ in range(2):  # a load waited for that fails: the list alone, the second time
        try:
            entry, got = gateway.models.unmount_or_lease(model, adapter_id)
        except ModelError as e:
            raise model_error(e) from None
        if got != "loading":
            break
        try:
            got = await lease_for(gateway, model)  # its load mounts the list it read
            break
        except APIError:
            if entry.state in ("queued", "loading"):  # not loaded in time: a 503 to retry
                raise
    if got == "loading":  # loading again (another request's): as if not loaded in time
        raise APIError(
            503,
            f"model {entry.name!r} is loading; retry the unmount shortly",
            type="service_unavailable",
            code="model_loading",
            headers={"Retry-After": "5"},
        )
    name = entry.name
    try:
        if isinstance(got, bool):
            if not got:
                raise KeyError(adapter_id)
        else:
            try:
                await gateway.call(lambda: got.loaded.adapters.unmount(adapter_id))
            except KeyError:  # not mounted: a not_remounted report of it is cleared, else 404
                if not gateway.models.forget(entry, adapter_id):
                    raise
            else:
                gateway.models.forget(entry, adapter_id)
    except KeyError:
        owner = gateway.models.owner_of(adapter_id)
        hint = ""
        if owner is not None and owner.name != name:
            hint = f" (it is mounted on model {owner.name!r}: add ?model={owner.name})"
        raise APIError(
            404,
            f"no adapter {adapter_id!r} is mounted on model {name!r}{hint}",
            type="not_found_error",
            code="adapter_not_found",
        ) from None
    finally:
        if not isinstance(got, (bool, str)):
            got.release()
    return {"id": adapter_id, "object": "adapter.deleted", "deleted": True, "model": name}
