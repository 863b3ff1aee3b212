"""Where a request left what its session had cached, and which edit caused it.

Contract: `first_difference(a, b)` is the length of the common prefix of two id lists.
`classify(prev, new, position)` names the edit that made the new request diverge at token
`position` from the previous request of the session (its prompt ids plus the generated ids):

- `appended`: nothing cached was changed (position == len(previous ids)).
- `resend`: the same prompt again (a client retry, or a side call that repeats the request).
- `truncated`: the new request is a prefix of what was cached (a retry from an earlier point).
- `system_changed`: the system prompt or the tool list differ (date rollover, tools changed).
- `runtime_context_removed`: OpenClaw's trailing carrier of the previous request was replaced.
- `reasoning_dropped`: an assistant message lost its thinking (the client stripped it, or the
  template stops rendering reasoning of turns before the newest user query).
- `tool_result_cleared`: a tool result's content was replaced by a placeholder or elided.
- `tool_result_changed`: a tool result's content changed otherwise.
- `echo_mismatch`: the client's echo of the generated reply renders to other tokens
  (re-serialised arguments, rewritten ids, trimmed whitespace).
- `compaction`: the history after the system prompt was replaced by a summary.
- `rewrite`: any other change at message `divergence_message`.
The comparison is message by message on canonical keys (`normalise.message_key`), starting from
the message whose token span contains `position`: edits to earlier messages that render the same
tokens (OpenClaw strips the reasoning of turns the template no longer shows) are not the cause.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from freetoken_agent.service.types import ChatMessage
from freetoken_agent.sessions.anchors import is_carrier
from freetoken_agent.sessions.normalise import message_key

CLEARED_MARKERS = ("[Old tool result content cleared]", "Old environment output", "<persisted-output>",
                   "[image data removed", "Outdated window with")
COMPACTION_MARKERS = ("This session is being continued from a previous conversation",
                      "What did we do so far?", "Another language model started to solve this problem",
                      "CONTEXT CHECKPOINT COMPACTION", "<summary>")


@dataclass(frozen=True)
class Snapshot:
    """What a session remembers of its previous main request."""
    messages: tuple[ChatMessage, ...]
    tools: tuple[str, ...]
    prompt_len: int
    ids: Sequence[int]              # prompt ids + generated ids (an array: compact)
    starts: tuple[int, ...] | None  # message start positions (+ generation prompt)
    thinking_end_id: int | None = None


@dataclass(frozen=True)
class Divergence:
    position: int
    cause: str
    message: int | None  # index of the first changed message in the new request


def first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _message_at(starts: Sequence[int] | None, position: int) -> int | None:
    if not starts:
        return None
    idx = None
    for i, s in enumerate(starts[:-1]):
        if s <= position:
            idx = i
    return idx


def classify(prev: Snapshot, messages: Sequence[ChatMessage], tools: tuple[str, ...], new_ids: Sequence[int],
             new_starts: Sequence[int] | None) -> Divergence:
    pos = first_difference(prev.ids, new_ids)
    if pos >= len(prev.ids):
        return Divergence(pos, "appended", None)
    if pos >= len(new_ids):
        return Divergence(pos, "resend" if len(new_ids) == prev.prompt_len else "truncated", None)
    if tools != prev.tools:
        return Divergence(pos, "system_changed", 0)
    k = _message_at(new_starts, pos)
    old = prev.messages
    # First message that differs on canonical keys, from the one whose tokens hold the divergence
    # (earlier messages rendered the same tokens: a change there, such as reasoning the client
    # stripped from a turn the template no longer shows, did not cause it); from the start when
    # token spans are unknown.
    j = next((i for i in range(k or 0, min(len(old), len(messages))) if message_key(old[i]) != message_key(messages[i])),
             None)
    if j is None:
        if pos >= prev.prompt_len:  # inside the previous reply, which the client echoed
            return _reply_divergence(prev, messages, new_ids, pos, len(old))
        if len(messages) < len(old):
            return Divergence(pos, "truncated", len(messages))
        # Same messages, different tokens: the template renders an old message differently now
        # (reasoning of turns before the newest user query is no longer shown).
        return Divergence(pos, "reasoning_dropped" if _lost_thinking(prev, new_ids, pos) else "rewrite", k)
    o, m = old[j], messages[j]
    if o.role == "system" and j == 0:
        return Divergence(pos, "system_changed", j)
    if is_carrier(o):
        return Divergence(pos, "runtime_context_removed", j)
    if any(c in m.content[:4000] for c in COMPACTION_MARKERS) or (j <= 1 and len(messages) < len(old)):
        return Divergence(pos, "compaction", j)
    if o.role == m.role == "assistant":
        if o.reasoning and not m.reasoning and message_key(_without_reasoning(o)) == message_key(m):
            return Divergence(pos, "reasoning_dropped", j)
        return Divergence(pos, "echo_mismatch" if j == len(old) - 1 else "rewrite", j)
    if o.role == m.role == "tool":
        cleared = any(c in m.content for c in CLEARED_MARKERS) or len(m.content) < len(o.content) // 2
        return Divergence(pos, "tool_result_cleared" if cleared else "tool_result_changed", j)
    return Divergence(pos, "rewrite", j)


def _without_reasoning(m: ChatMessage) -> ChatMessage:
    return ChatMessage(role=m.role, content=m.content, reasoning=None, tool_calls=m.tool_calls,
                       tool_call_id=m.tool_call_id, name=m.name)


def _lost_thinking(prev: Snapshot, new_ids: Sequence[int], pos: int) -> bool:
    t = prev.thinking_end_id
    if t is None:
        return False
    # the old tokens from the divergence to the next turn held a </think> that the new ones lack
    old_tail = prev.ids[pos:]
    return t in old_tail and new_ids[pos:].count(t) < old_tail.count(t)


def _reply_divergence(prev: Snapshot, messages: Sequence[ChatMessage], new_ids: Sequence[int], pos: int,
                      index: int) -> Divergence:
    output = prev.ids[prev.prompt_len:]
    t = prev.thinking_end_id
    thought = t is not None and t in output and output.index(t) > 2  # the reply held real reasoning
    echo = messages[index] if index < len(messages) else None
    dropped = thought and echo is not None and echo.role == "assistant" and not (echo.reasoning or "").strip()
    cause = "reasoning_dropped" if dropped or _lost_thinking(prev, new_ids, pos) else "echo_mismatch"
    return Divergence(pos, cause, index)
