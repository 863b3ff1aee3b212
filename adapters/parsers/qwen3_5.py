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
- Typing (`ParamTypes`): a value stays a string unless the function's schema declares the
  parameter with types (`type`, a list of types, `anyOf`/`oneOf` members, or the JSON types of an
  `enum`) that do not include "string"; then it is decoded as JSON (NaN/Infinity refused), with
  "True"/"False" accepted for booleans, and kept as the raw string when it does not decode.
  Unknown functions and parameters are strings.
- Arguments stream (`ScanResult.delta`) in parameter order as compact JSON: a string value's
  `{"KEY":"` (or `,"KEY":"`) as soon as its `>` arrives, then its escaped text as it arrives,
  holding back only a possible partial `</parameter>` and one trailing newline; other values
  whole at their `</parameter>`; the closing `}` (or `{}`) at `</tool_call>`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

from adapters.parsers.base import (
    ScanResult,
    compact_json,
    loads_json,
    partial_tag_suffix,
    skip_space,
    tag_may_start,
)
from freetoken_agent.constrain.schema import declared_types

TOOL_CALL_CLOSE = "</tool_call>"
FUNCTION_OPEN = "<function="
FUNCTION_CLOSE = "</function>"
PARAMETER_OPEN = "<parameter="
PARAMETER_CLOSE = "</parameter>"

class ParamTypes:
    """Per function, per parameter: the JSON types its schema declares. Reads an OpenAI tools list
    (`{"type": "function", "function": {"name", "parameters"}}`), also bare `{"name", "parameters"
    | "input_schema"}` entries; entries of any other shape are ignored."""

    def __init__(self, tools: Iterable[Any] | None) -> None:
        self._types: dict[str, dict[str, frozenset[str]]] = {}
        for tool in tools or ():
            if not isinstance(tool, dict):
                continue
            function = tool.get("function", tool)
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                continue
            parameters = function.get("parameters", function.get("input_schema"))
            properties = parameters.get("properties") if isinstance(parameters, dict) else None
            params: dict[str, frozenset[str]] = {}
            if isinstance(properties, dict):
                for key, schema in properties.items():
                    params[str(key)] = frozenset(declared_types(schema))
            self._types[function["name"]] = params

    def is_string(self, function: str, key: str) -> bool:
        """The parameter's value stays a string (no schema, or its types include "string")."""
        types = self._types.get(function, {}).get(key, frozenset())
        return not types or "string" in types

    def convert(self, function: str, key: str, value: str) -> Any:
        """The parameter's value: the string itself, or its JSON decoding when the schema says so."""
        if self.is_string(function, key):
            return value
        types = self._types[function][key]
        try:
            return loads_json(value)
        except (ValueError, RecursionError):
            pass
        if "boolean" in types and value.strip() in ("True", "False"):
            return value.strip() == "True"
        return value


def strip_value(raw: str) -> str:
    """Remove exactly one leading and one trailing newline."""
    if raw.startswith("\n"):
        raw = raw[1:]
    if raw.endswith("\n"):
        raw = raw[:-1]
    return raw


class XmlCallScanner:
    """Scans `<function=NAME><parameter=KEY>VALUE</parameter>...</function>` bodies, streaming
    the arguments JSON as it settles (string values chunk by chunk, other values whole)."""

    def __init__(self, types: ParamTypes) -> None:
        self._types = types
        self._name: str | None = None
        self._phase = "lead"
        self._pos = 0
        self._mark = 0  # start of the name/key/value being read
        self._key = ""
        self._streaming = False  # the current value is a string streamed as it comes
        self._lead_done = False  # the current value's optional leading newline is settled
        self._opened = False  # "{" is out
        self._delta: list[str] = []

    @property
    def name(self) -> str | None:
        return self._name

    def scan(self, body: str) -> ScanResult:
        status, end = self._scan(body)
        delta = "".join(self._delta)
        self._delta = []
        return ScanResult(status, end, delta)

    def _scan(self, body: str) -> tuple[Literal["more", "done", "reject"], int]:
        end = len(body)
        while True:
            pos = self._pos
            phase = self._phase
            if phase in ("lead", "elements", "after_function"):
                pos = self._pos = skip_space(body, pos)
                if pos == end:
                    return "more", 0
                if phase == "lead":
                    expected: tuple[str, ...] = (FUNCTION_OPEN,)
                elif phase == "elements":
                    expected = (PARAMETER_OPEN, FUNCTION_CLOSE, TOOL_CALL_CLOSE)
                else:
                    expected = (TOOL_CALL_CLOSE,)
                tag = next((t for t in expected if body.startswith(t, pos)), None)
                if tag is None:
                    if any(tag_may_start(body, pos, t) for t in expected):
                        return "more", 0
                    return "reject", pos
                self._pos = pos + len(tag)
                if tag == TOOL_CALL_CLOSE:
                    self._delta.append("}" if self._opened else "{}")
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
                    self._start_value(word)
            elif not self._value(body):
                return "more", 0

    def _start_value(self, key: str) -> None:
        self._key = key
        self._phase = "value"
        self._lead_done = False
        self._streaming = self._types.is_string(self._name or "", key)
        if self._streaming:
            self._member(key)
            self._delta.append('"')

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
            self._emit_string(body[self._pos : settled])
            self._pos = settled
            return False
        if self._streaming:
            tail = body[self._pos : close]
            self._emit_string(tail[:-1] if tail.endswith("\n") else tail)
            self._delta.append('"')
        else:
            raw = strip_value(body[self._mark : close])
            self._member(self._key)
            self._delta.append(compact_json(self._types.convert(self._name or "", self._key, raw)))
        self._pos = close + len(PARAMETER_CLOSE)
        self._phase = "elements"
        return True

    def _member(self, key: str) -> None:
        self._delta.append(("," if self._opened else "{") + compact_json(key) + ":")
        self._opened = True

    def _emit_string(self, text: str) -> None:
        if text:
            self._delta.append(compact_json(text)[1:-1])


def _first_of(text: str, start: int, stop: int, chars: str) -> int:
    """The first index in text[start:stop] holding one of `chars`, or -1."""
    found = [i for i in (text.find(c, start, stop) for c in chars) if i >= 0]
    return min(found) if found else -1
