"""`POST /v1/chat/completions`: the OpenAI Chat Completions protocol over the chat service.

Contract: validates the body (400 with a field-naming message on bad input; `n` > 1 refused),
maps messages (system/developer, user, assistant with `reasoning_content` and `tool_calls`, tool)
into a `ChatRequest`, and answers either one `chat.completion` object or an SSE stream of
`chat.completion.chunk`s (role first, reasoning as `reasoning_content` deltas, content deltas,
tool calls as index/id/name then argument deltas, a final chunk with `finish_reason`, a usage
chunk when `stream_options.include_usage`, then `[DONE]`). Usage counts prompt, cached and
completion tokens exactly.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from adapters.common import (
    ApiError,
    SSEResponse,
    check_function_tool,
    forced_output_of,
    int_in,
    parse_arguments,
    pinged,
    sampling_of,
    sse,
    text_of,
    until_disconnect,
)
from adapters.parsers import (
    ContentDelta,
    ReasoningDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from adapters.state import AppState, read_json
from freetoken_agent.service import ChatMessage, ChatRequest, Finish, ToolCall, effort_level

router = APIRouter()


def parse_messages(raw: Any) -> list[ChatMessage]:
    if not isinstance(raw, list) or not raw:
        raise ApiError(400, "messages must be a non-empty list", param="messages")
    out: list[ChatMessage] = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ApiError(400, f"{where} must be an object", param="messages")
        role = m.get("role")
        if role == "developer":
            role = "system"
        if role not in ("system", "user", "assistant", "tool"):
            raise ApiError(400, f"{where}.role must be system, developer, user, assistant or tool; got {role!r}",
                           param="messages")
        msg = ChatMessage(role=role, content=text_of(m.get("content"), where))
        if role == "assistant":
            reasoning = m.get("reasoning_content", m.get("reasoning"))
            msg.reasoning = reasoning if isinstance(reasoning, str) and reasoning else None
            calls = m.get("tool_calls") or []
            if not isinstance(calls, list):
                raise ApiError(400, f"{where}.tool_calls must be a list", param="messages")
            for j, call in enumerate(calls):
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise ApiError(400, f"{where}.tool_calls[{j}] needs function.name", param="messages")
                msg.tool_calls.append(ToolCall(id=str(call.get("id") or f"call_{i}_{j}"), name=fn["name"],
                                               arguments=parse_arguments(fn.get("arguments", "{}"))))
        if role == "tool":
            msg.tool_call_id = m.get("tool_call_id")
        out.append(msg)
    return out


def parse_tool_choice(value: Any, tools: list[dict[str, Any]]) -> str | dict[str, Any]:
    if value is None:
        return "auto"
    if value in ("auto", "none", "required"):
        return value  # type: ignore[no-any-return]
    if isinstance(value, dict):
        fn = value.get("function")
        name = fn.get("name") if isinstance(fn, dict) and value.get("type", "function") == "function" else None
        if not isinstance(name, str):
            raise ApiError(400, "tool_choice must be auto, none, required or {type: function, function: {name}}",
                           param="tool_choice")
        if name not in {t["function"]["name"] for t in tools}:
            raise ApiError(400, f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
        return {"type": "function", "function": {"name": name}}
    raise ApiError(400, f"tool_choice {value!r} is not supported", param="tool_choice")


def to_chat_request(body: dict[str, Any], headers: dict[str, str]) -> ChatRequest:
    n = body.get("n")
    if n not in (None, 1):
        raise ApiError(400, "n > 1 is not supported: one choice per request", param="n")
    tools_raw = body.get("tools") or []
    if not isinstance(tools_raw, list):
        raise ApiError(400, "tools must be a list", param="tools")
    tools = [check_function_tool(t, f"tools[{i}]") for i, t in enumerate(tools_raw)]
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) for s in stop)):
        raise ApiError(400, "stop must be a string or a list of strings", param="stop")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise ApiError(400, "chat_template_kwargs must be an object", param="chat_template_kwargs")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise ApiError(400, "parallel_tool_calls must be a boolean", param="parallel_tool_calls")
    thinking = kwargs.get("enable_thinking", body.get("reasoning_effort") not in ("none", "minimal"))
    max_tokens = int_in(body, "max_completion_tokens") or int_in(body, "max_tokens")
    temperature, top_p, top_k = sampling_of(body)
    return ChatRequest(
        messages=parse_messages(body.get("messages")), tools=tools,
        tool_choice=parse_tool_choice(body.get("tool_choice"), tools), max_tokens=max_tokens,
        temperature=temperature, top_p=top_p, top_k=top_k, seed=_seed(body), stop=stop or [],
        enable_thinking=bool(thinking), reasoning_effort=effort_level(body.get("reasoning_effort")),
        parallel_tool_calls=parallel, headers=headers,
        forced_output=forced_output_of(body))


def _seed(body: dict[str, Any]) -> int | None:
    seed = int_in(body, "seed", -(2**63))
    if seed is not None and seed >= 2**64:
        raise ApiError(400, f"seed must be below 2**64, got {seed}", param="seed")
    return seed


def _usage(fin: Finish) -> dict[str, Any]:
    return {"prompt_tokens": fin.prompt_tokens, "completion_tokens": fin.completion_tokens,
            "total_tokens": fin.prompt_tokens + fin.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": fin.cached_tokens}}


def _finish_reason(fin: Finish, has_calls: bool) -> str:
    if fin.reason == "length":
        return "length"
    return "tool_calls" if has_calls else "stop"


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Any:
    state: AppState = request.app.state.ft
    body = await read_json(request)
    state.check_model(body.get("model"))
    req = to_chat_request(body, dict(request.headers))
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError(400, "stream_options must be an object", param="stream_options")
    include_usage = bool(options.get("include_usage"))
    stream, parser = await state.start(req)
    rid, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), state.model_name
    if not body.get("stream"):
        text, fin = await until_disconnect(request, stream.collect(), drain=state.drain)
        state.check_finish(fin)
        parsed = parser.feed(text) + parser.finish()
        reasoning = "".join(e.text for e in parsed if isinstance(e, ReasoningDelta))
        content = "".join(e.text for e in parsed if isinstance(e, ContentDelta))
        calls = [e for e in parsed if isinstance(e, ToolCallEnd)]
        message: dict[str, Any] = {"role": "assistant", "content": content or (None if calls else "")}
        if reasoning:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
        return JSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": model,
                             "choices": [{"index": 0, "message": message, "logprobs": None,
                                          "finish_reason": _finish_reason(fin, bool(calls))}],
                             "usage": _usage(fin)})

    def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
        return sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]})

    async def events() -> AsyncIterator[str]:
        yield chunk({"role": "assistant", "content": ""})
        has_calls = False
        async for item in pinged(stream, state.ping_interval, state.drain):
            if item is None:
                yield ": ping\n\n"
                continue
            parsed = parser.feed(item.text) if not isinstance(item, Finish) else parser.finish()
            for e in parsed:
                if isinstance(e, ReasoningDelta) and e.text:
                    yield chunk({"reasoning_content": e.text})
                elif isinstance(e, ContentDelta) and e.text:
                    yield chunk({"content": e.text})
                elif isinstance(e, ToolCallStart):
                    has_calls = True
                    yield chunk({"tool_calls": [{"index": e.index, "id": e.id, "type": "function",
                                                 "function": {"name": e.name, "arguments": ""}}]})
                elif isinstance(e, ToolCallArgsDelta) and e.text:
                    yield chunk({"tool_calls": [{"index": e.index, "function": {"arguments": e.text}}]})
            if isinstance(item, Finish):
                if item.error:
                    yield sse({"error": {"message": item.error, "type": "server_error", "code": None,
                                         "param": None}})
                    break
                yield chunk({}, _finish_reason(item, has_calls))
                if include_usage:
                    yield sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                               "choices": [], "usage": _usage(item)})
        yield "data: [DONE]\n\n"

    return SSEResponse(events())
