"""The server's front door: one pure ASGI middleware that every HTTP request passes first.

Contract, in order, for each request:
- a request id (`x-request-id` on every response; a 500's message names it, the log line too);
- `Host` must be one of `Limits.allowed_hosts` (any port) when that is not None (421 otherwise):
  a page that rebinds its DNS name to 127.0.0.1 still sends its own name;
- while the server drains for shutdown, new POSTs get a 503;
- the API key (constant-time compare) on every route but `/health`, `/` and `/api/hello`, and on
  `POST /v1/memory` the admin key when one is set;
- a POST must say `Content-Type: application/json` (415 otherwise: a cross-site form or
  `text/plain` POST cannot reach a handler), and its body is read here, whole, up to
  `Limits.max_request_bytes` (413 past it, also from `Content-Length` before any byte is read);
  a client that closes mid-body is counted as status 499 with one warning line and answered nothing;
- responses are counted by route template (`/v1/models/{model_id:path}`, one `unmatched` label for
  paths no route serves), never by the raw path.
Errors are answered in the caller's protocol shape (adapters/common.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from starlette.datastructures import Headers
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from adapters.common import ApiError, anthropic_error_body, openai_error_body

log = logging.getLogger("freetoken.server")
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
OPEN_PATHS = ("/health", "/", "/api/hello")
DISCARD_BYTES, DISCARD_S = 256 << 20, 10.0  # what is read and dropped of a body past the cap


@dataclass(frozen=True)
class Limits:
    max_request_bytes: int | None = None  # None: AppState sizes it for the context window
    allowed_hosts: tuple[str, ...] | None = LOOPBACK_HOSTS  # None: any Host
    api_key: str | None = None
    admin_key: str | None = None


def host_name(value: str) -> str:
    """`Host` without its port, lower case; IPv6 literals without brackets."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def error_message(path: str, headers: Headers, err: ApiError) -> dict[str, object]:
    anthropic = path.startswith("/v1/messages") or "anthropic-version" in headers
    return anthropic_error_body(err) if anthropic else openai_error_body(err)


class Guard:
    """See the module docstring. `route_of(scope)` names the route template (or "unmatched");
    `count(route, status)` records a response; `draining()` is true once shutdown began."""

    def __init__(self, app: ASGIApp, limits: Limits, route_of: Callable[[Scope], str],
                 count: Callable[[str, str], None], draining: Callable[[], bool]) -> None:
        self.app, self.limits, self.route_of, self.count, self.draining = app, limits, route_of, count, draining

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = f"req_{uuid.uuid4().hex[:20]}"
        headers = Headers(scope=scope)
        path, route = scope["path"], self.route_of(scope)
        scope.setdefault("state", {}).update(request_id=rid, route=route)
        status = 500

        async def tagged_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid.encode())]}
            await send(message)

        async def refuse(err: ApiError) -> None:
            from starlette.responses import JSONResponse

            body = error_message(path, headers, err)
            await JSONResponse(body, status_code=err.status)(scope, receive, tagged_send)

        try:
            err = self.check(scope, headers, path)
            if err is not None:
                await refuse(err)
                return
            if scope["method"] == "POST":
                body = await self.read_body(headers, receive)
                if isinstance(body, ApiError):
                    await refuse(body)
                    return
                if body is None:  # the client went away mid-body: nobody to answer
                    status = 499
                    log.warning("%s %s: client closed the request mid-body (%s)", scope["method"], path, rid)
                    return
                receive = _replay(body, receive)
            await self.app(scope, receive, tagged_send)
        finally:
            self.count(route, str(status))

    def check(self, scope: Scope, headers: Headers, path: str) -> ApiError | None:
        allowed = self.limits.allowed_hosts
        if allowed is not None and "*" not in allowed and host_name(headers.get("host", "")) not in allowed:
            return ApiError(421, "this server does not answer for that Host (see serve --allowed-hosts)",
                            code="host_not_allowed")
        if self.draining() and scope["method"] == "POST":
            return ApiError(503, "the server is shutting down", type="server_error", code="shutting_down")
        if path not in OPEN_PATHS:
            key = self.limits.api_key
            if scope["method"] == "POST" and path.rstrip("/") == "/v1/memory" and self.limits.admin_key:
                key = self.limits.admin_key
            if key and not hmac.compare_digest(_given_key(headers).encode(), key.encode()):
                return ApiError(401, "invalid API key", type="authentication_error", code="invalid_api_key")
        if scope["method"] == "POST" and not is_json(headers.get("content-type", "")):
            return ApiError(415, "request bodies must be JSON: send Content-Type: application/json",
                            code="unsupported_media_type")
        return None

    async def read_body(self, headers: Headers, receive: Receive) -> bytes | ApiError | None:
        cap = self.limits.max_request_bytes or 0
        too_big = ApiError(413, f"request body larger than {cap} bytes (serve --max-request-bytes)",
                           type="request_too_large", code="request_too_large")
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > cap:
            return await _discard(receive, too_big)
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > cap:
                return await _discard(receive, too_big) if message.get("more_body", False) else too_big
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts)


async def _discard(receive: Receive, err: ApiError) -> ApiError:
    """Reads and drops the rest of an oversized body (bounded in bytes and time) so that the client,
    still sending, reads the error instead of a reset."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(DISCARD_S):
            dropped = 0
            while dropped < DISCARD_BYTES:
                message = await receive()
                dropped += len(message.get("body", b""))
                if message["type"] == "http.disconnect" or not message.get("more_body", False):
                    break
    return err


def _given_key(headers: Headers) -> str:
    given = headers.get("x-api-key") or ""
    bearer = headers.get("authorization") or ""
    if bearer.lower().startswith("bearer "):
        given = given or bearer[7:].strip()
    return given


def _replay(body: bytes, receive: Receive) -> Receive:
    """The body read once, then the real channel (which reports a later disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def route_matcher(routes: Sequence[BaseRoute]) -> Callable[[Scope], str]:
    """The template of the route that serves `scope` (a method mismatch still names it)."""

    def route_of(scope: Scope, among: Sequence[BaseRoute] = routes) -> str:
        partial = None
        for route in among:
            match, _ = route.matches(scope)
            inner = getattr(route, "original_router", None)  # an included router (prefix-free here)
            if match == Match.FULL:
                return route_of(scope, inner.routes) if inner is not None else str(getattr(route, "path", "?"))
            if match == Match.PARTIAL and partial is None:
                partial = route_of(scope, inner.routes) if inner is not None else str(getattr(route, "path", "?"))
        return partial or "unmatched"

    return route_of
