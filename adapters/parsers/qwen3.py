"""Qwen3 (MoE) tool calls: a JSON object per `<tool_call>` block.

Contract (`JsonCallScanner`, for a block body that starts, after whitespace, with `{`):
    <tool_call>\\n{"name": "fn", "arguments": {...}}\\n</tool_call>
- The object runs from its `{` to the matching close (strings and escapes respected). Only
  whitespace may follow it before `</tool_call>`; anything else rejects the block there. A
  `</tool_call>` outside a string before the object closes rejects the block (the tag itself is
  then ordinary text); inside a string it is string text.
- The object must decode (raw control characters in strings are tolerated; NaN/Infinity are not)
  to a mapping with a non-empty string "name". Its arguments are "arguments" (else "parameters"):
  a mapping, a string holding a JSON object (double-encoded), or absent/null (= `{}`); anything
  else makes the block malformed. Other keys are ignored. Arguments are re-encoded compactly.
- The scanner commits to the name (so the caller can announce the call) as soon as the object
  opens with `{"name": "<string>"` within its first 4096 characters; a block that then turns out
  malformed is still rejected, and the caller abandons the announced call. A later duplicate
  "name" that differs from the committed one also makes the block malformed.
"""

from __future__ import annotations

import re
from typing import Any

from adapters.parsers.base import ScanResult, compact_json, loads_json, skip_space, tag_may_start

TOOL_CALL_CLOSE = "</tool_call>"

_NAME_WINDOW = 4096
_NAME_RE = re.compile(r'[ \t\n\r]*\{[ \t\n\r]*"name"[ \t\n\r]*:[ \t\n\r]*"((?:[^"\\]|\\.)*)"', re.S)
_IN_STRING = re.compile(r'["\\]')
_STRUCTURAL = re.compile(r'[{}\[\]"<]')


class JsonCallScanner:
    """Scans `{"name": ..., "arguments": ...}` bodies; see the module docstring."""

    def __init__(self) -> None:
        self._name: str | None = None
        self._name_search = True  # the early name commit is still possible
        self._pos = 0  # scan position in the body
        self._start = -1  # index of the object's "{"
        self._obj_end = -1  # index after the object's closing "}" (-1 while open)
        self._depth = 0
        self._in_string = False

    @property
    def name(self) -> str | None:
        return self._name

    def scan(self, body: str) -> ScanResult:
        if self._start < 0:
            start = skip_space(body, 0)
            if start == len(body):
                return ScanResult("more")
            if body[start] != "{":
                return ScanResult("reject", start)
            self._start = self._pos = start
        if self._obj_end < 0:
            result = self._scan_object(body)
            self._find_name(body)
            if result is not None:
                return result
        pos = skip_space(body, self._pos)
        self._pos = pos
        if body.startswith(TOOL_CALL_CLOSE, pos):
            end = pos + len(TOOL_CALL_CLOSE)
            arguments = self._decode(body[self._start : self._obj_end])
            if arguments is None:
                return ScanResult("reject", end)
            return ScanResult("done", end, delta=arguments)
        if tag_may_start(body, pos, TOOL_CALL_CLOSE):
            return ScanResult("more")
        return ScanResult("reject", pos)

    def _scan_object(self, body: str) -> ScanResult | None:
        """Advance through the open object: None once it closed, else "more" or "reject"."""
        pos, end = self._pos, len(body)
        while pos < end:
            if self._in_string:
                match = _IN_STRING.search(body, pos)
                if match is None:
                    pos = end
                    break
                at = match.start()
                if body[at] == "\\":
                    if at + 1 >= end:
                        pos = at
                        break
                    pos = at + 2
                else:
                    self._in_string = False
                    pos = at + 1
                continue
            match = _STRUCTURAL.search(body, pos)
            if match is None:
                pos = end
                break
            at = match.start()
            char = body[at]
            if char == '"':
                self._in_string = True
                pos = at + 1
            elif char in "{[":
                self._depth += 1
                pos = at + 1
            elif char in "}]":
                self._depth -= 1
                pos = at + 1
                if self._depth == 0:
                    self._pos = self._obj_end = pos
                    return None
            elif body.startswith(TOOL_CALL_CLOSE, at):
                self._pos = at
                return ScanResult("reject", at)
            elif tag_may_start(body, at, TOOL_CALL_CLOSE):
                pos = at
                break
            else:
                pos = at + 1
        self._pos = pos
        return ScanResult("more")

    def _find_name(self, body: str) -> None:
        """Commit to the name once `{"name": "<string>"` lies within the scanned text."""
        if self._name is not None or not self._name_search:
            return
        limit = min(self._pos, _NAME_WINDOW)
        match = _NAME_RE.match(body, 0, limit)
        if match is None:
            if limit >= _NAME_WINDOW or self._obj_end >= 0:
                self._name_search = False
            return
        self._name_search = False
        try:
            name = loads_json(f'"{match.group(1)}"')
        except ValueError:
            return
        if isinstance(name, str) and name:
            self._name = name

    def _decode(self, text: str) -> str | None:
        """The compact arguments of a complete object, or None when it is not a valid call."""
        try:
            obj = loads_json(text)
        except (ValueError, RecursionError):
            return None
        if not isinstance(obj, dict):
            return None
        name = obj.get("name")
        if not isinstance(name, str) or not name or (self._name is not None and name != self._name):
            return None
        arguments: Any = obj["arguments"] if "arguments" in obj else obj.get("parameters")
        if arguments is None:
            arguments = {}
        elif isinstance(arguments, str):
            try:
                arguments = loads_json(arguments)
            except (ValueError, RecursionError):
                return None
        if not isinstance(arguments, dict):
            return None
        try:
            encoded = compact_json(arguments)
        except (ValueError, TypeError, RecursionError):
            return None
        self._name = name
        return encoded
