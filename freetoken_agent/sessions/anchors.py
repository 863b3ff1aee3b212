"""Anchor planning: which prompt positions (and which generated tokens) get a state checkpoint.

Contract: `AnchorPlanner(tokenizer)` knows the chat-template boundary tokens. `message_starts(ids,
messages, has_tools)` maps each message to the token position where its rendering starts (the
`<|im_start|>` of its turn; for the second and later tool results of one merged user turn, their
`<tool_response>` token) plus the start of the generation prompt; None when the ids do not show
the expected turn structure (e.g. a message text holding a literal `<|im_start|>`).
`plan(policy, profile, messages, ids, starts, priority_of)` returns the `Anchor`s for one request,
ascending, one per position (the highest priority wins), every position in [1, len(ids) - 1]:

- semantic (default): end of system + tools (`system_end`), start of each user turn
  (`user_start`), of each assistant message before its thinking (`assistant_start`), of each tool
  result (`tool_result_start`), of role=system turns inside the conversation, the end of the last
  real message before an OpenClaw runtime-context carrier (`before_carrier`, in place of the
  carrier's own `user_start`), the generation prompt (`reply_start`) and `prompt_end`.
- positional: every `POSITIONAL_STRIDE` tokens, plus `prompt_end`.
- user-only: the start of each user turn, plus `prompt_end`.

`prompt_end` sits at len(ids) - 1: the engine always computes the last prompt token (it needs its
logits), so that is the deepest state a resend of the same prompt can start from.
`decode_anchors(priority_of)` gives `</think>` (thinking_end), `<tool_call>` (tool_call_start; also
the opener of the Qwen3.5 XML format), the close of an argument value inside a generated call
(`argument_end`, where the template's format has a distinctive one: `</parameter>` + newline;
at most one every `ARGUMENT_MIN_GAP` generated tokens, so only long calls get them) and
`<|im_end|>` (message_end); every policy keeps `message_end`, the request's true end, which the
next turn of an append-only client extends. An echo of a long call that differs late (a key the
client appended, a value it rewrote) then resumes from the last argument boundary before it.

The harmony format (gpt-oss) has its own boundary tokens: turns open with `<|start|>` (one per
harmony message, so an assistant turn may hold several and the positions of messages are not
derived: anchors fall back to every `<|start|>`, which also puts one before each analysis message
that harmony drops once a final message follows); `<|end|>` ends the analysis (thinking_end, and
right before a tool call's header), `<|return|>` and `<|call|>` end the reply (message_end).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum

from freetoken_agent.service.types import ChatMessage
from freetoken_agent.sessions.echo import argument_close
from freetoken_agent.sessions.engine_api import Anchor, DecodeAnchor, decode_anchor_at
from freetoken_agent.sessions.profiles import CARRIER_MARK
from freetoken_agent.tokenizer import ChatTokenizer

POSITIONAL_STRIDE = 8192
ARGUMENT_MIN_GAP = 128  # generated tokens between two argument_end checkpoints, at least


class AnchorPolicy(StrEnum):
    SEMANTIC = "semantic"
    POSITIONAL = "positional"
    USER_ONLY = "user-only"


@dataclass(frozen=True)
class MessageAnchor:
    index: int  # message index; len(messages) is the generation prompt
    kind: str


def is_carrier(m: ChatMessage) -> bool:
    return m.role == "user" and m.content.lstrip().startswith(CARRIER_MARK)


def message_anchors(messages: Sequence[ChatMessage]) -> list[MessageAnchor]:
    """The semantic anchors of a conversation, by message index (positions come later)."""
    out: list[MessageAnchor] = []
    first_turn = next((i for i, m in enumerate(messages) if i > 0 or m.role != "system"), len(messages))
    out.append(MessageAnchor(first_turn, "system_end"))
    for i, m in enumerate(messages):
        if i < first_turn:
            continue
        if is_carrier(m) and i == len(messages) - 1:
            out.append(MessageAnchor(i, "before_carrier"))
        elif m.role == "user":
            out.append(MessageAnchor(i, "user_start"))
        elif m.role == "assistant":
            out.append(MessageAnchor(i, "assistant_start"))
        elif m.role == "tool":
            out.append(MessageAnchor(i, "tool_result_start"))
        elif m.role == "system":
            out.append(MessageAnchor(i, "system_turn_start"))
    out.append(MessageAnchor(len(messages), "reply_start"))
    return out


# Boundary tokens per chat format: turn start, then (decode anchor kind, token) pairs.
_CHATML = ("<|im_start|>", (("thinking_end", "</think>"), ("tool_call_start", "<tool_call>"),
                            ("message_end", "<|im_end|>")))
_HARMONY = ("<|start|>", (("thinking_end", "<|end|>"), ("message_end", "<|return|>"), ("message_end", "<|call|>")))


class AnchorPlanner:
    def __init__(self, tokenizer: ChatTokenizer) -> None:
        self.tokenizer = tokenizer
        self.structured = tokenizer.token_to_id(_CHATML[0]) is not None or tokenizer.token_to_id(_HARMONY[0]) is None
        turn, tokens = _CHATML if self.structured else _HARMONY
        self.turn = tokenizer.token_to_id(turn)
        self.tool_response = tokenizer.token_to_id("<tool_response>")
        self.decode_tokens = [(kind, tokenizer.token_to_id(tok)) for kind, tok in tokens]
        self.decode_ids: dict[str, int | None] = {}
        for kind, tid in self.decode_tokens:
            self.decode_ids.setdefault(kind, tid)
        self.argument_close = argument_close(tokenizer)

    def message_starts(self, ids: Sequence[int], messages: Sequence[ChatMessage],
                       has_tools: bool) -> list[int] | None:
        """Start position of each message, then of the generation prompt (len(messages) + 1 items)."""
        if self.turn is None or not self.structured:
            return None
        blocks = [i for i, t in enumerate(ids) if t == self.turn]
        responses = [i for i, t in enumerate(ids) if t == self.tool_response] if self.tool_response is not None else []
        starts: list[int] = []
        b = 0
        resp_i = 0  # next unclaimed <tool_response>
        for i, m in enumerate(messages):
            if i == 0 and m.role == "system":
                if not blocks:
                    return None
                starts.append(blocks[0])
                b = 1
                continue
            if i == 0 and has_tools:
                b = 1  # the tool block renders as a system turn of its own
            grouped = m.role == "tool" and i > 0 and messages[i - 1].role == "tool"
            if not grouped:
                if b >= len(blocks):
                    return None
                starts.append(blocks[b])
                b += 1
            if m.role == "tool":
                # each result of a merged user turn opens with its own <tool_response>
                while resp_i < len(responses) and responses[resp_i] <= (starts[-1] if not grouped else -1):
                    resp_i += 1
                if resp_i >= len(responses):
                    return None
                if grouped:
                    starts.append(responses[resp_i])
                resp_i += 1
        if b != len(blocks) - 1:
            return None  # an <|im_start|> the structure does not explain
        starts.append(blocks[b])
        return starts

    def plan(self, policy: AnchorPolicy, messages: Sequence[ChatMessage], ids: Sequence[int],
             starts: Sequence[int] | None, priority_of: Callable[[str], int]) -> list[Anchor]:
        n = len(ids)
        picked: dict[int, tuple[int, str]] = {}

        def add(pos: int, kind: str) -> None:
            if 0 < pos < n:
                prio = priority_of(kind)
                if pos not in picked or prio > picked[pos][0]:
                    picked[pos] = (prio, kind)

        if policy is AnchorPolicy.POSITIONAL:
            for pos in range(POSITIONAL_STRIDE, n, POSITIONAL_STRIDE):
                add(pos, "positional")
        elif starts is None:
            # Unknown structure: fall back to turn starts, which survive any edit after them.
            for pos in (i for i, t in enumerate(ids) if t == self.turn):
                add(pos, "user_start" if policy is AnchorPolicy.USER_ONLY else "turn_start")
        else:
            for a in message_anchors(messages):
                if policy is AnchorPolicy.USER_ONLY and a.kind != "user_start":
                    continue
                add(starts[a.index], a.kind)
        add(n - 1, "prompt_end")
        return [Anchor(position=p, kind=k, priority=pr) for p, (pr, k) in sorted(picked.items())]

    def decode_anchors(self, policy: AnchorPolicy, priority_of: Callable[[str], int]) -> list[DecodeAnchor]:
        kinds = ("thinking_end", "tool_call_start", "message_end") if policy is AnchorPolicy.SEMANTIC \
            else ("message_end",)
        out = [DecodeAnchor(token_id=tid, kind=k, priority=priority_of(k))
               for k, tid in self.decode_tokens if k in kinds and tid is not None]
        if policy is AnchorPolicy.SEMANTIC and self.argument_close:
            close = self.argument_close
            out.append(DecodeAnchor(token_id=close[-1], kind="argument_end", priority=priority_of("argument_end"),
                                    preceded_by=close[:-1], min_gap=ARGUMENT_MIN_GAP))
        return out

    def realised_decode_positions(self, prompt_len: int, output: Sequence[int],
                                  decode: Sequence[DecodeAnchor]) -> list[tuple[int, str]]:
        """Where the decode anchors fired in a finished generation: (position in prompt + output, kind).
        The engine feeds a final anchor token through one extra step, so the reply's closing
        `<|im_end|>` gets its checkpoint too (engine/anchors.py)."""
        out: list[tuple[int, str]] = []
        last = 0
        ids = {d.token_id for d in decode}
        for i, t in enumerate(output):
            a = decode_anchor_at(decode, output, last, i + 1) if t in ids else None
            if a is not None:
                last = i + 1
                out.append((prompt_len + i + 1, a.kind))
        return out
