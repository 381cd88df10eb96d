"""The HTTP app: OpenAI chat/completions and completions, models, health, stats.

Every response carries `X-Request-ID` (the client's, or a new one); errors are OpenAI-shaped and
bad input is a 4xx, never a 500. While draining (Ctrl-C/SIGTERM) new requests get 503.
"""

from __future__ import annotations

import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from mlxlab.config import ServeConfig
from mlxlab.serve import pipeline
from mlxlab.serve.engine import Delta, Done, Failed, Gateway, Job
from mlxlab.serve.protocol import APIError, ChatRequest, CompletionRequest

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _error_response(err: APIError, request_id: str | None = None, path: str = "") -> JSONResponse:
    """The error in the shape of the protocol the path belongs to (Anthropic under /v1/messages)."""
    headers = dict(err.headers)
    if request_id:
        headers["X-Request-ID"] = request_id
    status, body = err.anthropic() if path.startswith("/v1/messages") else (err.status, err.body())
    return JSONResponse(body, status_code=status, headers=headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return f"malformed JSON body: {first.get('msg')}", None
    param = ".".join(loc) or None
    return (f"{param + ': ' if param else ''}{first.get('msg')}"
            + (f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else "")), param


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def usage_of(done: Done) -> dict:
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": done.cached_tokens}}


def tool_calls_of(done: Done) -> list[dict]:
    return [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in done.tool_calls]


def create_app(cfg: ServeConfig, gateway: Gateway) -> FastAPI:
    app = FastAPI(title="mlxlab", docs_url=None, redoc_url=None)
    app.state.gateway = gateway
    app.state.draining = False

    @app.middleware("http")
    async def request_id(request: Request, call_next):
        rid = request.headers.get("x-request-id") or f"req_{uuid.uuid4().hex}"
        request.state.request_id = rid
        if app.state.draining and request.url.path != "/health":
            return _error_response(APIError(503, "the server is shutting down", type="service_unavailable",
                                            code="draining", headers={"Retry-After": "10"}), rid, request.url.path)
        response = await call_next(request)
        response.headers["X-Request-ID"] = rid
        return response

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return _error_response(exc, getattr(request.state, "request_id", None), request.url.path)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return _error_response(APIError(400, message, param=param), getattr(request.state, "request_id", None),
                               request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
        return _error_response(APIError(exc.status_code, str(exc.detail), type=kind),
                               getattr(request.state, "request_id", None), request.url.path)

    @app.exception_handler(Exception)
    async def crashed(request: Request, exc: Exception):
        return _error_response(APIError(500, f"internal error: {exc}", type="server_error"),
                               getattr(request.state, "request_id", None), request.url.path)

    # --- status -------------------------------------------------------------------------------

    @app.get("/health")
    async def health():
        g = app.state.gateway
        ok = g.state == "ready" and not app.state.draining
        body = {"status": "ok" if ok else ("draining" if app.state.draining else g.state),
                "model": cfg.model}
        if g.error:
            body["error"] = g.error
        return JSONResponse(body, status_code=200 if ok else 503)

    def model_card() -> dict:
        loaded = gateway.loaded
        return {"id": cfg.model, "object": "model", "created": int(gateway.started_at), "owned_by": "mlxlab",
                "context_length": loaded.admission.max_safe_context if loaded else None}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != cfg.model:
            raise APIError(404, f"model {model_id!r} is not served here (serving {cfg.model!r})",
                           type="not_found_error", param="model", code="model_not_found")
        return model_card()

    @app.get("/stats")
    async def stats():
        g = app.state.gateway
        loaded = g.loaded
        return {
            "server": {"model": cfg.model, "started_at": g.started_at, "uptime_s": round(time.time() - g.started_at, 1),
                       "state": g.state, "draining": app.state.draining, "host": cfg.host, "port": cfg.port},
            "prompt_cache": loaded.cache.stats() if loaded else None,
            "admission": loaded.admission.stats() if loaded else None,
            "queue": g.stats(),
            "response_store": app.state.response_store.stats(),
            "adapters": loaded.adapters.stats() if loaded else None,
            "batch": g.batch_stats(),
            "kv_quant": loaded.kv.stats() if loaded else None,
        }

    # --- generation ---------------------------------------------------------------------------

    def chat_job(body: ChatRequest) -> Job:
        messages = pipeline.normalize_messages([m.model_dump(exclude_none=True) for m in body.messages])
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        return pipeline.chat_job(gateway, cfg, messages, body, tools=None if body.tool_choice == "none" else tools,
                                 stops=body.stop_list(), limit=body.completion_limit(), logprobs=body.logprobs,
                                 top_logprobs=body.top_logprobs or 0, template_kwargs=body.chat_template_kwargs)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        job = chat_job(body)
        job.id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        head = {"id": job.id, "created": created, "model": cfg.model}
        if body.stream:
            events = await pipeline.start(gateway, job)  # queue-full and not-ready errors still answer as JSON

            async def stream():
                yield sse({**head, "object": "chat.completion.chunk",
                           "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}]})
                async for ev in events:
                    if isinstance(ev, Delta):
                        delta = {"reasoning_content" if ev.kind == "reasoning" else "content": ev.text}
                        if not ev.text and not ev.logprobs:
                            continue
                        yield sse({**head, "object": "chat.completion.chunk",
                                   "choices": [{"index": 0, "delta": delta if ev.text else {},
                                                "logprobs": {"content": ev.logprobs} if ev.logprobs else None,
                                                "finish_reason": None}]})
                    elif isinstance(ev, Done):
                        if ev.tool_calls:
                            calls = [{"index": i, **c} for i, c in enumerate(tool_calls_of(ev))]
                            yield sse({**head, "object": "chat.completion.chunk",
                                       "choices": [{"index": 0, "delta": {"tool_calls": calls},
                                                    "logprobs": None, "finish_reason": None}]})
                        yield sse({**head, "object": "chat.completion.chunk",
                                   "choices": [{"index": 0, "delta": {}, "logprobs": None,
                                                "finish_reason": ev.finish_reason}]})
                        if body.include_usage():
                            yield sse({**head, "object": "chat.completion.chunk", "choices": [],
                                       "usage": usage_of(ev)})
                    elif isinstance(ev, Failed):
                        yield sse(APIError(500, ev.message, type="server_error").body())
                yield "data: [DONE]\n\n"

            return StreamingResponse(stream(), media_type="text/event-stream", headers=SSE_HEADERS)

        got = await pipeline.collect(gateway, job, request.is_disconnected)
        done = got.done
        message = {"role": "assistant", "content": got.content}
        if got.reasoning:
            message["reasoning_content"] = got.reasoning
        if done.tool_calls:
            message["tool_calls"] = tool_calls_of(done)
        return {**head, "object": "chat.completion",
                "choices": [{"index": 0, "message": message, "finish_reason": done.finish_reason,
                             "logprobs": {"content": got.logprobs} if body.logprobs else None}],
                "usage": usage_of(done)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        loaded = pipeline.ready_loaded(gateway)
        if body.echo or body.suffix:
            raise APIError(400, f"{'echo' if body.echo else 'suffix'} is not supported by this server",
                           param="echo" if body.echo else "suffix")
        prompt = pipeline.render_text(loaded, body.prompt)
        if not prompt:
            raise APIError(400, "prompt is empty", param="prompt")
        job = pipeline.make_job(loaded, cfg, prompt, body, stops=body.stop_list(), limit=body.completion_limit(),
                                logprobs=body.logprobs is not None, top_logprobs=body.logprobs or 0)
        job.id = f"cmpl-{uuid.uuid4().hex[:24]}"
        head = {"id": job.id, "object": "text_completion", "created": int(time.time()), "model": cfg.model}

        def legacy(entries):
            if not entries:
                return None
            return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
                    "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
                    "text_offset": []}

        if body.stream:
            events = await pipeline.start(gateway, job)

            async def stream():
                async for ev in events:
                    if isinstance(ev, Delta) and (ev.text or ev.logprobs):
                        yield sse({**head, "choices": [{"index": 0, "text": ev.text,
                                                        "logprobs": legacy(ev.logprobs), "finish_reason": None}]})
                    elif isinstance(ev, Done):
                        yield sse({**head, "choices": [{"index": 0, "text": "", "logprobs": None,
                                                        "finish_reason": ev.finish_reason}]})
                        if body.include_usage():
                            yield sse({**head, "choices": [], "usage": usage_of(ev)})
                    elif isinstance(ev, Failed):
                        yield sse(APIError(500, ev.message, type="server_error").body())
                yield "data: [DONE]\n\n"

            return StreamingResponse(stream(), media_type="text/event-stream", headers=SSE_HEADERS)

        got = await pipeline.collect(gateway, job, request.is_disconnected)
        return {**head, "choices": [{"index": 0, "text": got.content, "logprobs": legacy(got.logprobs),
                                     "finish_reason": got.done.finish_reason}], "usage": usage_of(got.done)}

    from mlxlab.serve import adapters, anthropic, responses

    adapters.register(app, cfg, gateway)
    anthropic.register(app, cfg, gateway)
    responses.register(app, cfg, gateway)
    return app

