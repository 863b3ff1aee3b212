"""Protocol-neutral chat requests and the chunks a generation streams back.

Contract: adapters turn each wire protocol into a `ChatRequest` (messages in the chat template's
shape, OpenAI-style function tools, sampling, tool choice, thinking switch, client headers) and
consume `Chunk`s (generated text, in order, the first possibly a forced prefix) ending in one
`Finish` with exact token usage. Nothing here knows HTTP.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: dict[str, Any] | str  # a dict when the client sent valid JSON


@dataclass
class ChatMessage:
    role: str  # system | user | assistant | tool
    content: str = ""
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_id: str | None = None
    name: str | None = None

    def to_template(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.reasoning:
            out["reasoning_content"] = self.reasoning
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}} for c in self.tool_calls]
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
        if self.name:
            out["name"] = self.name
        return out


@dataclass
class ChatRequest:
    messages: list[ChatMessage]
    tools: list[dict[str, Any]] = field(default_factory=list)  # [{"type": "function", "function": {...}}]
    tool_choice: str | dict[str, Any] = "auto"  # auto | none | required | {"type": "function", "function": {"name"}}
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    enable_thinking: bool = True
    reasoning_effort: str | None = None  # low | medium | high, for templates that take one (harmony)
    parallel_tool_calls: bool = True
    headers: dict[str, str] = field(default_factory=dict)
    # Benchmark only: text the engine emits instead of sampling (trace replay, scripted capture).
    forced_output: str | None = None

    @property
    def forced_tool_name(self) -> str | None:
        if isinstance(self.tool_choice, dict):
            fn = self.tool_choice.get("function") or {}
            return fn.get("name") or self.tool_choice.get("name")
        return None


def effort_level(effort: Any = None, budget_tokens: Any = None) -> str | None:
    """A request's reasoning effort as low | medium | high (None: the template's default), from an
    OpenAI effort name or an Anthropic thinking budget in tokens."""
    if isinstance(effort, str):
        return {"none": "low", "minimal": "low", "low": "low", "medium": "medium", "high": "high",
                "xhigh": "high"}.get(effort)
    if isinstance(budget_tokens, int) and not isinstance(budget_tokens, bool):
        return "low" if budget_tokens < 4096 else "medium" if budget_tokens < 16384 else "high"
    return None


@dataclass(frozen=True)
class Chunk:
    text: str


@dataclass(frozen=True)
class Finish:
    reason: str  # stop | length | abort | error
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    stop_sequence: str | None = None
    error: str | None = None
