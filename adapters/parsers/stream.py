"""The streaming state machine shared by the Qwen and GLM families: reasoning, then content and tool calls.

Contract (`QwenOutputParser`; see `adapters.parsers` for the whole rule set):
- Reasoning first (`ThinkSplitter`, unless `parse_reasoning` is off, in which case everything is
  content and think tags are content text).
- Then content, in which each `open_tag` (`<tool_call>`; DeepSeek: `<｜tool▁call▁begin｜>`) opens
  a block when tool calls are parsed; the family's `drop_tags` (DeepSeek's section markers) are
  removed from content then. The block
  body is read by a scanner the family's `choose` picks from its first non-whitespace character
  (`qwen_scanner`: `{` the JSON form (`JsonCallScanner`), `<` the XML form (`XmlCallScanner`),
  anything else rejects the block at once; both Qwen families accept both forms. GLM's
  `adapters.parsers.glm.GlmCallScanner` reads every body).
- When the scanner commits to a function name the call is announced (`ToolCallStart`); from
  then on the arguments text the scanner settles is passed on as `ToolCallArgsDelta`s, and a
  valid block ends with a `ToolCallEnd` whose arguments are their concatenation. A
  rejected block's text (from `<tool_call>` up to the point of rejection) is content, and the
  text after that point is read again as content (so a later `<tool_call>` there opens a new
  block). A block still open at `finish` is content verbatim. A rejected or unterminated block
  that was already announced is abandoned: no `ToolCallEnd`, its index is not reused.
- Content is cut into segments by the start of content (start of generation or the end of
  `</think>`), by each completed call, and by the end of generation; each segment is emitted
  with its leading and trailing whitespace removed (`TrimmedSegment`), so whitespace around and
  between calls disappears while whitespace inside text, and around a rejected or abandoned
  block, stays (such a block is ordinary content text). Nothing reaches content while a block is
  open, so the whitespace held before it is dropped or kept only once the block is settled.
- Held back at any time: at most a proper prefix of the next possible tag (the open tag or a dropped
  one), trailing whitespace
  of a segment, and the body of the open `<tool_call>` block.
"""

from __future__ import annotations

from collections.abc import Callable

