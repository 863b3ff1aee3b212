"""`POST /v1/responses`: the OpenAI Responses protocol, stateless (Codex speaks only this).

Contract: `input` as a string or items (messages of any role, `function_call`,
`function_call_output`, `reasoning` with summary or content text, custom tool calls and their
outputs); `instructions` become the system message; function tools are used, other tool types
(web_search, local_shell, custom/freeform, ...) are tolerated and ignored, never a 500. The answer
is a `response` object, or an SSE stream: `response.created`, `response.in_progress`, then per
output item `response.output_item.added`, its deltas (`response.reasoning_text.delta`,
`response.output_text.delta` within a content part, `response.function_call_arguments.delta`) and
`.done` events, then `response.completed` (or `response.incomplete` when max_output_tokens cut
it). Nothing is stored (`store` is accepted and ignored); `previous_response_id` is refused.
"""

from __future__ import annotations

import json
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
from adapters.openai_chat import parse_tool_choice
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


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def parse_input(instructions: Any, raw: Any) -> list[ChatMessage]:
    out: list[ChatMessage] = []
    if instructions:
        if not isinstance(instructions, str):
            raise ApiError(400, "instructions must be a string", param="instructions")
        out.append(ChatMessage(role="system", content=instructions))
    if isinstance(raw, str):
        return [*out, ChatMessage(role="user", content=raw)]
    if not isinstance(raw, list) or not raw:
        raise ApiError(400, "input must be a string or a non-empty list of items", param="input")

    def assistant() -> ChatMessage:
        if not out or out[-1].role != "assistant":
            out.append(ChatMessage(role="assistant"))
        return out[-1]

    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ApiError(400, f"{where} must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role == "developer":
                role = "system"
            if role not in ("system", "user", "assistant"):
                raise ApiError(400, f"{where}.role must be user, assistant, system or developer", param="input")
            text = text_of(item.get("content"), where)
            if role == "assistant":
                msg = assistant()
                msg.content += text
            else:
                out.append(ChatMessage(role=role, content=text))
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            if not isinstance(parts, list):
                raise ApiError(400, f"{where}: reasoning content and summary must be lists of parts", param="input")
            texts = [p.get("text", "") for p in parts if isinstance(p, dict)]
            if not all(isinstance(t, str) for t in texts):
                raise ApiError(400, f"{where}: reasoning parts need a string text", param="input")
            text = "".join(texts)
            msg = assistant()
            msg.reasoning = (msg.reasoning or "") + text
        elif kind in ("function_call", "custom_tool_call"):
            name = item.get("name")
            if not isinstance(name, str):
                raise ApiError(400, f"{where}.name must be a string", param="input")
            args = parse_arguments(item.get("arguments", "{}")) if kind == "function_call" else {
                "input": item.get("input", "")}
            assistant().tool_calls.append(ToolCall(id=str(item.get("call_id") or item.get("id") or f"call_{i}"),
                                                   name=name, arguments=args))
        elif kind in ("function_call_output", "custom_tool_call_output"):
            output = item.get("output", "")
            text = output if isinstance(output, str) else text_of(output, where)
            out.append(ChatMessage(role="tool", content=text, tool_call_id=str(item.get("call_id", ""))))
        # Other item kinds (web_search_call, local_shell_call, item_reference, ...) carry nothing we can render.
    if not any(m.role in ("user", "tool") for m in out):
        raise ApiError(400, "input holds no user message", param="input")
    return out


def _tools(raw: Any) -> list[dict[str, Any]]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ApiError(400, "tools must be a list", param="tools")
    return [check_function_tool(t, f"tools[{i}]") for i, t in enumerate(raw)
            if isinstance(t, dict) and t.get("type", "function") == "function"]


def to_chat_request(body: dict[str, Any], headers: dict[str, str]) -> ChatRequest:
    if body.get("previous_response_id"):
        raise ApiError(400, "previous_response_id is not supported: this server stores nothing (send the full input)",
                       param="previous_response_id")
    tools = _tools(body.get("tools"))
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        choice = {"type": "function", "function": {"name": choice["name"]}}
    elif isinstance(choice, dict):
        choice = "auto"  # hosted-tool choices name tools that do not exist here
    max_tokens = int_in(body, "max_output_tokens")
    temperature, top_p, top_k = sampling_of(body)
    effort = (body.get("reasoning") or {}).get("effort") if isinstance(body.get("reasoning"), dict) else None
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise ApiError(400, "parallel_tool_calls must be a boolean", param="parallel_tool_calls")
    return ChatRequest(messages=parse_input(body.get("instructions"), body.get("input")), tools=tools,
                       tool_choice=parse_tool_choice(choice, tools), max_tokens=max_tokens,
                       temperature=temperature, top_p=top_p, top_k=top_k,
                       enable_thinking=effort not in ("none", "minimal"), reasoning_effort=effort_level(effort),
                       parallel_tool_calls=parallel,
                       headers=headers, forced_output=forced_output_of(body))


def _usage(fin: Finish, reasoning_tokens: int = 0) -> dict[str, Any]:
    return {"input_tokens": fin.prompt_tokens, "input_tokens_details": {"cached_tokens": fin.cached_tokens},
            "output_tokens": fin.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, fin.completion_tokens)},
            "total_tokens": fin.prompt_tokens + fin.completion_tokens}


