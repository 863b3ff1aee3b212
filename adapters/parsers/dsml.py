"""DeepSeek-V3.2 tool calls: DSML invoke / parameter tags, each value marked string or JSON.

Contract (`DsmlCallScanner`, for the body of a block opened by `INVOKE_OPEN`):
    <｜DSML｜function_calls>
    <｜DSML｜invoke name="NAME">
    <｜DSML｜parameter name="KEY" string="true">VALUE</｜DSML｜parameter>
    <｜DSML｜parameter name="KEY" string="false">JSON</｜DSML｜parameter>
    </｜DSML｜invoke>
    ...
    </｜DSML｜function_calls>
- Each invoke is one call (the block); `SECTION_TAGS` (the function_calls pair) are dropped from
  content by the stream parser. NAME is the text up to `">`, without `"`, `<`, `>` or a newline,
  stripped, non-empty; the call is announced at its `">`.
- Whitespace may separate the elements. A parameter's header is `KEY"` then optionally
  ` string="true"` or ` string="false"`, then `>`; KEY is non-empty, without `"`, `<`, `>` or a
  newline. VALUE is the raw text up to the first `</｜DSML｜parameter>`.
- Typing: `string="true"` keeps VALUE a string (streamed chunk by chunk, holding back only a
  possible partial close tag); `string="false"` decodes it as JSON (the raw string when it does not
  decode); without the attribute the tools' schemas decide, as in GLM's form
  (`adapters.parsers.tagged_args`). `}` (or `{}`) at `</｜DSML｜invoke>`.
- Anything else where an element is expected rejects the block at that point.
"""

from __future__ import annotations

import re

from adapters.parsers.base import compact_json, loads_json
from adapters.parsers.tagged_args import ParamTypes, Status, TaggedArgsScanner

INVOKE_OPEN = '<｜DSML｜invoke name="'
INVOKE_CLOSE = "</｜DSML｜invoke>"
PARAM_OPEN = '<｜DSML｜parameter name="'
PARAM_CLOSE = "</｜DSML｜parameter>"
SECTION_TAGS = ("<｜DSML｜function_calls>", "</｜DSML｜function_calls>")
MARKER = "｜DSML｜"  # in a chat template: this call format
_HEADER = re.compile(r'([^"<>\n]+)"(?: string="(true|false)")?')


class DsmlCallScanner(TaggedArgsScanner):
    """Scans `NAME">` + parameters + `</｜DSML｜invoke>` bodies."""

    def __init__(self, types: ParamTypes) -> None:
        super().__init__(types)
        self._phase = "name"
        self._mark = 0  # start of the header / value being read
        self._json = False  # the current value is marked string="false"

    def _scan(self, body: str) -> tuple[Status, int]:
        while True:
            if self._phase == "name":
                close = body.find('">', self._pos)
                stop = close if close >= 0 else len(body) - body.endswith('"')  # a final `"` may start `">`
                bad = [i for i in (body.find(c, self._pos, stop) for c in '"<>\n') if i >= 0]
                if bad:
                    return "reject", min(bad)
                if close < 0:
                    return "more", 0
                name = body[self._pos:close].strip()
                if not name:
                    return "reject", close
                self._name, self._pos, self._phase = name, close + 2, "elements"
            elif self._phase == "elements":
                tag, status = self._expect(body, (PARAM_OPEN, INVOKE_CLOSE))
                if status is not None:
                    return status, self._pos
                if tag == INVOKE_CLOSE:
                    self._close_call()
                    return "done", self._pos
                self._mark, self._phase = self._pos, "header"
            elif self._phase == "header":
                close = body.find(">", self._mark)
                stop = len(body) if close < 0 else close
                bad = [i for i in (body.find("<", self._mark, stop), body.find("\n", self._mark, stop)) if i >= 0]
                if bad:
                    return "reject", min(bad)
                if close < 0:
                    return "more", 0
                header = _HEADER.fullmatch(body, self._mark, close)
                if header is None or not header.group(1).strip():
                    return "reject", self._mark
                self._open_tagged(header.group(1).strip(), header.group(2))
                self._pos = self._mark = close + 1
                self._phase = "value"
            elif not self._read_value(body, PARAM_CLOSE):
                return "more", 0

    def _open_tagged(self, key: str, string: str | None) -> None:
        """A value opens: its `string` attribute ("true", "false" or None: the schema) types it."""
        if string is None:
            self._json = False
            self._open_value(key)
            return
        self._key, self._streaming, self._json = key, string == "true", string == "false"
        if self._streaming:
            self._member()
            self._delta.append('"')

    def _close_value(self, raw: str) -> None:
        if self._json:
            self._member()
            try:
                value = loads_json(raw)
            except (ValueError, RecursionError):
                value = raw
            self._delta.append(compact_json(value))
        else:
            super()._close_value(raw)

