"""The FastAPI app: routes, each API's error shape, queue headers, and cancelling the jobs of clients that left.

`create_app(state)` is independent of uvicorn: the CLI runs it with uvicorn, and tests can too, in-process.
Request bodies are read as JSON by hand (not through pydantic models) so that every refusal, from malformed
JSON to a missing field, is a 400 in the API's own error shape with a plain message.
"""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import (
    JSONResponse,
    PlainTextResponse,
    Response,
    StreamingResponse,
)
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from . import anthropic_api, openai_api
from .common import APIError, parse_body, unknown_model
from .state import ServerState
from .worker import SHUTTING_DOWN, Job

QUEUE_HEADER = "x-rocketllm-queue-position"
DISCONNECT_POLL_S = 0.2  # how often a waiting non-streaming request checks that its client is still there


def _api_of(path: str) -> str:
    return "anthropic" if path.startswith("/v1/messages") else "openai"


def _error(api: str, err: APIError, headers: dict | None = None) -> JSONResponse:
    body = anthropic_api.error_body(err) if api == "anthropic" else openai_api.error_body(err)
    return JSONResponse(body, status_code=err.status, headers=headers)


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="RocketLLM", version=__version__, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.rocketllm = state

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        api = _api_of(request.url.path)
        if exc.status_code == 404:
            err = APIError(404, f"no route {request.method} {request.url.path}; this server has /v1/chat/completions, "
                                "/v1/completions, /v1/messages, /v1/models, /health and /metrics")
        elif exc.status_code == 405:
            err = APIError(405, f"{request.method} is not allowed on {request.url.path}")
        else:
            err = APIError(exc.status_code, str(exc.detail))
        state.metrics.request(request.url.path if exc.status_code != 404 else "other", err.status)
        return _error(api, err)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return _error(_api_of(request.url.path), APIError(400, f"{where or 'request'}: {first.get('msg', 'invalid request')}", where or None))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        state.log(f"error: {request.method} {request.url.path}: {type(exc).__name__}: {exc}")
        return _error(_api_of(request.url.path), APIError(500, f"internal error ({type(exc).__name__}: {exc})"))

    # -- information ------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        state.metrics.request("/health", 200)
        return state.health()

    @app.get("/metrics")
    async def metrics():
        state.metrics.request("/metrics", 200)
        return PlainTextResponse(state.metrics_text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def list_models(request: Request):
        state.metrics.request("/v1/models", 200)
        if "anthropic-version" in request.headers:
            return anthropic_api.models(state)
        return openai_api.models(state)

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str, request: Request):
        if model_id != state.model_id:
            state.metrics.request("/v1/models", 404)
            return _error("anthropic" if "anthropic-version" in request.headers else "openai", unknown_model(model_id, state))
        state.metrics.request("/v1/models", 200)
        if "anthropic-version" in request.headers:
            return anthropic_api.models(state)["data"][0]
        return openai_api.model_card(state)

    # -- generation -------------------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _generate(request, "/v1/chat/completions", "openai", openai_api.prepare_chat,
                               openai_api.chat_response, openai_api.chat_stream)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _generate(request, "/v1/completions", "openai", openai_api.prepare_completion,
                               openai_api.completion_response, openai_api.completion_stream)

    @app.post("/v1/messages")
    async def messages(request: Request):
        return await _generate(request, "/v1/messages", "anthropic", anthropic_api.prepare_messages,
                               anthropic_api.message_response, anthropic_api.message_stream)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        endpoint = "/v1/messages/count_tokens"
        try:
            body = parse_body(await request.body())
            result = anthropic_api.count_tokens(body, state)
        except APIError as err:
            state.metrics.request(endpoint, err.status)
            return _error("anthropic", err)
        state.metrics.request(endpoint, 200)
        return result

    async def _generate(request: Request, endpoint: str, api: str, prepare, respond, stream):
        try:
            body = parse_body(await request.body())
            prepared = prepare(body, state)
        except APIError as err:
            state.metrics.request(endpoint, err.status)
            return _error(api, err)
        job = Job(prepared.request, endpoint)
        job.attach(asyncio.get_running_loop(), prepared.stream)
        try:
            position = state.worker.submit(job)
        except RuntimeError as exc:
            state.metrics.request(endpoint, 503)
            return _error(api, APIError(503, str(exc)))
        headers = {**prepared.headers, QUEUE_HEADER: str(position)}
        if prepared.stream:
            return StreamingResponse(_streamed(job, stream(job, prepared, state), endpoint), media_type="text/event-stream",
                                     headers={**headers, "cache-control": "no-cache", "x-accel-buffering": "no"})
        kind, payload = await _wait(job, request)
        if state.stopping and kind in ("cancelled", "stopping"):
            state.metrics.request(endpoint, 503)
            return _error(api, APIError(503, SHUTTING_DOWN), headers)
        if kind == "cancelled":
            state.metrics.request(endpoint, 499)
            return Response(status_code=499, headers=headers)
        if kind == "failed":
            state.metrics.request(endpoint, 500)
            return _error(api, APIError(500, f"generation failed: {type(payload).__name__}: {payload}"), headers)
        state.metrics.request(endpoint, 200)
        return JSONResponse(respond(payload, prepared, state), headers=headers)

    async def _wait(job: Job, request: Request):
        """The job's final event, or "stopping" (the server stops); a client that disconnects meanwhile has its job cancelled."""
        while True:
            try:
                kind, payload = await job.next_event(DISCONNECT_POLL_S)
            except (asyncio.TimeoutError, TimeoutError):
                if await request.is_disconnected():
                    state.worker.cancel(job)
                    return "cancelled", None
                continue
            if kind != "text":
                return kind, payload

    async def _streamed(job: Job, events, endpoint: str):
        """Pass the stream through; however it ends (finished, client gone, server stopping), the job is not left running."""
        status = 200
        try:
            async for item in events:
                yield item
        except BaseException:
            status = 499
            raise
        finally:
            if not job.finished:
                state.worker.cancel(job)
                status = 499
            elif job.state == "failed":
                status = 500
            state.metrics.request(endpoint, status)

    return app
