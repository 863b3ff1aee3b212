"""The HTTP server: one FastAPI app over one chat service, every protocol mounted.

Contract: `create_app(state)` serves `/v1/chat/completions`, `/v1/responses`, `/v1/messages`,
`/v1/messages/count_tokens`, `/v1/models`, `/v1/models/{id}`, `/v1/sessions`, `/v1/sessions/{id}`, `/v1/memory`,
`/health` and `/metrics`. With an
API key, every route but `/health` needs `Authorization: Bearer KEY` or `x-api-key: KEY`
(constant-time compare). Any error, including a bug, is answered in the caller's protocol shape
(Anthropic's for `/v1/messages*`, OpenAI's elsewhere); the server keeps serving.
"""

from __future__ import annotations

import hmac
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from adapters import anthropic_messages, memory, openai_chat, openai_responses, sessions
from adapters.common import ApiError, anthropic_error_body, openai_error_body
from adapters.state import AppState
from engine.errors import CapacityError, EngineError
from freetoken_agent.service import ContextTooLong

log = logging.getLogger("freetoken.server")


def _is_anthropic(request: Request) -> bool:
    return request.url.path.startswith("/v1/messages") or "anthropic-version" in request.headers


class AuthAndCount:
    """Pure ASGI middleware (not BaseHTTPMiddleware, which hides client disconnects from handlers):
    checks the API key in constant time and counts responses by route and status."""

    OPEN = ("/health", "/", "/api/hello")

    def __init__(self, app: ASGIApp, state: AppState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if self.state.api_key and path not in self.OPEN:
            request = Request(scope)
            given = request.headers.get("x-api-key") or ""
            bearer = request.headers.get("authorization") or ""
            if bearer.lower().startswith("bearer "):
                given = given or bearer[7:].strip()
            if not hmac.compare_digest(given.encode(), self.state.api_key.encode()):
                err = ApiError(401, "invalid API key", type="authentication_error", code="invalid_api_key")
                await _error_response(request, err)(scope, receive, send)
                self.state.metrics.requests.labels(path, "401").inc()
                return
        status = 500

        async def counting_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            self.state.metrics.requests.labels(path, str(status)).inc()


def _error_response(request: Request, err: ApiError) -> JSONResponse:
    body = anthropic_error_body(err) if _is_anthropic(request) else openai_error_body(err)
    state: AppState | None = getattr(request.app.state, "ft", None)
    if state is not None:
        state.metrics.errors.labels(request.url.path, str(err.status)).inc()
    return JSONResponse(body, status_code=err.status if err.status != 499 else 400)


def _from_engine(err: EngineError) -> ApiError:
    if isinstance(err, ContextTooLong):
        return ApiError(400, str(err), code="context_length_exceeded", param="messages")
    if isinstance(err, CapacityError):
        return ApiError(503, str(err), type="server_error", code="overloaded")
    return ApiError(400, str(err))


def create_app(state: AppState) -> FastAPI:
    app = FastAPI(title="freetoken-agent", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.ft = state

    app.add_middleware(AuthAndCount, state=state)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError) -> JSONResponse:
        return _error_response(request, err)

    @app.exception_handler(EngineError)
    async def engine_error(request: Request, err: EngineError) -> JSONResponse:
        return _error_response(request, _from_engine(err))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, err: RequestValidationError) -> JSONResponse:
        return _error_response(request, ApiError(400, f"invalid request: {err.errors()}"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        return _error_response(request, ApiError(err.status_code, str(err.detail), type=kind))

    @app.exception_handler(Exception)
    async def crash(request: Request, err: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return _error_response(request, ApiError(500, f"internal error: {type(err).__name__}: {err}",
                                                 type="server_error"))

    @app.get("/health")
    async def health() -> dict[str, Any]:
        eng = state.service.engine
        load = eng.stats()
        out: dict[str, Any] = {"status": "ok", "model": state.model_name, "running": load["running"],
                               "waiting": load["waiting"]}
        stalled = eng.stalled_step_s()
        if stalled is not None:  # a step past FREETOKEN_STEP_WATCH_S: the log holds where it stands
            out["status"] = "stalled"
            out["stalled_step_s"] = round(stalled, 1)
        gpu = eng.gpu_report()
        if gpu is not None:  # --gpu-memory: the cap, its split and the measured peak beside it
            out["gpu_memory"] = gpu
        return out

    @app.api_route("/", methods=["GET", "HEAD"])
    @app.api_route("/api/hello", methods=["GET", "HEAD"])
    async def hello() -> dict[str, str]:
        return {"status": "ok"}

    def model_card() -> dict[str, Any]:
        svc = state.service
        return {"id": state.model_name, "object": "model", "type": "model", "created": state.created,
                "created_at": "1970-01-01T00:00:00Z", "owned_by": "freetoken-agent",
                "display_name": state.model_name, "context_window": svc.context_window,
                "context_length": svc.context_window, "max_model_len": svc.context_window,
                "max_input_tokens": svc.context_window - 1, "max_tokens": svc.max_output_tokens,
                "max_output_tokens": svc.max_output_tokens}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = model_card()
        return {"object": "list", "data": [card], "has_more": False, "first_id": card["id"], "last_id": card["id"]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        state.check_model(model_id)
        return model_card()

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        state.metrics.running.set(state.service.engine.stats()["running"])
        state.metrics.observe_engine(state.service.engine)
        return PlainTextResponse(generate_latest(state.metrics.registry).decode(),
                                 media_type="text/plain; version=0.0.4")

    app.include_router(openai_chat.router)
    app.include_router(openai_responses.router)
    app.include_router(anthropic_messages.router)
    app.include_router(sessions.router)
    app.include_router(memory.router)
    return app
