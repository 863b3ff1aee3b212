"""A parser wrapper that announces a tool call only once it is certain.

Contract: `SettledParser(inner)` passes reasoning and content through, but holds a call's
`ToolCallStart` and argument deltas until its `ToolCallEnd`; a call the inner parser drops
(malformed or cut off, whose text then comes back as content) is never announced. Streaming
clients therefore never see a tool-use block that later turns out not to exist.
"""

from __future__ import annotations

from adapters.parsers.base import OutputParser
from adapters.parsers.events import ParseEvent, ToolCallArgsDelta, ToolCallEnd, ToolCallStart


class SettledParser(OutputParser):
    def __init__(self, inner: OutputParser) -> None:
        self.inner = inner
        self._held: list[ParseEvent] = []

    def _settle(self, events: list[ParseEvent]) -> list[ParseEvent]:
        out: list[ParseEvent] = []
        for e in events:
            if isinstance(e, ToolCallStart | ToolCallArgsDelta):
                self._held.append(e)
            elif isinstance(e, ToolCallEnd):
                out += [h for h in self._held if getattr(h, "index", None) == e.index]
                self._held = [h for h in self._held if getattr(h, "index", None) != e.index]
                out.append(e)
            else:
                out.append(e)
        return out

    def feed(self, text: str) -> list[ParseEvent]:
        return self._settle(self.inner.feed(text))

    def finish(self) -> list[ParseEvent]:
        out = self._settle(self.inner.finish())
        self._held.clear()  # calls still open at the end were dropped by the inner parser
        return out

    @property
    def tool_calls(self) -> list[ToolCallEnd]:
        return self.inner.tool_calls
