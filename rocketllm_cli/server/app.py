"""The FastAPI app: routes, each API's error shape, queue headers, and cancelling the jobs of clients that left.

`create_app(state)` is independent of uvicorn: the CLI runs it with uvicorn, and tests can too, in-process.
Request bodies are read as JSON by hand (not through pydantic models) so that every refusal, from malformed
JSON to a missing field, is a 400 in the API's own error shape with a plain message.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

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
from . import anthropic_api, anthropic_requests, openai_api, openai_requests, responses_api, responses_requests, tokens
from .client import KEEP_ALIVE_HEADER, STATS_HEADER
from .events import outcomes_of
from .fields import parse_body
from .refusals import APIError, unknown_model
from .routes import OPEN, api_of, endpoint_label, given_keys
from .state import ServerState
from .worker import SHUTTING_DOWN, Job, QueueFull

QUEUE_HEADER = "x-rocketllm-queue-position"
JOB_HEADER = "x-rocketllm-job"  # the job's number in arrival order, as logs and /health's history name it
DISCONNECT_POLL_S = 0.2  # how often a waiting non-streaming request checks that its client is still there


class KeyCheck:
    """ASGI middleware: with an API key set, every request but /health must carry it, or gets 401 in its API's shape.
    (Plain ASGI rather than an @app.middleware, which would wrap streaming responses and their disconnects.)"""

    def __init__(self, app, state: ServerState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.state.auth_required or scope["path"] in OPEN:
            return await self.app(scope, receive, send)
        from starlette.datastructures import Headers

        headers = Headers(scope=scope)
        given = given_keys(headers)
        if any(self.state.key_matches(key) for key in given):  # each compared in constant time
            return await self.app(scope, receive, send)
        api = api_of(scope["path"], headers)
        what = "wrong" if given else "missing"
        if api == "anthropic":
            err = APIError(
                401, f"{what} API key: send the server's key in the x-api-key header", None, "invalid_api_key"
            )
            extra = {}
        else:
            err = APIError(
                401, f"{what} API key: send the server's key as 'Authorization: Bearer <key>'", None, "invalid_api_key"
            )
            extra = {"www-authenticate": "Bearer"}
        self.state.metrics.request(endpoint_label(scope["path"]), 401)
        await _error(api, err, extra)(scope, receive, send)


DRAIN_MAX = 64 << 20  # bytes of a refused body read and dropped before the 413, so the client gets to read the reply


async def _read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 past `limit` bytes, declared or as it arrives. The rest of a refused body is
    read and dropped (up to max(DRAIN_MAX, 4 x limit)) before answering: a server that answers and closes while the
    client still sends makes clients such as Python's urllib report "connection reset" instead of the 413."""
    declared = request.headers.get("content-length")
    size, chunks = 0, []
    over = declared is not None and declared.strip().isdigit() and int(declared) > limit
    async for chunk in request.stream():
        size += len(chunk)
        over = over or size > limit
        if over:
            chunks = []
            if size > max(DRAIN_MAX, 4 * limit):
                break
            continue
        chunks.append(chunk)
    if over:
        shown = int(declared) if declared is not None and declared.strip().isdigit() else f"over {limit}"
        raise APIError(
            413, f"the request body is {shown} bytes; this server takes at most {limit} (a context's worth of prompt)"
        )
    return b"".join(chunks)


