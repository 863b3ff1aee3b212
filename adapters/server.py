"""The HTTP server: one FastAPI app over one chat service, every protocol mounted.

Contract: `create_app(state)` serves `/v1/chat/completions`, `/v1/responses`, `/v1/messages`,
`/v1/messages/count_tokens`, `/v1/models`, `/v1/models/{id}`, `/v1/sessions`, `/v1/sessions/{id}`, `/v1/memory`,
`/health` and `/metrics`. Every request passes `adapters/guard.py` first (request id, Host
allow-list, API key and admin key, JSON-only bodies under a size cap, metrics by route template).
Any error, including a bug, is answered in the caller's protocol shape (Anthropic's for
`/v1/messages*`, OpenAI's elsewhere); a 500 says only "internal error" and the request id (the
exception goes to the log with that id); the server keeps serving. No redirects: `/metrics/` is a
404 (a redirect would echo the Host header).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from adapters import anthropic_messages, memory, openai_chat, openai_responses, sessions
from adapters.common import ApiError, anthropic_error_body, openai_error_body
from adapters.guard import Guard, route_matcher
from adapters.state import AppState
from engine.errors import CapacityError, EngineError
from freetoken_agent.service import ContextTooLong

log = logging.getLogger("freetoken.server")


def _is_anthropic(request: Request) -> bool:
    return request.url.path.startswith("/v1/messages") or "anthropic-version" in request.headers


def request_id(request: Request) -> str:
    return str(request.scope.get("state", {}).get("request_id", "-"))


def _error_response(request: Request, err: ApiError) -> JSONResponse:
    if err.status >= 500 and "request id" not in err.message:
        rid = request_id(request)
        if err.detail:
            log.error("%s on %s (%s): %s", err.message, request.url.path, rid, err.detail)
        err = ApiError(err.status, f"{err.message} (request id {rid})", type=err.type, code=err.code, param=err.param)
    body = anthropic_error_body(err) if _is_anthropic(request) else openai_error_body(err)
    state: AppState | None = getattr(request.app.state, "ft", None)
    if state is not None:
        route = request.scope.get("state", {}).get("route", "unmatched")
        state.metrics.errors.labels(route, str(err.status)).inc()
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

    app.router.redirect_slashes = False
    app.add_middleware(Guard, limits=state.limits, route_of=route_matcher(app.router.routes),
                       count=lambda route, status: state.metrics.requests.labels(route, status).inc(),
                       draining=state.drain.started)

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
        rid = request_id(request)
        log.exception("unhandled error on %s (%s)", request.url.path, rid)
        return _error_response(request, ApiError(500, f"internal error (request id {rid})", type="server_error"))

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
        load = state.service.engine.stats()
        state.metrics.running.set(load["running"])
        state.metrics.kv_in_use.set(load["kv_tokens_used"])
        state.metrics.prefill_passes.set(load["prefill_passes"])
        state.metrics.request_kv.set(state.service.tokens_in_flight())
        state.metrics.observe_engine(state.service.engine)
        return PlainTextResponse(generate_latest(state.metrics.registry).decode(),
                                 media_type="text/plain; version=0.0.4")

    app.include_router(openai_chat.router)
    app.include_router(openai_responses.router)
    app.include_router(anthropic_messages.router)
    app.include_router(sessions.router)
    app.include_router(memory.router)
    return app