from adapters.parsers.base import (
    CallScanner,
    ScanResult,
    TrimmedSegment,
    partial_tag_suffix,
    skip_space,
)
from adapters.parsers.events import (
    ContentDelta,
    ReasoningDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from adapters.parsers.incremental import IncrementalParser
from adapters.parsers.qwen3 import JsonCallScanner
from adapters.parsers.qwen3_5 import XmlCallScanner
from adapters.parsers.reasoning import ThinkSplitter
from adapters.parsers.tagged_args import ParamTypes

TOOL_CALL_OPEN = "<tool_call>"
ChooseScanner = Callable[[ParamTypes, str], CallScanner | None]  # (types, first character) -> scanner or reject


def qwen_scanner(types: ParamTypes, first: str) -> CallScanner | None:
    if first == "{":
        return JsonCallScanner()
    if first == "<":
        return XmlCallScanner(types)
    return None


class QwenOutputParser(IncrementalParser):
    """One request's incremental parser for Qwen3 / Qwen3.5 / GLM output."""

    def __init__(
        self,
        *,
        types: ParamTypes,
        starts_in_reasoning: bool,
        parse_reasoning: bool,
        parse_tool_calls: bool,
        id_prefix: str,
        choose: ChooseScanner = qwen_scanner,
        open_tag: str = TOOL_CALL_OPEN,
        drop_tags: tuple[str, ...] = (),
    ) -> None:
        super().__init__(id_prefix=id_prefix)
        self._choose = choose
        self._open = open_tag
        self._drop = drop_tags
        self._think = ThinkSplitter(starts_inside=starts_in_reasoning) if parse_reasoning else None
        self._types = types
        self._parse_calls = parse_tool_calls
        self._content = TrimmedSegment()
        self._buf = ""  # content-stage text not yet settled
        self._body: str | None = None  # the open block's body (text after <tool_call>)
        self._scanner: CallScanner | None = None
        self._started: ToolCallStart | None = None  # the open block's announced call
        self._arguments: list[str] = []  # its arguments text so far
        self._next_index = 0

    def _push(self, text: str) -> None:
        if self._think is not None and not self._think.done:
            reasoning, rest = self._think.push(text)
            self._reasoning(reasoning)
            if rest is None:
                return
            text = rest
        self._buf += text
        self._run(final=False)

    def _end(self) -> None:
        if self._think is not None and not self._think.done:
            reasoning, rest = self._think.finish()
            self._reasoning(reasoning)
            self._buf += rest
        self._run(final=True)
        self._content.end()

    # -- content and tool-call blocks ---------------------------------------------------------

    def _run(self, *, final: bool) -> None:
        while True:
            if self._body is None:
                if not self._parse_calls:
                    self._emit_content(self._buf)
                    self._buf = ""
                    return
                at = self._next_open()
                if at < 0:
                    keep = 0 if final else max(partial_tag_suffix(self._buf, t) for t in (self._open, *self._drop))
                    self._emit_content(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    return
                self._emit_content(self._buf[:at])
                self._body = self._buf[at + len(self._open) :]
                self._buf = ""
                self._scanner = None
                self._started = None
            elif self._buf:
                body, self._body = self._body, None
                body += self._buf  # in place while `body` holds the only reference: linear growth
                self._body = body
                self._buf = ""
            result = self._scan(self._body)
            if result.status == "more":
                if not final:
                    return
                self._close_block(self._body, "")
            elif result.status == "reject":
                self._close_block(self._body[: result.end], self._body[result.end :])
            else:
                self._complete(result)

    def _next_open(self) -> int:
        """Where the next open tag starts in the buffer (-1: none), dropping the dropped tags before
        it (content up to each is emitted). Left to right: the tags start with their only `<`, so
        occurrences never overlap and text joined around a dropped tag is not read again."""
        while True:
            hits = [(i, t) for i, t in ((self._buf.find(t), t) for t in (self._open, *self._drop)) if i >= 0]
            if not hits:
                return -1
            at, tag = min(hits)
            if tag == self._open:
                return at
            self._emit_content(self._buf[:at])
            self._buf = self._buf[at + len(tag):]

    def _scan(self, body: str) -> ScanResult:
        if self._scanner is None:
            lead = skip_space(body, 0)
            if lead == len(body):
                return ScanResult("more")
            self._scanner = self._choose(self._types, body[lead])
            if self._scanner is None:
                return ScanResult("reject", lead)
        result = self._scanner.scan(body)
        name = self._scanner.name
        if self._started is None and name is not None:
            self._announce(name)
        if result.delta and self._started is not None:
            self._arguments.append(result.delta)
            self._events.append(ToolCallArgsDelta(self._started.index, result.delta))
        return result

    def _announce(self, name: str) -> None:
        self._started = ToolCallStart(self._next_index, self._call_id(), name)
        self._arguments = []
        self._next_index += 1
        self._events.append(self._started)

    def _complete(self, result: ScanResult) -> None:
        assert self._body is not None and self._started is not None
        start = self._started
        end = ToolCallEnd(start.index, start.id, start.name, "".join(self._arguments))
        self._events.append(end)
        self._calls.append(end)
        self._content.end()
        self._buf = self._body[result.end :]
        self._body = None
        self._scanner = None
        self._started = None

    def _close_block(self, text: str, rest: str) -> None:
        """The open block is not a call: its text is content, `rest` is read again."""
        self._emit_content(self._open + text)
        self._buf = rest
        self._body = None
        self._scanner = None
        self._started = None

    # -- emission -------------------------------------------------------------------------------

    def _reasoning(self, text: str) -> None:
        if text:
            self._events.append(ReasoningDelta(text))

    def _emit_content(self, text: str) -> None:
        out = self._content.push(text)
        if out:
            self._events.append(ContentDelta(out))
