"""Request normalisation before tokenising, and canonical message keys for comparing requests.

Contract: `normalise(req)` returns a copy of a `ChatRequest` whose rendering does not depend on
bytes that carry no meaning for the model: system text blocks starting with Claude Code's
`x-anthropic-billing-header:` are dropped (the header changes with the first user message and,
in some versions, on every request, which would defeat prefix reuse), system messages left empty
are removed. The adapters have already dropped `cache_control`, `metadata` and
`context_management` and folded a string and a list of text blocks into the same text, so equal
content forms arrive equal. `message_key(m)` is a canonical string of what the template renders of
a message (role, text, reasoning, tool names and JSON-equal arguments; not tool-call ids, which
clients rewrite and templates do not render): two messages with equal keys render equal tokens.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from freetoken_agent.service.types import ChatMessage, ChatRequest, ToolCall

BILLING_PREFIX = "x-anthropic-billing-header"


def strip_billing_header(text: str) -> str:
    """Drops every billing-header line that starts a paragraph; the rest of the text is kept."""
    if BILLING_PREFIX not in text:
        return text
    kept = []
    for para in text.split("\n\n"):
        if para.lstrip().startswith(BILLING_PREFIX):
            para = para.lstrip().partition("\n")[2].lstrip("\n")  # the header is one line
        if para:
            kept.append(para)
    return "\n\n".join(kept)


def normalise(req: ChatRequest) -> ChatRequest:
    messages: list[ChatMessage] = []
    for m in req.messages:
        if m.role == "system":
            text = strip_billing_header(m.content)
            if not text and m.content:
                continue  # the message held nothing but the billing header
            m = dataclasses.replace(m, content=text)
        messages.append(m)
    return dataclasses.replace(req, messages=messages)


def _canonical_args(args: dict[str, Any] | str) -> Any:
    if isinstance(args, str):
        try:
            value = json.loads(args)
        except json.JSONDecodeError:
            return args
        return value
    return args


def _call_key(c: ToolCall) -> list[Any]:
    return [c.name, _canonical_args(c.arguments)]


def message_key(m: ChatMessage) -> str:
    return json.dumps([m.role, m.content, m.reasoning or "", [_call_key(c) for c in m.tool_calls], m.name or ""],
                      sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def system_text(req: ChatRequest) -> str:
    return "\n".join(m.content for m in req.messages if m.role == "system")


def first_user_text(req: ChatRequest) -> str:
    return next((m.content for m in req.messages if m.role == "user"), "")


def tool_names(req: ChatRequest) -> tuple[str, ...]:
    return tuple(sorted(str((t.get("function") or t).get("name", "")) for t in req.tools))
