"""Events that an output parser emits while it splits generated text.

Contract: every event is an immutable value. A run of one parser yields, in order, text deltas
(`ReasoningDelta`, `ContentDelta`) and, per tool call, one `ToolCallStart`, then zero or more
`ToolCallArgsDelta`, then one `ToolCallEnd`; concatenating a call's `ToolCallArgsDelta.text`
equals its `ToolCallEnd.arguments` (a compact JSON object). A call whose block turned out to be
malformed after its `ToolCallStart` was emitted gets no `ToolCallEnd`: its original text comes back
as `ContentDelta` and its index is never reused. Deltas are never empty. `merge_events` joins
adjacent deltas of one kind (and, for arguments, one call), so two runs that split the same text
differently compare equal after merging.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TypeAlias


@dataclass(frozen=True)
class ReasoningDelta:
    """A piece of the model's reasoning (the text of its `<think>` block)."""

    text: str


@dataclass(frozen=True)
class ContentDelta:
    """A piece of the answer text shown to the user."""

    text: str


@dataclass(frozen=True)
class ToolCallStart:
    """A tool call began; its function name is known. `index` counts calls from 0 in one run."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArgsDelta:
    """A chunk of the call's arguments JSON text."""

    index: int
    text: str


@dataclass(frozen=True)
class ToolCallEnd:
    """A tool call is complete; `arguments` is its whole arguments object as compact JSON."""

    index: int
    id: str
    name: str
    arguments: str


ParseEvent: TypeAlias = ReasoningDelta | ContentDelta | ToolCallStart | ToolCallArgsDelta | ToolCallEnd


def merge_events(events: Iterable[ParseEvent]) -> list[ParseEvent]:
    """Join adjacent `ReasoningDelta`s, adjacent `ContentDelta`s and adjacent argument deltas of
    one call into single events; every other event is kept as it is, in order."""
    merged: list[ParseEvent] = []
    for event in events:
        last = merged[-1] if merged else None
        if isinstance(event, ReasoningDelta) and isinstance(last, ReasoningDelta):
            merged[-1] = ReasoningDelta(last.text + event.text)
        elif isinstance(event, ContentDelta) and isinstance(last, ContentDelta):
            merged[-1] = ContentDelta(last.text + event.text)
        elif (
            isinstance(event, ToolCallArgsDelta)
            and isinstance(last, ToolCallArgsDelta)
            and last.index == event.index
        ):
            merged[-1] = ToolCallArgsDelta(event.index, last.text + event.text)
        else:
            merged.append(event)
    return merged
