"""`GET /v1/sessions` and `GET /v1/sessions/{id}`: per-session cache inspection as JSON.

Contract: the list is `{"object": "list", "data": [...]}`, most recent session first, each with
`id`, `client`, `parent`, `turns`, `side_requests`, `created`, `last_activity`, `checkpoints` and
`checkpoint_bytes` (None when the engine cannot list its checkpoints), plus the server's
`policy` and the engine's `checkpoint_budget` when it reports one. One session is
`{"object": "session", "id", "client", "turns": [...], ...}` (fields in
`freetoken_agent/sessions/manager.py`); an unknown id is a 404 in the caller's protocol shape.
Authentication is the app's, as for every /v1 route.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from adapters.common import ApiError
from adapters.state import AppState

router = APIRouter()


def _state(request: Request) -> AppState:
    return request.app.state.ft  # type: ignore[no-any-return]


# Plain `def` handlers run in the threadpool: listing the engine's checkpoints waits for the
# current engine step to end, which must not stall the event loop that streams other replies.
@router.get("/v1/sessions")
def list_sessions(request: Request) -> dict[str, Any]:
    sessions = _state(request).service.sessions
    budget_fn = getattr(sessions.engine, "checkpoint_budget", None)
    budget = None
    if callable(budget_fn):
        try:
            budget = budget_fn()
        except Exception:  # inspection never fails the request
            budget = None
    return {"object": "list", "policy": sessions.policy.value, "checkpoint_budget": budget,
            "data": sessions.sessions()}


@router.get("/v1/sessions/{session_id:path}")
def get_session(session_id: str, request: Request) -> dict[str, Any]:
    data = _state(request).service.sessions.session(session_id)
    if data is None:
        raise ApiError(404, f"no session {session_id!r} on this server", type="not_found_error",
                       code="session_not_found", param="session_id")
    return {"object": "session", **data}
