"""Qwen3.5 / Qwen3.6 (and Qwen3-Coder) tool calls: the XML form, typed by the tools' JSON schemas.

Contract (`XmlCallScanner`, for a block body that starts, after whitespace, with `<`):
    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    ...
    </function>
    </tool_call>
- Whitespace (`str.isspace`) may separate the elements; `</function>` may be missing. NAME and
  KEY are the text up to the next `>`, stripped; they must be non-empty and contain no `<` or
  newline. The scanner commits to NAME as soon as its `>` arrives.
- A VALUE is the raw text up to the first `</parameter>` (so `</tool_call>` or `<function=`
  inside a value are value text), minus exactly one leading and one trailing "\\n" when present.
  A repeated KEY appears twice in the arguments text (JSON readers keep the last).
- Anything else where an element is expected (text, an unknown tag) rejects the block at that
  point; an unterminated block is left to the caller.
- Typing by the tools' schemas (`adapters.parsers.tagged_args.ParamTypes`).
- Arguments stream (`ScanResult.delta`) in parameter order as compact JSON: a string value's
  `{"KEY":"` (or `,"KEY":"`) as soon as its `>` arrives, then its escaped text as it arrives,
  holding back only a possible partial `</parameter>` and one trailing newline; other values
  whole at their `</parameter>`; the closing `}` (or `{}`) at `</tool_call>`.
"""

from __future__ import annotations

from adapters.parsers.base import partial_tag_suffix
from adapters.parsers.tagged_args import ParamTypes, Status, TaggedArgsScanner

TOOL_CALL_CLOSE = "</tool_call>"
FUNCTION_OPEN = "<function="
FUNCTION_CLOSE = "</function>"
PARAMETER_OPEN = "<parameter="
PARAMETER_CLOSE = "</parameter>"


def strip_value(raw: str) -> str:
    """Remove exactly one leading and one trailing newline."""
    if raw.startswith("\n"):
        raw = raw[1:]
    if raw.endswith("\n"):
        raw = raw[:-1]
    return raw


class XmlCallScanner(TaggedArgsScanner):
    """Scans `<function=NAME><parameter=KEY>VALUE</parameter>...</function>` bodies, streaming
    the arguments JSON as it settles (string values chunk by chunk, other values whole)."""

    def __init__(self, types: ParamTypes) -> None:
        super().__init__(types)
        self._phase = "lead"
        self._mark = 0  # start of the name/key/value being read
        self._lead_done = False  # the current value's optional leading newline is settled

    def _scan(self, body: str) -> tuple[Status, int]:
        end = len(body)
        while True:
            pos = self._pos
            phase = self._phase
            if phase in ("lead", "elements", "after_function"):
                if phase == "lead":
                    expected: tuple[str, ...] = (FUNCTION_OPEN,)
                elif phase == "elements":
                    expected = (PARAMETER_OPEN, FUNCTION_CLOSE, TOOL_CALL_CLOSE)
                else:
                    expected = (TOOL_CALL_CLOSE,)
                tag, status = self._expect(body, expected)
                if status is not None:
                    return status, self._pos
                if tag == TOOL_CALL_CLOSE:
                    self._close_call()
                    return "done", self._pos
                if tag == FUNCTION_CLOSE:
                    self._phase = "after_function"
                else:
                    self._phase = "function_name" if tag == FUNCTION_OPEN else "parameter_key"
                    self._mark = self._pos
            elif phase in ("function_name", "parameter_key"):
                close = body.find(">", pos)
                stop = end if close < 0 else close
                bad = _first_of(body, pos, stop, "<\n")
                if bad >= 0:
                    return "reject", bad
                if close < 0:
                    self._pos = end
                    return "more", 0
                word = body[self._mark : close].strip()
                if not word:
                    return "reject", close
                self._pos = self._mark = close + 1
                if phase == "function_name":
                    self._name = word
                    self._phase = "elements"
                else:
                    self._phase = "value"
                    self._lead_done = False
                    self._open_value(word)
            elif not self._value(body):
                return "more", 0

    def _value(self, body: str) -> bool:
        """Advance through a value; True once its `</parameter>` was read."""
        end = len(body)
        if not self._lead_done and self._pos < end:
            self._lead_done = True
            if body[self._pos] == "\n":
                self._pos += 1
        close = body.find(PARAMETER_CLOSE, max(self._pos, self._mark))
        if close < 0:
            if not self._streaming:
                self._pos = max(self._pos, end - len(PARAMETER_CLOSE) + 1)
                return False
            settled = max(self._pos, end - partial_tag_suffix(body, PARAMETER_CLOSE))
            if settled > self._pos and body[settled - 1] == "\n":
                settled -= 1  # may be the newline before </parameter>, which is stripped
            self._stream(body[self._pos : settled])
            self._pos = settled
            return False
        if self._streaming:
            tail = body[self._pos : close]
            self._stream(tail[:-1] if tail.endswith("\n") else tail)
        self._close_value(strip_value(body[self._mark : close]))
        self._pos = close + len(PARAMETER_CLOSE)
        self._phase = "elements"
        return True


def _first_of(text: str, start: int, stop: int, chars: str) -> int:
    """The first index in text[start:stop] holding one of `chars`, or -1."""
    found = [i for i in (text.find(c, start, stop) for c in chars) if i >= 0]
    return min(found) if found else -1