class _Builder:
    """Accumulates output items from parser events and renders them as items and stream events."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None
        self.seq = 0

    def event(self, kind: str, **fields: Any) -> str:
        self.seq += 1
        return sse({"type": kind, "sequence_number": self.seq, **fields}, kind)

    def _start(self, item: dict[str, Any]) -> list[str]:
        out = self.close()
        self.items.append(item)
        self.open = item
        idx = len(self.items) - 1
        out.append(self.event("response.output_item.added", output_index=idx, item=_in_progress(item)))
        if item["type"] == "message":
            out.append(self.event("response.content_part.added", item_id=item["id"], output_index=idx,
                                  content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        return out

    def close(self) -> list[str]:
        item, self.open = self.open, None
        if item is None:
            return []
        idx = len(self.items) - 1
        out = []
        if item["type"] == "message":
            text = item["content"][0]["text"]
            out.append(self.event("response.output_text.done", item_id=item["id"], output_index=idx, content_index=0,
                                  text=text))
            out.append(self.event("response.content_part.done", item_id=item["id"], output_index=idx,
                                  content_index=0, part=item["content"][0]))
        elif item["type"] == "reasoning":
            out.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=idx,
                                  content_index=0, text=item["content"][0]["text"]))
        elif item["type"] == "function_call":
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=idx,
                                  arguments=item["arguments"]))
        item["status"] = "completed"
        out.append(self.event("response.output_item.done", output_index=idx, item=item))
        return out

    def feed(self, e: Any) -> list[str]:
        out: list[str] = []
        idx = len(self.items) - 1
        if isinstance(e, ReasoningDelta) and e.text:
            if self.open is None or self.open["type"] != "reasoning":
                out += self._start({"type": "reasoning", "id": _new_id("rs"), "summary": [],
                                    "content": [{"type": "reasoning_text", "text": ""}], "status": "in_progress"})
                idx = len(self.items) - 1
            assert self.open is not None
            self.open["content"][0]["text"] += e.text
            out.append(self.event("response.reasoning_text.delta", item_id=self.open["id"], output_index=idx,
                                  content_index=0, delta=e.text))
        elif isinstance(e, ContentDelta) and e.text:
            if self.open is None or self.open["type"] != "message":
                out += self._start({"type": "message", "id": _new_id("msg"), "status": "in_progress",
                                    "role": "assistant",
                                    "content": [{"type": "output_text", "text": "", "annotations": []}]})
                idx = len(self.items) - 1
            assert self.open is not None
            self.open["content"][0]["text"] += e.text
            out.append(self.event("response.output_text.delta", item_id=self.open["id"], output_index=idx,
                                  content_index=0, delta=e.text))
        elif isinstance(e, ToolCallStart):
            out += self._start({"type": "function_call", "id": _new_id("fc"), "call_id": e.id, "name": e.name,
                                "arguments": "", "status": "in_progress"})
        elif isinstance(e, ToolCallArgsDelta) and e.text and self.open is not None:
            self.open["arguments"] += e.text
            out.append(self.event("response.function_call_arguments.delta", item_id=self.open["id"],
                                  output_index=idx, delta=e.text))
        elif isinstance(e, ToolCallEnd) and self.open is not None and self.open["type"] == "function_call":
            self.open["arguments"] = e.arguments
        return out


def _in_progress(item: dict[str, Any]) -> dict[str, Any]:
    out = json.loads(json.dumps(item))
    if out["type"] == "message":
        out["content"] = []
    elif out["type"] == "function_call":
        out["arguments"] = ""
    elif out["type"] == "reasoning":
        out["content"] = []
    return out


@router.post("/v1/responses")
async def responses(request: Request) -> Any:
    state: AppState = request.app.state.ft
    body = await read_json(request)
    state.check_model(body.get("model"))
    req = to_chat_request(body, dict(request.headers))
    stream, parser = await state.start(req)
    rid = _new_id("resp")
    base = {"id": rid, "object": "response", "created_at": int(time.time()), "model": state.model_name,
            "instructions": body.get("instructions"), "tools": body.get("tools") or [],
            "tool_choice": body.get("tool_choice", "auto"), "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "store": False, "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "max_output_tokens": body.get("max_output_tokens"), "reasoning": body.get("reasoning"),
            "metadata": body.get("metadata") or {}, "error": None, "incomplete_details": None}

    def final(builder: _Builder, fin: Finish) -> dict[str, Any]:
        cut = fin.reason == "length"
        # Reasoning tokens are counted by re-encoding the reasoning text (plus its </think> marker).
        reasoning = [i["content"][0]["text"] for i in builder.items if i["type"] == "reasoning"]
        n_reasoning = sum(len(state.service.tokenizer.encode(t)) + 1 for t in reasoning)
        return {**base, "status": "incomplete" if cut else "completed", "output": builder.items,
                "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
                "usage": _usage(fin, n_reasoning)}

    if not body.get("stream"):
        text, fin = await until_disconnect(request, stream.collect(), drain=state.drain)
        state.check_finish(fin)
        builder = _Builder()
        for e in parser.feed(text) + parser.finish():
            builder.feed(e)
        builder.close()
        return JSONResponse(final(builder, fin))

    async def events() -> AsyncIterator[str]:
        b = _Builder()
        yield b.event("response.created", response={**base, "status": "in_progress", "output": [], "usage": None})
        yield b.event("response.in_progress", response={**base, "status": "in_progress", "output": [], "usage": None})
        async for item in pinged(stream, state.ping_interval, state.drain):
            if item is None:
                yield ": ping\n\n"
                continue
            for e in parser.finish() if isinstance(item, Finish) else parser.feed(item.text):
                for s in b.feed(e):
                    yield s
            if isinstance(item, Finish):
                for s in b.close():
                    yield s
                if item.error:
                    failed = {**base, "status": "failed", "output": b.items, "usage": _usage(item),
                              "error": {"code": "server_error", "message": item.error}}
                    yield b.event("response.failed", response=failed)
                    return
                done = final(b, item)
                yield b.event("response.incomplete" if done["status"] == "incomplete" else "response.completed",
                              response=done)

    return SSEResponse(events())
