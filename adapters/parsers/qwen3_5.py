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
  A repeated KEY keeps its last value, in the position of its first appearance.
- Anything else where an element is expected (text, an unknown tag) rejects the block at that
  point; an unterminated block is left to the caller.
- Typing (`ParamTypes`): a value stays a string unless the function's schema declares the
  parameter with types (`type`, a list of types, `anyOf`/`oneOf` members, or the JSON types of an
  `enum`) that do not include "string"; then it is decoded as JSON (NaN/Infinity refused), with
  "True"/"False" accepted for booleans, and kept as the raw string when it does not decode.
  Unknown functions and parameters are strings.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from adapters.parsers.base import ScanResult, compact_json, loads_json, skip_space, tag_may_start

TOOL_CALL_CLOSE = "</tool_call>"
FUNCTION_OPEN = "<function="
FUNCTION_CLOSE = "</function>"
PARAMETER_OPEN = "<parameter="
PARAMETER_CLOSE = "</parameter>"

_JSON_TYPES: tuple[tuple[type, str], ...] = (
    (bool, "boolean"),
    (int, "integer"),
    (float, "number"),
    (str, "string"),
    (list, "array"),
    (dict, "object"),
    (type(None), "null"),
)


def _schema_types(schema: Any, depth: int = 0) -> set[str]:
    """The JSON types a (sub)schema allows, as far as it says; empty when it does not say."""
    if not isinstance(schema, dict) or depth > 8:
        return set()
    types: set[str] = set()
    declared = schema.get("type")
    if isinstance(declared, str):
        types.add(declared)
    elif isinstance(declared, list):
        types.update(t for t in declared if isinstance(t, str))
    for key in ("anyOf", "oneOf"):
        members = schema.get(key)
        if isinstance(members, list):
            for member in members:
                types |= _schema_types(member, depth + 1)
    enum = schema.get("enum")
    if not types and isinstance(enum, list):
        for value in enum:
            types.update(name for kind, name in _JSON_TYPES if isinstance(value, kind))
    return types


class ParamTypes:
    """Per function, per parameter: the JSON types its schema declares (from an OpenAI tools list)."""

    def __init__(self, tools: Iterable[Any] | None) -> None:
        self._types: dict[str, dict[str, frozenset[str]]] = {}
        for tool in tools or ():
            if not isinstance(tool, dict):
                continue
            function = tool.get("function", tool)
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                continue
            parameters = function.get("parameters")
            properties = parameters.get("properties") if isinstance(parameters, dict) else None
            params: dict[str, frozenset[str]] = {}
            if isinstance(properties, dict):
                for key, schema in properties.items():
                    params[str(key)] = frozenset(_schema_types(schema))
            self._types[function["name"]] = params

    def convert(self, function: str, key: str, value: str) -> Any:
        """The parameter's value: the string itself, or its JSON decoding when the schema says so."""
        types = self._types.get(function, {}).get(key, frozenset())
        if not types or "string" in types:
            return value
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
    """Scans `<function=NAME><parameter=KEY>VALUE</parameter>...</function>` bodies."""

    def __init__(self, types: ParamTypes) -> None:
        self._types = types
        self._name: str | None = None
        self._phase = "lead"
        self._pos = 0
        self._mark = 0  # start of the name/key/value being read
        self._key = ""
        self._params: list[tuple[str, str]] = []

    @property
    def name(self) -> str | None:
        return self._name

    def scan(self, body: str) -> ScanResult:
        end = len(body)
        while True:
            pos = self._pos
            phase = self._phase
            if phase in ("lead", "elements", "after_function"):
                pos = self._pos = skip_space(body, pos)
                if pos == end:
                    return ScanResult("more")
                if phase == "lead":
                    expected: tuple[str, ...] = (FUNCTION_OPEN,)
                elif phase == "elements":
                    expected = (PARAMETER_OPEN, FUNCTION_CLOSE, TOOL_CALL_CLOSE)
                else:
                    expected = (TOOL_CALL_CLOSE,)
                tag = next((t for t in expected if body.startswith(t, pos)), None)
                if tag is None:
                    if any(tag_may_start(body, pos, t) for t in expected):
                        return ScanResult("more")
                    return ScanResult("reject", pos)
                self._pos = pos + len(tag)
                if tag == TOOL_CALL_CLOSE:
                    return ScanResult("done", self._pos, self._arguments())
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
                    return ScanResult("reject", bad)
                if close < 0:
                    self._pos = end
                    return ScanResult("more")
                word = body[self._mark : close].strip()
                if not word:
                    return ScanResult("reject", close)
                self._pos = self._mark = close + 1
                if phase == "function_name":
                    self._name = word
                    self._phase = "elements"
                else:
                    self._key = word
                    self._phase = "value"
            else:  # value
                close = body.find(PARAMETER_CLOSE, pos)
                if close < 0:
                    self._pos = max(pos, end - len(PARAMETER_CLOSE) + 1)
                    return ScanResult("more")
                self._params.append((self._key, body[self._mark : close]))
                self._pos = close + len(PARAMETER_CLOSE)
                self._phase = "elements"

    def _arguments(self) -> str:
        name = self._name or ""
        arguments: dict[str, Any] = {}
        for key, raw in self._params:
            arguments[key] = self._types.convert(name, key, strip_value(raw))
        return compact_json(arguments)


def _first_of(text: str, start: int, stop: int, chars: str) -> int:
    """The first index in text[start:stop] holding one of `chars`, or -1."""
    found = [i for i in (text.find(c, start, stop) for c in chars) if i >= 0]
    return min(found) if found else -1
