"""The model a request names: the engine's readiness (`ready_loaded`), a lease on the model
(`lease_for`: awaited while it loads, engine/models.py), the error of one that cannot serve it
(`model_error`: unknown, failed, cannot fit, load timed out) and the adapters the request may
use on it (`check_adapters`). `pipeline.prepare` and `make_job` call these for every protocol."""

from __future__ import annotations

import asyncio

from mlxlab.serve.engine.adapters import adapter_error_code
from mlxlab.serve.engine.entries import ModelError
from mlxlab.serve.engine.gateway import Gateway
from mlxlab.serve.engine.jobs import AdapterSpec
from mlxlab.serve.engine.loaded import Loaded
from mlxlab.serve.engine.models import Lease
from mlxlab.serve.http import APIError, error_type


def ready_loaded(gateway: Gateway) -> Loaded:
    if gateway.state != "ready":
        raise APIError(
            503,
            gateway.error or f"the model is {gateway.state}; try again shortly",
            type="service_unavailable",
            code="not_ready",
            headers={"Retry-After": "5"},
        )
    return gateway.loaded


def model_error(e: ModelError) -> APIError:
    """The APIError of a model that cannot serve a request (unknown, failed, cannot fit)."""
    headers = {"Retry-After": str(e.retry_after)} if e.retry_after else {}
    return APIError(
        e.status,
        str(e),
        type=error_type(e.status),
        param="model",
        code=e.code,
        headers=headers,
    )


LOAD_WAIT_S = 600.0
"""How long a request waits for its model's load before a 503 (a load stuck or far too slow)."""


async def lease_for(gateway: Gateway, model: str | None) -> Lease:
    """A lease on the model `model` names, awaited while it loads (engine/models.py), at most
    LOAD_WAIT_S (then a 503); a client that leaves meanwhile gives its lease back, even one
    handed to it after it left."""
    ready_loaded(gateway)
    try:
        future = gateway.models.acquire(model)
    except ModelError as e:
        raise model_error(e) from None
    try:
        return await asyncio.wait_for(asyncio.wrap_future(future), LOAD_WAIT_S)
    except ModelError as e:
        raise model_error(e) from None
    except (asyncio.CancelledError, TimeoutError) as e:
        future.add_done_callback(_give_back)  # at once when it is done already
        if isinstance(e, TimeoutError):
            raise APIError(
                503,
                f"model {model!r} did not load within {LOAD_WAIT_S:.0f} s; retry later",
                type="service_unavailable",
                param="model",
                code="model_load_timeout",
                headers={"Retry-After": "10"},
            ) from None
        raise


def _give_back(future) -> None:
    """The lease a request that left got after all goes back."""
    if not future.cancelled() and future.exception() is None:
        future.result().release()


def check_adapters(gateway: Gateway, loaded: Loaded, spec: AdapterSpec) -> None:
    """400 unless every adapter of `spec` is mounted on `loaded`'s model; one mounted on another
    model names both (an adapter belongs to the base it was trained on)."""
    for adapter_id in spec:
        if adapter_id in loaded.adapters.mounted:
            continue
        owner = gateway.models.owner_of(adapter_id)
        if owner is not None and owner.name != loaded.model_id:
            raise APIError(
                400,
                f"adapter {adapter_id!r} belongs to model {owner.name!r}, not to "
                f"{loaded.model_id!r} (the model this request names)",
                param="adapter",
                code="adapter_model_mismatch",
            )
    try:
        loaded.adapters.check(spec)
    except KeyError as e:
        code = adapter_error_code(e)
        raise APIError(400, str(e).strip("'\""), param="adapter", code=code) from None
