"""What the tag-delimited tool-call forms share (Qwen3.5's XML form, GLM's key / value tags): the
parameters' schema types and the arguments JSON they stream.

Contract:
- `ParamTypes(tools)`: a value stays a string unless the function's schema declares the parameter
  with types (`type`, a list of types, `anyOf`/`oneOf` members, or the JSON types of an `enum`)
  that do not include "string"; then it is decoded as JSON (NaN/Infinity refused), with
  "True"/"False" accepted for booleans, and kept as the raw string when it does not decode.
  Unknown functions and parameters are strings.
- `TaggedArgsScanner` is the base of such a `CallScanner`: a subclass reads its form in `_scan`
  and reports each value with `_open_value` (as soon as its key is known), `_stream` (a string
  value's settled text, in order) and `_close_value` (at its close tag), and the block's end with
  `_close_call`. The arguments stream in parameter order as compact JSON: a string value's
  `{"KEY":"` (or `,"KEY":"`) at `_open_value`, then its escaped text, then `"`; any other value
  whole at `_close_value`; the closing `}` (or `{}`) at `_close_call`. A repeated KEY appears
  twice (JSON readers keep the last).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
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

Status = Literal["more", "done", "reject"]


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


class TaggedArgsScanner(ABC):
    """A `CallScanner` whose arguments are tagged KEY / VALUE pairs typed by `ParamTypes`."""

    def __init__(self, types: ParamTypes) -> None:
        self._types = types
        self._name: str | None = None
        self._pos = 0  # scan position in the body
        self._mark = 0  # start of the key / value being read (a subclass's scan sets it)
        self._phase = ""  # where a subclass's scan is in its form
        self._key = ""  # the current value's key
        self._streaming = False  # the current value is a string streamed as it comes
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

    @abstractmethod
    def _scan(self, body: str) -> tuple[Status, int]:
        """Continue over `body`: ("more", _), ("done", end) or ("reject", at)."""

    def _expect(self, body: str, tags: tuple[str, ...]) -> tuple[str | None, Status | None]:
        """Skips whitespace, then reads one of `tags`: (tag, None), or (None, "more" / "reject");
        the position is then after the tag, or at the first character that is not whitespace."""
        pos = self._pos = skip_space(body, self._pos)
        if pos == len(body):
            return None, "more"
        tag = next((t for t in tags if body.startswith(t, pos)), None)
        if tag is None:
            return None, "more" if any(tag_may_start(body, pos, t) for t in tags) else "reject"
        self._pos = pos + len(tag)
        return tag, None

    def _open_value(self, key: str) -> None:
        self._key = key
        self._streaming = self._types.is_string(self._name or "", key)
        if self._streaming:
            self._member()
            self._delta.append('"')

    def _stream(self, text: str) -> None:
        """More of a string value's text (only while `_streaming`)."""
        if text:
            self._delta.append(compact_json(text)[1:-1])

    def _close_value(self, raw: str) -> None:
        """The value ends; `raw` is its whole text (used when it is not streamed)."""
        if self._streaming:
            self._delta.append('"')
        else:
            self._member()
            self._delta.append(compact_json(self._types.convert(self._name or "", self._key, raw)))

    def _close_call(self) -> None:
        self._delta.append("}" if self._opened else "{}")

    def _read_value(self, body: str, close_tag: str) -> bool:
        """Advance through a value that ends at `close_tag` (a string value's settled text streamed as
        it comes); True once the tag was read, the scan then back at "elements"."""
        close = body.find(close_tag, self._mark)
        if close < 0:
            if self._streaming:
                settled = max(self._pos, len(body) - partial_tag_suffix(body, close_tag))
                self._stream(body[self._pos:settled])
                self._pos = settled
            return False
        if self._streaming:
            self._stream(body[self._pos:close])
        self._close_value(body[self._mark:close])
        self._pos, self._phase = close + len(close_tag), "elements"
        return True

    def _member(self) -> None:
        self._delta.append(("," if self._opened else "{") + compact_json(self._key) + ":")
        self._opened = True
