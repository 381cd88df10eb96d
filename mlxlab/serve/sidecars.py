"""The models served beside the chat model: a speech-to-text model (`serve.stt_model`, for
/v1/audio/* and chat `input_audio`) and a sentence-embedding model (`serve.embeddings_model`,
for /v1/embeddings). What their routes share:

- `speech(request)` / `embedder(request)`: the loaded model, or a 400 saying how to serve one;
- `on_engine(request, fn)`: `fn` run on the engine thread between generations (the thread
  that runs every model: the chat models, these models and every forward pass share it, so no
  two models ever run at once; only a model loading for serve `models.` reads its weights on
  the loader thread meanwhile, engine/loader.py), with the queue's bound (503 + Retry-After beyond `serve.max_queue`
  such calls waiting) and its not-ready/shutting-down answers;
- `decode_audio(...)`: audio decoding (PyAV, not MLX) on its own thread, off the event loop
  and off the render thread, so a long file does not hold up prompt rendering.

Both models are loaded by the engine thread with the chat model (`engine/loaded.py`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from collections.abc import Callable

from fastapi import Request

from mlxlab.audio.decode import Audio, AudioError, decode
from mlxlab.serve.engine.jobs import NotReady
from mlxlab.serve.http import APIError
from mlxlab.serve.model_choice import ready_loaded

_DECODER = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mlxlab-audio-decode")


def speech(request: Request, what: str = "this route"):
    loaded = ready_loaded(request.app.state.gateway)
    if getattr(loaded, "speech", None) is None:
        raise APIError(
            400,
            f"{what} needs a speech-to-text model and none is served: start the server with "
            "`python -m mlxlab serve stt_model=whisper-base`",
            code="no_speech_model",
        )
    return loaded.speech


def embedder(request: Request):
    loaded = ready_loaded(request.app.state.gateway)
    if getattr(loaded, "embedder", None) is None:
        raise APIError(
            400,
            "/v1/embeddings needs an embedding model and none is served: start the server with "
            "`python -m mlxlab serve embeddings_model=all-minilm-l6-v2`",
            code="no_embeddings_model",
        )
    return loaded.embedder


class _Waiting:
    """How many sidecar calls are queued or running on the engine (per app)."""

    def __init__(self):
        self.count = 0


async def on_engine(request: Request, fn: Callable[[], object]):
    """`fn()` on the engine thread between jobs; its result (its exceptions raise here)."""
    state = request.app.state
    waiting = getattr(state, "sidecar_waiting", None)
    if waiting is None:
        waiting = state.sidecar_waiting = _Waiting()
    cfg, gateway = state.cfg, state.gateway
    if gateway.closing is not None:
        raise APIError(
            503,
            gateway.closing,
            type="service_unavailable",
            code="shutting_down",
            headers={"Retry-After": "10"},
        )
    if waiting.count >= cfg.max_queue:
        raise APIError(
            503,
            f"server busy: {waiting.count} transcription/embedding calls are waiting for the "
            f"engine (max_queue={cfg.max_queue})",
            type="service_unavailable",
            code="queue_full",
            headers={"Retry-After": "2"},
        )
    waiting.count += 1
    try:
        return await gateway.call(fn)
    except NotReady as e:
        raise APIError(
            503, str(e), type="service_unavailable", code="not_ready", headers={"Retry-After": "5"}
        ) from None
    finally:
        waiting.count -= 1


async def decode_audio(source, hint: str | None, label: str, max_seconds: float) -> Audio:
    """`audio.decode.decode` on the decoding thread; an AudioError is a 400 naming the format."""
    loop = asyncio.get_running_loop()
    call = functools.partial(decode, source, hint, label, max_seconds)
    try:
        return await loop.run_in_executor(_DECODER, call)
    except AudioError as e:
        raise APIError(400, str(e), code="invalid_audio") from None


def cards(request: Request) -> list[dict]:
    """/v1/models entries for the speech and embedding models served."""
    g = request.app.state.gateway
    loaded = g.loaded
    out = []
    if getattr(loaded, "speech", None) is not None:
        out.append(
            {
                "id": loaded.speech.name,
                "object": "model",
                "created": int(g.started_at),
                "owned_by": "mlxlab",
                "type": "speech-to-text",
                "endpoints": [
                    "/v1/audio/transcriptions",
                    "/v1/audio/translations",
                    "/v1/chat/completions (input_audio)",
                ],
            }
        )
    if getattr(loaded, "embedder", None) is not None:
        e = loaded.embedder
        out.append(
            {
                "id": e.name,
                "object": "model",
                "created": int(g.started_at),
                "owned_by": "mlxlab",
                "type": "embeddings",
                "dimensions": e.dimensions,
                "max_input_tokens": e.max_tokens,
                "matryoshka": e.matryoshka,
                "endpoints": ["/v1/embeddings"],
            }
        )
    return out


def chat_card(request: Request) -> dict:
    """What the chat model's /v1/models entry says about audio input (empty without speech)."""
    loaded = request.app.state.gateway.loaded
    if getattr(loaded, "speech", None) is None:
        return {}
    return {
        "input_audio": f"transcribed by {loaded.speech.name}; this text model reads the "
        "transcript in place of the audio (what was said, not tone, speakers or sounds)"
    }
