"""What every protocol adapter shares: errors in each protocol's shape, SSE framing, keep-alive
pings, client-disconnect handling, and message-content normalisation.

Contract: raise `ApiError(status, message, ...)` anywhere in a handler; the app renders it in the
caller's protocol (OpenAI `{"error": {...}}` or Anthropic `{"type": "error", ...}`).
`pinged(stream, interval)` yields a generation's items with `None` inserted whenever `interval`
seconds pass without one; leaving it early (client gone) unsubscribes, which aborts the
generation when no one else listens. `until_disconnect(request, coro)` runs a non-streaming
handler's work and cancels it if the client goes away. `forced_output_of(body)` reads the
benchmark-only extension field `freetoken_forced_output` (a non-empty string, or absent).
`Drain` is the shutdown clock: once `begin(grace)` ran, `pinged` ends a stream still running at
the deadline with a `Finish` carrying the error "the server is shutting down" (each protocol
renders it as its error event) and `until_disconnect` answers 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from freetoken_agent.service import Chunk, Finish, GenerationStream

T = TypeVar("T")
SHUTTING_DOWN = "the server is shutting down"


class Drain:
    def __init__(self) -> None:
        self.deadline: float | None = None

    def begin(self, grace: float) -> None:
        if self.deadline is None:
            self.deadline = time.monotonic() + max(0.0, grace)

    def started(self) -> bool:
        return self.deadline is not None

    def left(self) -> float | None:
        """Seconds until running work is cut; None when no shutdown began."""
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())


class ApiError(Exception):
    """An error answered to the client; `detail` (for the log only) is never sent."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, detail: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param
        self.detail = detail


def openai_error_body(err: ApiError) -> dict[str, Any]:
    return {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}}


_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                    503: "overloaded_error"}


def anthropic_error_body(err: ApiError) -> dict[str, Any]:
    kind = _ANTHROPIC_TYPES.get(err.status, "invalid_request_error" if err.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


class SSEResponse(StreamingResponse):
    """An event stream whose generator is closed as soon as the response ends, also when the client
    went away mid-stream: closing it unsubscribes at once, which aborts the generation and frees its
    slot (Starlette alone leaves the abandoned generator to the garbage collector)."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


def sse(data: dict[str, Any] | str, event: str | None = None) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n"


async def pinged(stream: GenerationStream, interval: float,
                 drain: Drain | None = None) -> AsyncIterator[Chunk | Finish | None]:
    queue: asyncio.Queue[Chunk | Finish] = asyncio.Queue()

    async def pump() -> None:
        async for item in stream.subscribe():
            queue.put_nowait(item)

    task = asyncio.create_task(pump())
    try:
        while True:
            left = drain.left() if drain is not None else None
            if left == 0.0:  # the grace is over: what was generated, then the shutdown error
                while not queue.empty():
                    item = queue.get_nowait()
                    yield item
                    if isinstance(item, Finish):
                        return
                yield Finish(reason="error", prompt_tokens=stream.prompt_tokens, cached_tokens=0,
                             completion_tokens=len(stream.handle.output_ids), error=SHUTTING_DOWN)
                return
            try:
                item = await asyncio.wait_for(queue.get(), timeout=interval if left is None else min(interval, left))
            except TimeoutError:
                if drain is not None and drain.left() == 0.0:
                    continue  # handled at the top of the loop
                if task.done() and queue.empty():
                    task.result()  # surface a failure of the pump
                    return
                yield None
                continue
            yield item
            if isinstance(item, Finish):
                return
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task


async def until_disconnect(request: Request, work: Awaitable[T], poll: float = 0.25,
                           drain: Drain | None = None) -> T:
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ApiError(499, "client closed the request")
            if drain is not None and drain.left() == 0.0:
                raise ApiError(503, SHUTTING_DOWN, type="server_error", code="shutting_down")
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


def text_of(content: Any, where: str) -> str:
    """A message's content as text: a string, or a list of text parts (other part types refused)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if isinstance(part, str):
                parts.append(part)
                continue
            if not isinstance(part, dict):
                raise ApiError(400, f"{where}.content[{i}] must be an object")
            kind = part.get("type", "text")
            if kind in ("text", "input_text", "output_text"):
                text = part.get("text")
                if not isinstance(text, str):
                    raise ApiError(400, f"{where}.content[{i}].text must be a string")
                parts.append(text)
            else:
                raise ApiError(400, f"{where}.content[{i}]: content type {kind!r} is not supported by this model")
        return "".join(parts)
    raise ApiError(400, f"{where}.content must be a string or a list of content parts")


def parse_arguments(raw: Any) -> dict[str, Any] | str:
    if isinstance(raw, dict):
        return raw
    if isinstance(raw, str):
        try:
            value = json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError:
            return raw
        return value if isinstance(value, dict) else raw
    return json.dumps(raw)


def check_function_tool(tool: Any, where: str) -> dict[str, Any]:
    """An OpenAI-style function tool, validated; returns {"type": "function", "function": {...}}."""
    if not isinstance(tool, dict):
        raise ApiError(400, f"{where} must be an object", param=where)
    fn = tool.get("function", tool)
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or not name or len(name) > 128:
        raise ApiError(400, f"{where}: a function tool needs a non-empty string name", param=where)
    params = fn.get("parameters", fn.get("input_schema", {"type": "object", "properties": {}}))
    if params is None:
        params = {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise ApiError(400, f"{where}: parameters of tool {name!r} must be a JSON schema object", param=where)
    if "properties" in params and not isinstance(params["properties"], dict):
        raise ApiError(400, f"{where}: properties of tool {name!r} must be an object", param=where)
    out = {"name": name, "description": fn.get("description") or "", "parameters": params}
    return {"type": "function", "function": out}


TEMPERATURE_MAX = 2.0  # every protocol: one range for temperature, top_p and top_k
TOP_K_MAX = 1 << 20


def number_in(body: dict[str, Any], key: str, lo: float, hi: float) -> float | None:
    """`body[key]` as a float in [lo, hi] (finite), None when absent; a 400 naming the field otherwise."""
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value <= hi:
        raise ApiError(400, f"{key} must be a number in [{lo}, {hi}], got {value!r}", param=key)
    return float(value)


def int_in(body: dict[str, Any], key: str, lo: int = 1, hi: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ApiError(400, f"{key} must be an integer {bound}, got {value!r}", param=key)
    return value


def sampling_of(body: dict[str, Any]) -> tuple[float | None, float | None, int | None]:
    """(temperature, top_p, top_k), validated the same way for every protocol."""
    top_k = int_in(body, "top_k", 0, TOP_K_MAX)
    return (number_in(body, "temperature", 0.0, TEMPERATURE_MAX), number_in(body, "top_p", 1e-9, 1.0),
            top_k or None)


FORCED_OUTPUT_FIELD = "freetoken_forced_output"


def forced_output_of(body: dict[str, Any]) -> str | None:
    """The benchmark-only reply text to force (sent by SDKs through `extra_body`), or None."""
    value = body.get(FORCED_OUTPUT_FIELD)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ApiError(400, f"{FORCED_OUTPUT_FIELD} must be a non-empty string", param=FORCED_OUTPUT_FIELD)
    return value
