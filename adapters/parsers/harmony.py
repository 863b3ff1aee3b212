"""gpt-oss output in the harmony format: messages on the analysis, commentary and final channels.

Contract (`HarmonyOutputParser`; the text is decoded with the format's special tokens kept):
- Generation starts inside a message header (the prompt ends with `<|start|>assistant`). A header
  runs up to `<|message|>`; its channel is the word after `<|channel|>`, its recipient the word
  after ` to=` (before or after the channel). The body runs up to `<|end|>`, `<|call|>` or
  `<|return|>` (or the end of generation); after it the next message starts at `<|start|>`.
- A message without a recipient streams as it arrives: the analysis channel as reasoning, any
  other channel (final, a commentary preamble) as content. Successive messages of one kind are
  joined by a blank line. With `parse_reasoning` off, analysis is content too.
- A message with a recipient is a tool call (`functions.NAME` names NAME; another recipient is
  named as it is) when tool calls are parsed and its body is a JSON object: at its end come
  `ToolCallStart`, one `ToolCallArgsDelta` (compact JSON) and `ToolCallEnd`. Otherwise its body is
  content, verbatim.
- Text that is not the format: a header with no `<|message|>` within `HEADER_LIMIT` characters
  (or none by the end) is content verbatim (with the rest of the text up to the next `<|start|>`);
  non-whitespace text between a message's end and the next `<|start|>` is content.
- `messages` lists the completed messages as `HarmonyMessage`s (channel, recipient, body).
- Never raises on any text; the events of any split of a text, merged, equal the whole text's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from adapters.parsers.base import compact_json, loads_json, partial_tag_suffix
from adapters.parsers.events import (
    ContentDelta,
    ReasoningDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from adapters.parsers.incremental import IncrementalParser

START, MESSAGE, CHANNEL = "<|start|>", "<|message|>", "<|channel|>"
END_TAGS = ("<|end|>", "<|call|>", "<|return|>")
HEADER_LIMIT = 512

_RECIPIENT = re.compile(r"(?:^|\s)to=([^\s<]+)")
_WORD = re.compile(r"[^\s<]*")


@dataclass(frozen=True)
class HarmonyMessage:
    """One completed message of the output."""

    channel: str | None
    recipient: str | None
    body: str


def parse_header(header: str) -> tuple[str | None, str | None]:
    """(channel, recipient) of a header's text (the text between `<|start|>` and `<|message|>`)."""
    channel = None
    at = header.find(CHANNEL)
    if at >= 0:
        channel = _WORD.match(header, at + len(CHANNEL)).group() or None  # type: ignore[union-attr]
    found = _RECIPIENT.search(header.replace(CHANNEL, " "))
    return channel, found.group(1) if found else None


class HarmonyOutputParser(IncrementalParser):
    """One request's incremental parser for harmony output."""

    def __init__(self, *, parse_reasoning: bool, parse_tool_calls: bool, id_prefix: str) -> None:
        super().__init__(id_prefix=id_prefix)
        self._parse_reasoning = parse_reasoning
        self._parse_calls = parse_tool_calls
        self._state = "header"  # header | body | raw | between
        self._buf = ""
        self._channel: str | None = None
        self._recipient: str | None = None
        self._body: list[str] = []
        self._raw_started = False
        self._kind: str | None = None  # "reasoning" | "content" while streaming a message
        self._seen: set[str] = set()  # kinds already emitted (for the blank line between messages)
        self._messages: list[HarmonyMessage] = []

    @property
    def messages(self) -> list[HarmonyMessage]:
        return list(self._messages)

    def _push(self, text: str) -> None:
        self._buf += text
        self._run(final=False)

    def _end(self) -> None:
        self._run(final=True)

    def _run(self, *, final: bool) -> None:
        while True:
            if self._state == "header":
                at = self._buf.find(MESSAGE)
                if 0 <= at <= HEADER_LIMIT:
                    self._open(self._buf[:at])
                    self._buf = self._buf[at + len(MESSAGE) :]
                elif final or len(self._buf) >= HEADER_LIMIT + len(MESSAGE):
                    self._state, self._raw_started = "raw", False
                else:
                    return
            elif self._state == "body":
                ends = [(self._buf.find(tag), tag) for tag in END_TAGS if tag in self._buf]
                if ends:
                    at, tag = min(ends)
                    self._body_text(self._buf[:at])
                    self._buf = self._buf[at + len(tag) :]
                    self._close()
                    continue
                keep = 0 if final else max(partial_tag_suffix(self._buf, tag) for tag in END_TAGS)
                self._body_text(self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep :]
                if final:
                    self._close()
                return
            elif self._state == "raw":  # not the format: content, verbatim, up to the next <|start|>
                at = self._buf.find(START)
                keep = 0 if final or at >= 0 else partial_tag_suffix(self._buf, START)
                text = self._buf[: at if at >= 0 else len(self._buf) - keep]
                if text:
                    self._emit("content", text, first=not self._raw_started)
                    self._raw_started = True
                if at < 0:
                    self._buf = self._buf[len(self._buf) - keep :]
                    return
                self._buf = self._buf[at + len(START) :]
                self._state = "header"
            else:  # between messages: only whitespace is expected before the next <|start|>
                at = self._buf.find(START)
                if at < 0 and not final:
                    return
                gap = self._buf if at < 0 else self._buf[:at]
                if gap.strip():
                    self._emit("content", gap, first=True)
                if at < 0:
                    self._buf = ""
                    return
                self._buf = self._buf[at + len(START) :]
                self._state = "header"

    def _open(self, header: str) -> None:
        self._channel, self._recipient = parse_header(header)
        self._body = []
        self._state = "body"
        if self._recipient is None:
            reasoning = self._channel == "analysis" and self._parse_reasoning
            self._kind = "reasoning" if reasoning else "content"
        else:
            self._kind = None

    def _body_text(self, text: str) -> None:
        if not text:
            return
        self._body.append(text)
        if self._kind is not None:
            self._emit(self._kind, text, first=len(self._body) == 1)

    def _close(self) -> None:
        body = "".join(self._body)
        self._messages.append(HarmonyMessage(self._channel, self._recipient, body))
        if self._recipient is not None and body:
            self._tool_call(self._recipient, body)
        self._state, self._kind, self._body = "between", None, []

    def _tool_call(self, recipient: str, body: str) -> None:
        arguments = None
        if self._parse_calls:
            try:
                value = loads_json(body)
                arguments = compact_json(value) if isinstance(value, dict) else None
            except (ValueError, TypeError, RecursionError):
                arguments = None
        if arguments is None:
            self._emit("content", body, first=True)
            return
        name = recipient.removeprefix("functions.") or recipient
        index = len(self._calls)
        start = ToolCallStart(index, self._call_id(), name)
        end = ToolCallEnd(index, start.id, name, arguments)
        self._events += [start, ToolCallArgsDelta(index, arguments), end]
        self._calls.append(end)

    def _emit(self, kind: str, text: str, *, first: bool) -> None:
        if first and kind in self._seen:
            text = "\n\n" + text
        self._seen.add(kind)
        self._events.append(ReasoningDelta(text) if kind == "reasoning" else ContentDelta(text))
