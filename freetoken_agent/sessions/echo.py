"""Echo reconciliation: the client's echo of the engine's last reply, rendered as the engine generated it.

Contract: `EchoReconciler(tokenizer)`; `reconcile(echo, generated, defaults)` takes the assistant
message a client sent back (`echo`), the text of what the engine generated for it (the previous
request's generation prompt, from its `<|im_start|>`, through the reply's end token) and the client
profile's known additions (`defaults`: (tool name or "*", key, value) the client adds to a call it
echoes), and returns an `EchoOutcome`:

- `message`: the message to render in place of the echo. When the echo is semantically the reply
  (same reasoning, content and tools, JSON-equal arguments once the profile's known additions are
  dropped), it is the echo with its arguments in the order the engine generated them and those
  additions removed, so the chat template renders exactly the generated text and the engine's
  cached prefix holds. Otherwise it is the echo unchanged.
- `reconciled`: whether `message` renders to the generated text; `changed`: whether it differs
  from the echo.
- `differed`: when not reconciled, the first part that differs: `reasoning`, `content`,
  `tool_calls` (their number), `call N name`, `call N argument KEY` (a value the engine did not
  generate, or a key it did not), `call N arguments` (same arguments, other rendering), `rendering`
  (anything else, e.g. a reply the template renders with other whitespace).
A generation that stopped before the turn's end token (a forced or cut reply) matches an echo
whose rendering continues with that token.

Only the echo's own rendering is compared, in isolation: an assistant turn is delimited by the
template's special turn tokens, so its tokens do not depend on the text around it. Argument
values are compared by their rendering (`fragment`), which the template derives from the value.
A template that refuses the probe conversations (gpt-oss's own: a tool result must follow a call,
an assistant turn with calls may not hold both text and reasoning) turns reconciliation off for it
(`usable` False, or a refused echo): the echo is kept as sent (`differed` is `rendering`).
`argument_close(tokenizer)` is the token sequence that closes one argument value in the
template's tool-call format (Qwen3.5 XML: `</parameter>` and its newline), or None when the format
has no distinctive one (Qwen3 JSON): decode anchors after it let a late difference in a long
generated call cost only the tail. `common_prefix(a, b)` is the length of two sequences' common
prefix (token ids, here and in the trace evals).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jinja2

from freetoken_agent.service.types import ChatMessage, ToolCall
from freetoken_agent.tokenizer import ChatTokenizer

_USER = {"role": "user", "content": "q"}
_TOOL = {"role": "tool", "content": "r", "tool_call_id": "c", "name": "f"}  # named: harmony needs it
_SENTINEL = "\u2063v\u2063"  # a value no template rewrites


@dataclass(frozen=True)
class EchoOutcome:
    message: ChatMessage
    reconciled: bool
    changed: bool
    differed: str | None


def _args(call: ToolCall) -> dict[str, Any] | None:
    a = call.arguments
    if isinstance(a, dict):
        return a
    try:
        v = json.loads(a) if a.strip() else {}
    except json.JSONDecodeError:
        return None
    return v if isinstance(v, dict) else None


class EchoReconciler:
    def __init__(self, tokenizer: ChatTokenizer) -> None:
        self.tokenizer = tokenizer
        try:
            head = self._render([_USER])
            both = self._render([_USER, _TOOL])
        except jinja2.TemplateError:  # the template refuses the probes: no reconciliation
            head = both = ""
            self.usable = False
        else:
            self.usable = True
        self._head, self._tail = len(head), len(both) - len(head)  # the user turn before, the tool turn after

    # ------------------------------------------------------------------ rendering
    def _render(self, messages: list[dict[str, Any]]) -> str:
        text = self.tokenizer.apply_chat_template(messages, tools=None, add_generation_prompt=False,
                                                  enable_thinking=True, tokenize=False)
        assert isinstance(text, str)
        return text

    def segment(self, m: ChatMessage) -> str:
        """The text the template renders for assistant message `m` after a user query, followed
        by a tool result (as an echoed tool call is)."""
        text = self._render([_USER, m.to_template(), _TOOL])
        return text[self._head:len(text) - self._tail]

    def fragment(self, name: str, key: str, value: Any) -> str:
        """The rendering of one argument (`key`, `value`) inside a call of `name`."""
        def seg(args: dict[str, Any]) -> str:
            return self.segment(ChatMessage(role="assistant", tool_calls=[ToolCall(id="c", name=name, arguments=args)]))

        full, empty = seg({key: value}), seg({})
        p = common_prefix(full, empty)
        s = common_prefix(full[p:][::-1], empty[p:][::-1])
        return full[p:len(full) - s]

    # ------------------------------------------------------------------ reconciling
    def reconcile(self, echo: ChatMessage, generated: str,
                  defaults: Sequence[tuple[str, str, Any]] = ()) -> EchoOutcome:
        if not self.usable:
            return EchoOutcome(message=echo, reconciled=False, changed=False, differed="rendering")
        try:
            return self._reconcile(echo, generated, defaults)
        except jinja2.TemplateError:  # the template refuses this echo in the probe conversation
            return EchoOutcome(message=echo, reconciled=False, changed=False, differed="rendering")

    def _reconcile(self, echo: ChatMessage, generated: str, defaults: Sequence[tuple[str, str, Any]]) -> EchoOutcome:
        def keep(differed: str | None) -> EchoOutcome:
            return EchoOutcome(message=echo, reconciled=False, changed=False, differed=differed)

        if self._matches(self.segment(echo), generated):
            return EchoOutcome(message=echo, reconciled=True, changed=False, differed=None)
        calls: list[ToolCall] = []
        cursor = 0
        for i, call in enumerate(echo.tool_calls):
            args = _args(call)
            if args is None:
                return keep(f"call {i} arguments")
            found: dict[str, int] = {}
            for key, value in args.items():
                at = generated.find(self.fragment(call.name, key, value), cursor)
                if at >= 0:
                    found[key] = at
            args = {k: v for k, v in args.items() if k in found or not _known(defaults, call.name, k, v)}
            order = sorted(args, key=lambda k: found.get(k, len(generated)))
            calls.append(dataclasses.replace(call, arguments={k: args[k] for k in order}))
            if found:
                cursor = max(found.values())
        candidate = dataclasses.replace(echo, tool_calls=calls)
        if self._matches(self.segment(candidate), generated):
            return EchoOutcome(message=candidate, reconciled=True, changed=True, differed=None)
        return keep(self._which(candidate, generated))

    def _matches(self, segment: str, generated: str) -> bool:
        if not segment.startswith(generated):
            return False
        rest = segment[len(generated):].strip()
        return not rest or rest == self.tokenizer.eos_token


    def _which(self, m: ChatMessage, generated: str) -> str:
        """The first part of `m` whose rendering the generated text does not hold."""
        bare = dataclasses.replace(m, content="", tool_calls=[])
        head = self.segment(bare)
        # the reasoning block: the bare turn up to its last line break before the end token
        cut = head.rfind(self.tokenizer.eos_token or "<|im_end|>")
        think = head[:cut].rstrip()
        if think and not generated.startswith(think):
            return "reasoning"
        if m.content.strip() and m.content.strip() not in generated:
            return "content"
        opener = self.tokenizer.token_to_id("<tool_call>")
        if opener is not None and self.tokenizer.encode(generated).count(opener) != len(m.tool_calls):
            return "tool_calls"
        cursor = 0
        for i, call in enumerate(m.tool_calls):
            if call.name not in generated[cursor:]:
                return f"call {i} name"
            for key, value in (_args(call) or {}).items():
                at = generated.find(self.fragment(call.name, key, value), cursor)
                if at < 0:
                    return f"call {i} argument {key}"
                cursor = max(cursor, at)
        return "rendering" if not m.tool_calls else f"call {len(m.tool_calls) - 1} arguments"


def common_prefix(a: Sequence[Any], b: Sequence[Any]) -> int:
    """Length of the common prefix of two sequences."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _known(defaults: Sequence[tuple[str, str, Any]], tool: str, key: str, value: Any) -> bool:
    return any(t in ("*", tool) and k == key and type(v) is type(value) and v == value for t, k, v in defaults)


def argument_close(tokenizer: ChatTokenizer) -> tuple[int, ...] | None:
    """Token ids that close one argument value of a generated call (see the module docstring): the
    text that follows a value both before another argument and at the end of the call."""
    rec = EchoReconciler(tokenizer)
    if not rec.usable:
        return None

    def after(args: dict[str, Any]) -> str:
        seg = rec.segment(ChatMessage(role="assistant", tool_calls=[ToolCall(id="c", name="f", arguments=args)]))
        return seg[seg.find(_SENTINEL) + len(_SENTINEL):]

    last, more = tokenizer.encode(after({"k": _SENTINEL})), tokenizer.encode(after({"k": _SENTINEL, "k2": "w"}))
    ids = last[:common_prefix(last, more)]
    while ids and not tokenizer.decode(ids[:1]).strip():
        ids = ids[1:]  # the value's own trailing newline may merge with what precedes it
    if len(ids) < 2 or any(tokenizer.is_special(i) for i in ids):
        return None
    return tuple(ids)
