"""DeepSeek-V3 / V3.1 and Kimi-K2 tool calls: special-token delimited, JSON arguments.

Contract: calls sit in a section `<｜tool▁calls▁begin｜>` ... `<｜tool▁calls▁end｜>`; each call is
a block opened by `CALL_OPEN` (`<｜tool▁call▁begin｜>`) whose body `DeepSeekCallScanner` reads:
- V3:   `function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>`
- V3.1: `NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>`
NAME is stripped, non-empty, without `<` or a newline; ARGS is a JSON object (whitespace around it
allowed; in the V3 form the fence may be missing its language tag). The call is announced when
NAME is complete; the arguments (compact JSON) come whole at `<｜tool▁call▁end｜>`. Anything else
rejects the block at that point. `SECTION_TAGS` are dropped from content by the stream parser
(`adapters.parsers.stream`), holding back only a proper prefix of one of them. Kimi-K2's form
(`KimiCallScanner`, `KIMI_*` tags) is described at its scanner.
"""

from __future__ import annotations

from typing import Literal

from adapters.parsers.base import ScanResult, compact_json, loads_json, partial_tag_suffix, skip_space

CALL_OPEN = "<｜tool▁call▁begin｜>"
CALL_CLOSE = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
SECTION_TAGS = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
FENCE = "```"

Status = Literal["more", "done", "reject"]


class DeepSeekCallScanner:
    def __init__(self) -> None:
        self._name: str | None = None
        self._args_at = 0  # where the arguments text starts, once the name is read
        self._fenced = False

    @property
    def name(self) -> str | None:
        return self._name

    def scan(self, body: str) -> ScanResult:
        if self._name is None:
            status, end = self._read_name(body)
            if status != "done":
                return ScanResult(status, end)
        close = body.find(CALL_CLOSE, self._args_at)
        if close < 0:
            return ScanResult("more")
        text = body[self._args_at:close].strip()
        if self._fenced:
            if not text.endswith(FENCE):
                return ScanResult("reject", close)
            text = text[:-len(FENCE)]
        try:
            args = loads_json(text)
        except (ValueError, RecursionError):
            return ScanResult("reject", close)
        if not isinstance(args, dict):
            return ScanResult("reject", close)
        return ScanResult("done", close + len(CALL_CLOSE), compact_json(args))

    def _read_name(self, body: str) -> tuple[Status, int]:
        start = skip_space(body, 0)
        v3 = "function" + SEP
        rest = body[start:]
        if rest and len(rest) < len(v3) and v3.startswith(rest):
            return "more", 0  # may still become the V3 form
        fenced = body.startswith(v3, start)
        at = start + len(v3) if fenced else start
        if fenced:  # the name ends at a newline
            stop = body.find("\n", at)
            limit = stop if stop >= 0 else len(body)
            bad = body.find("<", at, limit)
        else:  # the name ends at <｜tool▁sep｜>
            stop = body.find(SEP, at)
            limit = stop if stop >= 0 else len(body) - partial_tag_suffix(body, SEP)
            bad = min((i for i in (body.find("<", at, limit), body.find("\n", at, limit)) if i >= 0), default=-1)
        if bad >= 0:
            return "reject", bad
        if stop < 0:
            return "more", 0
        name = body[at:stop].strip()
        if not name:
            return "reject", stop
        after = stop + (1 if fenced else len(SEP))
        if fenced:  # ```json, then a newline before the arguments
            lead = skip_space(body, after)
            head = body[lead:lead + len(FENCE)]
            if not FENCE.startswith(head):
                return "reject", lead
            newline = body.find("\n", lead)
            if len(head) < len(FENCE) or newline < 0:
                return "more", 0
            if body[lead + len(FENCE):newline].strip() not in ("", "json"):
                return "reject", lead
            after = newline + 1
        self._name, self._args_at, self._fenced = name, after, fenced
        return "done", 0


# Kimi-K2 (DeepSeek-V3's architecture, its own call tokens):
#   <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>ARGS
#   <|tool_call_end|>...<|tool_calls_section_end|>
KIMI_CALL_OPEN = "<|tool_call_begin|>"
KIMI_CALL_CLOSE = "<|tool_call_end|>"
KIMI_ARGS = "<|tool_call_argument_begin|>"
KIMI_SECTION_TAGS = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")


class KimiCallScanner:
    """Reads `functions.NAME:INDEX<|tool_call_argument_begin|>ARGS<|tool_call_end|>`: the call id's
    NAME (without the `functions.` prefix and the `:INDEX` suffix, both optional) is announced when
    the argument tag arrives; ARGS, a JSON object, comes whole at the close tag."""

    def __init__(self) -> None:
        self._name: str | None = None
        self._args_at = 0

    @property
    def name(self) -> str | None:
        return self._name

    def scan(self, body: str) -> ScanResult:
        if self._name is None:
            stop = body.find(KIMI_ARGS)
            limit = stop if stop >= 0 else len(body) - partial_tag_suffix(body, KIMI_ARGS)
            bad = min((i for i in (body.find("<", 0, limit), body.find("\n", skip_space(body, 0), limit)) if i >= 0),
                      default=-1)
            if bad >= 0:
                return ScanResult("reject", bad)
            if stop < 0:
                return ScanResult("more")
            ident = body[:stop].strip().removeprefix("functions.")
            name = ident.rsplit(":", 1)[0] if ident.rsplit(":", 1)[-1].isdigit() else ident
            if not name:
                return ScanResult("reject", stop)
            self._name, self._args_at = name, stop + len(KIMI_ARGS)
        close = body.find(KIMI_CALL_CLOSE, self._args_at)
        if close < 0:
            return ScanResult("more")
        try:
            args = loads_json(body[self._args_at:close])
        except (ValueError, RecursionError):
            return ScanResult("reject", close)
        if not isinstance(args, dict):
            return ScanResult("reject", close)
        return ScanResult("done", close + len(KIMI_CALL_CLOSE), compact_json(args))
