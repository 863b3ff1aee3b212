"""Shared helpers of the session-manager tests: real tokenizers of both families, the recorded
first requests of the real clients, and rendering a `ChatRequest` exactly as `ChatService` does."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from freetoken_agent.service import ChatMessage, ChatRequest, ToolCall
from freetoken_agent.tokenizer import ChatTokenizer, write_tokenizer

REPO = Path(__file__).resolve().parents[2]
RECORDED = REPO / "tests" / "clients" / "recorded"

TOOLS = [{"type": "function", "function": {"name": "bash", "description": "Run a shell command",
                                           "parameters": {"type": "object", "properties": {
                                               "command": {"type": "string"}}, "required": ["command"]}}},
         {"type": "function", "function": {"name": "read", "description": "Read a file",
                                           "parameters": {"type": "object", "properties": {
                                               "path": {"type": "string"}}, "required": ["path"]}}}]


_WRITTEN: dict[str, Path] = {}  # family -> the first directory written in this process


def make_tokenizer(family: str, out: Path) -> ChatTokenizer:
    """The family's tokenizer files in `out` and the tokenizer read from them. They are built from the
    ranks once per test process (seconds each) and copied for later callers (the output is
    deterministic; each caller still reads its own copy)."""
    first = _WRITTEN.get(family)
    if first is None or not (first / "tokenizer.json").exists():
        write_tokenizer(out, family)  # type: ignore[arg-type]
        _WRITTEN[family] = out
    else:
        shutil.copytree(first, out, dirs_exist_ok=True)
    return ChatTokenizer.from_dir(out)


def recorded(client: str) -> list[dict[str, Any]]:
    return list(json.loads((RECORDED / f"{client}.json").read_text())["requests"])


def to_request(entry: dict[str, Any]) -> ChatRequest:
    """A recorded HTTP request through the adapter that serves its path."""
    from adapters import anthropic_messages, openai_chat, openai_responses

    path = entry["path"].split("?")[0]
    mod = {"/v1/messages": anthropic_messages, "/v1/chat/completions": openai_chat,
           "/v1/responses": openai_responses}[path]
    return mod.to_chat_request(entry["body"], dict(entry["headers"]))  # type: ignore[attr-defined]


def render(tok: ChatTokenizer, req: ChatRequest) -> list[int]:
    """The prompt ids ChatService renders for a request (tool_choice auto)."""
    text = tok.apply_chat_template([m.to_template() for m in req.messages], tools=req.tools or None,
                                   add_generation_prompt=True, enable_thinking=req.enable_thinking, tokenize=False)
    assert isinstance(text, str)
    return tok.encode(text)


def sys_(text: str = "You are a coding agent.") -> ChatMessage:
    return ChatMessage(role="system", content=text)


def user(text: str) -> ChatMessage:
    return ChatMessage(role="user", content=text)


def asst(text: str = "", reasoning: str | None = None, call: tuple[str, dict[str, Any]] | None = None,
         call_id: str = "call_1") -> ChatMessage:
    calls = [ToolCall(id=call_id, name=call[0], arguments=call[1])] if call else []
    return ChatMessage(role="assistant", content=text, reasoning=reasoning, tool_calls=calls)


def tool(text: str, call_id: str = "call_1") -> ChatMessage:
    return ChatMessage(role="tool", content=text, tool_call_id=call_id)


def req(*messages: ChatMessage, tools: bool = True, headers: dict[str, str] | None = None) -> ChatRequest:
    return ChatRequest(messages=list(messages), tools=TOOLS if tools else [], headers=headers or {})
