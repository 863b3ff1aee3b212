"""The request lifecycle every family's streaming parser shares (the Qwen-style stream parser and
harmony's).

Contract: `IncrementalParser` implements `OutputParser.feed` / `finish` / `tool_calls` around two
hooks: `_push(text)` consumes the next piece, `_end()` flushes at the end of generation; both
append to `_events`, which `feed` and `finish` hand out merged (`merge_events`) and clear. `feed`
after `finish` raises `RuntimeError`; a second `finish` returns `[]`. A completed call goes into
`_calls` (the `tool_calls` list); `_call_id()` gives call ids unique within the parser
(`id_prefix` + 24 random hex digits).
"""

from __future__ import annotations

from abc import abstractmethod

from adapters.parsers.base import OutputParser, new_call_id
from adapters.parsers.events import ParseEvent, ToolCallEnd, merge_events


class IncrementalParser(OutputParser):
    def __init__(self, *, id_prefix: str) -> None:
        self._id_prefix = id_prefix
        self._ids: set[str] = set()
        self._calls: list[ToolCallEnd] = []
        self._events: list[ParseEvent] = []
        self._finished = False

    @property
    def tool_calls(self) -> list[ToolCallEnd]:
        return list(self._calls)

    def feed(self, text: str) -> list[ParseEvent]:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        self._push(text)
        return self._take()

    def finish(self) -> list[ParseEvent]:
        if self._finished:
            return []
        self._finished = True
        self._end()
        return self._take()

    @abstractmethod
    def _push(self, text: str) -> None:
        """Consume the next piece of generated text."""

    @abstractmethod
    def _end(self) -> None:
        """End of generation: settle everything still held back."""

    def _call_id(self) -> str:
        return new_call_id(self._id_prefix, self._ids)

    def _take(self) -> list[ParseEvent]:
        events = merge_events(self._events)
        self._events = []
        return events
