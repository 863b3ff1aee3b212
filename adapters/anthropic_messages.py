"""`POST /v1/messages` and `/v1/messages/count_tokens`: the Anthropic Messages protocol (Claude Code).

Contract: accepts system as a string or text blocks (Claude Code's `x-anthropic-billing-header`
block is dropped by the session manager's rule: it carries no instruction and would break prefix reuse), `role: "system"`
messages inside `messages`, text / thinking / redacted_thinking / tool_use / tool_result blocks,
custom tools (server tool types are ignored), `tool_choice`, `stop_sequences`, `thinking`, and
ignores unknown fields and `?beta=true`. Streaming sends headers and `message_start` at once,
`ping` events while the prompt is prefilled or whenever the stream is idle, content blocks
(thinking with a non-empty `signature`, text, tool_use with `input_json_delta`), `message_delta`
with usage and `message_stop`. Usage: `input_tokens` are the uncached prompt tokens,
`cache_read_input_tokens` the reused ones.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
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
from freetoken_agent.sessions.normalise import strip_billing_header as _strip_billing

router = APIRouter()


def _system_text(system: Any) -> str:
    if system is None:
        return ""
    if isinstance(system, str):
        return _strip_billing(system)
    if not isinstance(system, list):
        raise ApiError(400, "system must be a string or a list of text blocks")
    parts = []
    for i, block in enumerate(system):
        if not isinstance(block, dict) or block.get("type", "text") != "text" or not isinstance(block.get("text"), str):
            raise ApiError(400, f"system[{i}] must be a text block")
        text = _strip_billing(block["text"])
        if text:
            parts.append(text)
    return "\n\n".join(parts)


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise ApiError(400, f"{where}.content must be a string or a list of content blocks")
    for i, b in enumerate(content):
        if not isinstance(b, dict) or not isinstance(b.get("type"), str):
            raise ApiError(400, f"{where}.content[{i}] must be a block with a type")
    return content


def parse_messages(system: Any, raw: Any) -> list[ChatMessage]:
    if not isinstance(raw, list) or not raw:
        raise ApiError(400, "messages: at least one message is required")
    out: list[ChatMessage] = []
    sys_text = _system_text(system)
    if sys_text:
        out.append(ChatMessage(role="system", content=sys_text))
    for i, m in enumerate(raw):
        where = f"messages.{i}"
        if not isinstance(m, dict):
            raise ApiError(400, f"{where} must be an object")
        role = m.get("role")
        if role == "system":
            text = _system_text(m.get("content"))
            if text:
                out.append(ChatMessage(role="system", content=text))
            continue
        if role not in ("user", "assistant"):
            raise ApiError(400, f"{where}.role must be user or assistant, got {role!r}")
        blocks = _blocks(m.get("content"), where)
        if role == "assistant":
            msg = ChatMessage(role="assistant")
            texts, thinking = [], []
            for b in blocks:
                kind = b["type"]
                if kind == "text":
                    texts.append(text_of([b], where))
                elif kind == "thinking":
                    thinking.append(str(b.get("thinking", "")))
                elif kind == "tool_use":
                    inp = b.get("input", {})
                    msg.tool_calls.append(ToolCall(id=str(b.get("id", "")), name=str(b.get("name", "")),
                                                   arguments=inp if isinstance(inp, dict) else json.dumps(inp)))
                elif kind not in ("redacted_thinking",):
                    raise ApiError(400, f"{where}: block type {kind!r} is not allowed in an assistant message")
            msg.content, msg.reasoning = "".join(texts), "".join(thinking) or None
            out.append(msg)
            continue
        pending: list[str] = []
        for b in blocks:
            if b["type"] == "tool_result":
                if pending:
                    out.append(ChatMessage(role="user", content="".join(pending)))
                    pending = []
                content = b.get("content", "")
                text = text_of(content if content is not None else "", where)
                if b.get("is_error") and not text.startswith("Error"):
                    text = f"Error: {text}"
                out.append(ChatMessage(role="tool", content=text, tool_call_id=str(b.get("tool_use_id", ""))))
            else:
                pending.append(text_of([b], where))
        if pending or not blocks:
            out.append(ChatMessage(role="user", content="".join(pending)))
    return out


def _tools(raw: Any) -> list[dict[str, Any]]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ApiError(400, "tools must be a list")
    tools = []
    for i, t in enumerate(raw):
        if isinstance(t, dict) and t.get("type") not in (None, "custom"):
            continue  # server tools (web search, code execution, ...) do not exist here
        if isinstance(t, dict) and "input_schema" not in t:
            raise ApiError(400, f"tools.{i}.input_schema: field required")
        tools.append(check_function_tool(t, f"tools.{i}"))
    return tools


def _tool_choice(raw: Any, tools: list[dict[str, Any]]) -> str | dict[str, Any]:
    if raw is None:
        return "auto"
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind == "auto":
        return "auto"
    if kind == "none":
        return "none"
    if kind == "any":
        return "required"
    if kind == "tool":
        name = raw.get("name")
        if name not in {t["function"]["name"] for t in tools}:
            raise ApiError(400, f"tool_choice.name {name!r} is not among the tools")
        return {"type": "function", "function": {"name": name}}
    raise ApiError(400, "tool_choice.type must be auto, any, tool or none")


def to_chat_request(body: dict[str, Any], headers: dict[str, str]) -> ChatRequest:
    max_tokens = int_in(body, "max_tokens")
    temperature, top_p, top_k = sampling_of(body)
    stop = body.get("stop_sequences") or []
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise ApiError(400, "stop_sequences must be a list of strings")
    thinking = body.get("thinking") or {}
    tools = _tools(body.get("tools"))
    choice = body.get("tool_choice")
    parallel = not (isinstance(choice, dict) and choice.get("disable_parallel_tool_use") is True)
    return ChatRequest(messages=parse_messages(body.get("system"), body.get("messages")), tools=tools,
                       parallel_tool_calls=parallel,
                       tool_choice=_tool_choice(body.get("tool_choice"), tools), max_tokens=max_tokens,
                       temperature=temperature, top_p=top_p, top_k=top_k, stop=stop,
                       enable_thinking=isinstance(thinking, dict) and thinking.get("type") in ("enabled", "adaptive"),
                       reasoning_effort=effort_level(budget_tokens=thinking.get("budget_tokens"))
                       if isinstance(thinking, dict) and thinking.get("type") == "enabled" else None,
                       headers=headers, forced_output=forced_output_of(body))


def signature(thinking: str) -> str:
    """Claude Code replays only thinking blocks that carry a signature; this one is a digest."""
    return base64.b64encode(hashlib.sha256(thinking.encode()).digest()).decode()


def _stop_reason(fin: Finish, has_calls: bool) -> str:
    if fin.reason == "length":
        return "max_tokens"
    if fin.stop_sequence is not None:
        return "stop_sequence"
    return "tool_use" if has_calls else "end_turn"


def _usage(fin: Finish) -> dict[str, Any]:
    return {"input_tokens": fin.prompt_tokens - fin.cached_tokens, "output_tokens": fin.completion_tokens,
            "cache_read_input_tokens": fin.cached_tokens, "cache_creation_input_tokens": 0}


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> dict[str, int]:
    state: AppState = request.app.state.ft
    body = await read_json(request)
    state.check_model(body.get("model"))
    req = to_chat_request(body, dict(request.headers))
    if req.max_tokens is not None and req.max_tokens > state.service.context_window:
        raise ApiError(400, f"max_tokens {req.max_tokens} exceeds the model's context window of "
                            f"{state.service.context_window} tokens")
    return {"input_tokens": await asyncio.to_thread(state.service.count_tokens, req)}


@router.post("/v1/messages")
async def messages(request: Request) -> Any:
    state: AppState = request.app.state.ft
    body = await read_json(request)
    state.check_model(body.get("model"))
    req = to_chat_request(body, dict(request.headers))
    stream, parser = await state.start(req, id_prefix="toolu_")
    mid, model = f"msg_{uuid.uuid4().hex[:24]}", state.model_name
    if not body.get("stream"):
        text, fin = await until_disconnect(request, stream.collect(), drain=state.drain)
        state.check_finish(fin)
        parsed = parser.feed(text) + parser.finish()
        content: list[dict[str, Any]] = []
        reasoning = "".join(e.text for e in parsed if isinstance(e, ReasoningDelta))
        if reasoning:
            content.append({"type": "thinking", "thinking": reasoning, "signature": signature(reasoning)})
        text_out = "".join(e.text for e in parsed if isinstance(e, ContentDelta))
        if text_out:
            content.append({"type": "text", "text": text_out})
        calls = [e for e in parsed if isinstance(e, ToolCallEnd)]
        content += [{"type": "tool_use", "id": c.id, "name": c.name, "input": json.loads(c.arguments)} for c in calls]
        return JSONResponse({"id": mid, "type": "message", "role": "assistant", "model": model, "content": content,
                             "stop_reason": _stop_reason(fin, bool(calls)), "stop_sequence": fin.stop_sequence,
                             "usage": _usage(fin)})

    async def events() -> AsyncIterator[str]:
        start_usage = {"input_tokens": stream.prompt_tokens, "output_tokens": 0, "cache_read_input_tokens": 0,
                       "cache_creation_input_tokens": 0}
        yield sse({"type": "message_start", "message": {"id": mid, "type": "message", "role": "assistant",
                                                        "model": model, "content": [], "stop_reason": None,
                                                        "stop_sequence": None, "usage": start_usage}},
                  "message_start")
        index, open_kind, has_calls = -1, None, False
        thinking_text: list[str] = []

        def close() -> list[str]:
            nonlocal open_kind
            out = []
            if open_kind == "thinking":
                out.append(sse({"type": "content_block_delta", "index": index,
                                "delta": {"type": "signature_delta", "signature": signature("".join(thinking_text))}},
                               "content_block_delta"))
            if open_kind is not None:
                out.append(sse({"type": "content_block_stop", "index": index}, "content_block_stop"))
            open_kind = None
            return out

        def open_block(kind: str, block: dict[str, Any]) -> list[str]:
            nonlocal index, open_kind
            out = close()
            index += 1
            open_kind = kind
            out.append(sse({"type": "content_block_start", "index": index, "content_block": block},
                           "content_block_start"))
            return out

        yield sse({"type": "ping"}, "ping")
        async for item in pinged(stream, state.ping_interval, state.drain):
            if item is None:
                yield sse({"type": "ping"}, "ping")
                continue
            parsed = parser.finish() if isinstance(item, Finish) else parser.feed(item.text)
            for e in parsed:
                if isinstance(e, ReasoningDelta) and e.text:
                    if open_kind != "thinking":
                        for s in open_block("thinking", {"type": "thinking", "thinking": "", "signature": ""}):
                            yield s
                    thinking_text.append(e.text)
                    yield sse({"type": "content_block_delta", "index": index,
                               "delta": {"type": "thinking_delta", "thinking": e.text}}, "content_block_delta")
                elif isinstance(e, ContentDelta) and e.text:
                    if open_kind != "text":
                        for s in open_block("text", {"type": "text", "text": ""}):
                            yield s
                    yield sse({"type": "content_block_delta", "index": index,
                               "delta": {"type": "text_delta", "text": e.text}}, "content_block_delta")
                elif isinstance(e, ToolCallStart):
                    has_calls = True
                    for s in open_block("tool_use", {"type": "tool_use", "id": e.id, "name": e.name, "input": {}}):
                        yield s
                elif isinstance(e, ToolCallArgsDelta) and e.text:
                    yield sse({"type": "content_block_delta", "index": index,
                               "delta": {"type": "input_json_delta", "partial_json": e.text}}, "content_block_delta")
            if isinstance(item, Finish):
                for s in close():
                    yield s
                if item.error:
                    yield sse({"type": "error", "error": {"type": "api_error", "message": item.error}}, "error")
                    return
                yield sse({"type": "message_delta", "delta": {"stop_reason": _stop_reason(item, has_calls),
                                                              "stop_sequence": item.stop_sequence},
                           "usage": _usage(item)}, "message_delta")
                yield sse({"type": "message_stop"}, "message_stop")

    return SSEResponse(events())