def _error(api: str, err: APIError, headers: dict | None = None) -> JSONResponse:
    body = anthropic_api.error_body(err) if api == "anthropic" else openai_api.error_body(err)
    return JSONResponse(body, status_code=err.status, headers=headers)


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="RocketLLM", version=__version__, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.rocketllm = state
    app.add_middleware(KeyCheck, state=state)
    # Parsing a body and rendering its prompt (a chat template over a long conversation) run on one thread of their
    # own, in arrival order, so the event loop stays free for /health, /metrics and the open streams.
    prepare_pool = ThreadPoolExecutor(1, thread_name_prefix="rocketllm-prepare")
    state.prepare_pool = prepare_pool  # shut down with the state

    async def prepared_body(request: Request, prepare):
        raw = await _read_body(request, state.max_body)
        return await asyncio.get_running_loop().run_in_executor(prepare_pool, lambda: prepare(parse_body(raw), state))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        api = api_of(request.url.path)
        if exc.status_code == 404:
            err = APIError(
                404,
                f"no route {request.method} {request.url.path}; this server has /v1/chat/completions, "
                "/v1/completions, /v1/responses, /v1/messages, /v1/models, /tokenize, /detokenize, "
                "/tokenizer_info, "
                "/health and /metrics",
            )
        elif exc.status_code == 405:
            err = APIError(405, f"{request.method} is not allowed on {request.url.path}")
        else:
            err = APIError(exc.status_code, str(exc.detail))
        state.metrics.request(endpoint_label(request.url.path) if exc.status_code != 404 else "other", err.status)
        return _error(api, err)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return _error(
            api_of(request.url.path),
            APIError(400, f"{where or 'request'}: {first.get('msg', 'invalid request')}", where or None),
        )

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        return internal(request, exc)

    def internal(request: Request, exc: Exception) -> JSONResponse:
        # The exception's type and where, not its message: that may quote the request (and so the prompt).
        state.log(
            f"error: {request.method} {endpoint_label(request.url.path)}: internal error "
            f"({type(exc).__name__}); the server goes on serving"
        )
        state.metrics.request(endpoint_label(request.url.path), 500)
        return _error(
            api_of(request.url.path, request.headers), APIError(500, f"internal error ({type(exc).__name__})")
        )

    def guarded(route):
        """A route whose unexpected exception is a 500 in its API's shape and one log line (the app-wide handler
        answers too, but Starlette then raises again, and uvicorn logs a traceback)."""

        async def handler(request: Request):
            try:
                return await route(request)
            except Exception as exc:  # noqa: BLE001 - a bug must not look like a crash to the client or the log
                return internal(request, exc)

        handler.__name__, handler.__doc__ = route.__name__, route.__doc__
        return handler

    # -- information ------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if state.pipeline_failure is not None:  # a load balancer's probe sees the pipeline is down
            state.metrics.request("/health", 503)
            return JSONResponse(state.health(), status_code=503)
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
            return _error(
                "anthropic" if "anthropic-version" in request.headers else "openai", unknown_model(model_id, state)
            )
        state.metrics.request("/v1/models", 200)
        if "anthropic-version" in request.headers:
            return anthropic_api.models(state)["data"][0]
        return openai_api.model_card(state)

    # -- generation -------------------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    @guarded
    async def chat_completions(request: Request):
        return await _generate(
            request,
            "/v1/chat/completions",
            "openai",
            openai_requests.prepare_chat,
            openai_api.chat_response,
            openai_api.chat_stream,
        )

    @app.post("/v1/completions")
    @guarded
    async def completions(request: Request):
        return await _generate(
            request,
            "/v1/completions",
            "openai",
            openai_requests.prepare_completion,
            openai_api.completion_response,
            openai_api.completion_stream,
        )

    @app.post("/v1/responses")
    @guarded
    async def responses(request: Request):
        return await _generate(
            request,
            "/v1/responses",
            "openai",
            responses_requests.prepare_response,
            responses_api.response_body,
            responses_api.response_stream,
        )

    # -- the tokenizer (llama-server's and vLLM's shapes: lm-evaluation-harness's remote tokenizer uses them) ---------
    async def _tokenizer_route(request: Request, endpoint: str, answer):
        try:
            result = await prepared_body(request, answer)
        except APIError as err:
            state.metrics.request(endpoint, err.status)
            return _error("openai", err)
        state.metrics.request(endpoint, 200)
        return result

    @app.post("/tokenize")
    @guarded
    async def tokenize(request: Request):
        return await _tokenizer_route(request, "/tokenize", tokens.tokenize)

    @app.post("/detokenize")
    @guarded
    async def detokenize(request: Request):
        return await _tokenizer_route(request, "/detokenize", tokens.detokenize)

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        state.metrics.request("/tokenizer_info", 200)
        return tokens.tokenizer_info(state)

    @app.post("/v1/messages")
    @guarded
    async def messages(request: Request):
        return await _generate(
            request,
            "/v1/messages",
            "anthropic",
            anthropic_requests.prepare_messages,
            anthropic_api.message_response,
            anthropic_api.message_stream,
        )

    @app.post("/v1/messages/count_tokens")
    @guarded
    async def count_tokens(request: Request):
        endpoint = "/v1/messages/count_tokens"
        try:
            result = await prepared_body(request, anthropic_requests.count_tokens)
        except APIError as err:
            state.metrics.request(endpoint, err.status)
            return _error("anthropic", err)
        state.metrics.request(endpoint, 200)
        return result

    def queue_full(api: str, endpoint: str, full: QueueFull) -> JSONResponse:
        state.metrics.request(endpoint, 429)
        state.metrics.queue_full()
        return _error(api, APIError(429, str(full), None, "queue_full"), {"retry-after": str(full.retry_after)})

    def pipeline_down(api: str, endpoint: str) -> JSONResponse | None:
        down = state.pipeline_failure
        if down is None:
            return None
        state.metrics.request(endpoint, 503)
        return _error(api, APIError(503, f"the pipeline is down: {down}; restart the stages (torchrun)"))

    async def _generate(request: Request, endpoint: str, api: str, prepare, respond, stream):
        down = pipeline_down(api, endpoint)
        if down is not None:
            return down
        full = state.worker.full()
        # refused before its prompt is rendered: a full server spends nothing on what it turns away
        if full is not None:
            return queue_full(api, endpoint, full)
        try:
            prepared = await prepared_body(request, prepare)
        except APIError as err:
            state.metrics.request(endpoint, err.status)
            return _error(api, err)
        prepared.stats = request.headers.get(STATS_HEADER) == "1"
        state.set_keep_alive(request.headers.get(KEEP_ALIVE_HEADER))
        job = Job(prepared.rows(), endpoint)
        job.attach(asyncio.get_running_loop(), prepared.stream)
        try:
            position = state.worker.submit(job)
        except QueueFull as full:
            return queue_full(api, endpoint, full)
        except RuntimeError as exc:
            state.metrics.request(endpoint, 503)
            return _error(api, APIError(503, str(exc)))
        headers = {**prepared.headers, QUEUE_HEADER: str(position), JOB_HEADER: str(job.id)}
        if prepared.stream:
            return StreamingResponse(
                _streamed(job, stream(job, prepared, state), endpoint),
                media_type="text/event-stream",
                headers={**headers, "cache-control": "no-cache", "x-accel-buffering": "no"},
            )
        kind, payload = await _wait(job, request)
        if state.stopping and kind in ("cancelled", "stopping"):
            state.metrics.request(endpoint, 503)
            return _error(api, APIError(503, SHUTTING_DOWN), headers)
        if kind == "cancelled":
            state.metrics.request(endpoint, 499)
            return Response(status_code=499, headers=headers)
        if kind == "failed" and state.pipeline_failure is not None:
            return pipeline_down(api, endpoint)
        if kind == "failed":
            state.metrics.request(endpoint, 500)
            return _error(api, APIError(500, f"generation failed: {type(payload).__name__}: {payload}"), headers)
        state.metrics.request(endpoint, 200)
        return JSONResponse(respond(outcomes_of(job, payload), prepared, state), headers=headers)

    async def _wait(job: Job, request: Request):
        """The job's final event, or "stopping" (the server stops); a client that disconnects meanwhile has its job
        cancelled."""
        while True:
            try:
                kind, payload = await job.next_event(DISCONNECT_POLL_S)
            except (asyncio.TimeoutError, TimeoutError):
                if await request.is_disconnected():
                    state.worker.cancel(job)
                    return "cancelled", None
                continue
            if kind not in ("text", "logprobs"):
                return kind, payload

    async def _streamed(job: Job, events, endpoint: str):
        """Pass the stream through; however it ends (finished, client gone, server stopping), the job is not left
        running."""
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
