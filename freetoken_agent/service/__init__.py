"""The session-facing chat service: protocol-neutral requests in, streamed text chunks out.

The request types load eagerly; the service itself lazily, because the session manager (which the
service uses) needs the types first: `import freetoken_agent.sessions` must work on its own.
"""

from typing import Any

from freetoken_agent.service.types import ChatMessage, ChatRequest, Chunk, Finish, ToolCall, effort_level

__all__ = ["ChatMessage", "ChatRequest", "ChatService", "Chunk", "ContextTooLong", "Finish", "GenerationStream",
           "ToolCall", "effort_level"]


def __getattr__(name: str) -> Any:
    if name in ("ChatService", "ContextTooLong", "GenerationStream"):
        from freetoken_agent.service import chat

        return getattr(chat, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
