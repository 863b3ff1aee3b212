"""The session-facing chat service: protocol-neutral requests in, streamed text chunks out."""

from freetoken_agent.service.chat import ChatService, ContextTooLong, GenerationStream
from freetoken_agent.service.types import ChatMessage, ChatRequest, Chunk, Finish, ToolCall

__all__ = ["ChatMessage", "ChatRequest", "ChatService", "Chunk", "ContextTooLong", "Finish", "GenerationStream",
           "ToolCall"]
