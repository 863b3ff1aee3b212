"""GLM-4.5 / 4.6 / 4.7 (and GLM-4.7-Flash) tool calls: key / value tags, typed by the tools' schemas.

Contract (`GlmCallScanner`, for the body of a `<tool_call>` block):
    <tool_call>NAME
    <arg_key>KEY</arg_key>
    <arg_value>VALUE</arg_value>
    ...
    </tool_call>
- NAME is the text (after leading whitespace) up to the first newline or `<`, stripped; it must be
  non-empty. The scanner commits to it when that newline or `<` arrives.
- Whitespace may separate the elements (GLM-4.5 writes newlines, GLM-4.7 none). A KEY is the text
  up to `</arg_key>`, stripped, non-empty, without `<` or a newline; each KEY is followed (after
  whitespace) by one `<arg_value>`. A VALUE is the raw text up to the first `</arg_value>`, kept
  verbatim (the chat templates write string values as they are and other values as JSON).
- Anything else where an element is expected rejects the block at that point; an unterminated
  block is left to the caller.
- Typing and streaming as the Qwen3.5 XML form (`adapters.parsers.tagged_args`): string
  values stream chunk by chunk as `{"KEY":"...` holding back only a possible partial
  `</arg_value>`; other values are decoded as JSON whole at their `</arg_value>` (the raw string
  when they do not decode); `}` (or `{}`) at `</tool_call>`.
"""

from __future__ import annotations

from adapters.parsers.base import partial_tag_suffix, skip_space
from adapters.parsers.tagged_args import ParamTypes, Status, TaggedArgsScanner

TOOL_CALL_CLOSE = "</tool_call>"
KEY_OPEN, KEY_CLOSE = "<arg_key>", "</arg_key>"
VALUE_OPEN, VALUE_CLOSE = "<arg_value>", "</arg_value>"


class GlmCallScanner(TaggedArgsScanner):
    """Scans `NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>` bodies."""

    def __init__(self, types: ParamTypes) -> None:
        super().__init__(types)
        self._phase = "name"
        self._mark = 0  # start of the key / value being read

    def _scan(self, body: str) -> tuple[Status, int]:
        end = len(body)
        while True:
            phase = self._phase
            if phase == "name":
                start = skip_space(body, self._pos)
                stops = [i for i in (body.find("\n", start), body.find("<", start)) if i >= 0]
                if not stops:
                    self._pos = start
                    return "more", 0
                word = body[start:min(stops)].strip()
                if not word:
                    return "reject", min(stops)
                self._name, self._pos, self._phase = word, min(stops), "elements"
            elif phase in ("elements", "value_open"):
                tags = (KEY_OPEN, TOOL_CALL_CLOSE) if phase == "elements" else (VALUE_OPEN,)
                tag, status = self._expect(body, tags)
                if status is not None:
                    return status, self._pos
                if tag == TOOL_CALL_CLOSE:
                    self._close_call()
                    return "done", self._pos
                self._mark = self._pos
                self._phase = "key" if tag == KEY_OPEN else "value"
                if tag == VALUE_OPEN:
                    self._open_value(self._key)
            elif phase == "key":
                close = body.find(KEY_CLOSE, self._mark)
                stop = end - partial_tag_suffix(body, KEY_CLOSE) if close < 0 else close
                bad = [i for i in (body.find("<", self._mark, stop), body.find("\n", self._mark, stop)) if i >= 0]
                if bad:
                    return "reject", min(bad)
                if close < 0:
                    return "more", 0
                self._key = body[self._mark:close].strip()
                if not self._key:
                    return "reject", close
                self._pos, self._phase = close + len(KEY_CLOSE), "value_open"
            elif not self._read_value(body, VALUE_CLOSE):
                return "more", 0

