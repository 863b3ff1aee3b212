"""The output-parser interface and the small pieces every family's parser is built from.

Contract:
- `OutputParser` is created per request. `feed(text)` takes the next piece of generated text (any
  split, even inside a tag) and returns the events that piece settles; `finish()` flushes
  everything still held back at the end of generation; `tool_calls` lists the calls completed so
  far. Neither `feed` nor `finish` raises on any text; `feed` after `finish` is a programming
  error (`RuntimeError`), a second `finish` returns `[]`.
- `partial_tag_suffix(text, tag)` is the length of the longest proper prefix of `tag` that `text`
  ends with: the only text a parser may hold back while waiting to see whether a tag follows.
- `TrimmedSegment` streams one segment of text with its leading and trailing whitespace removed
  (whitespace as `str.isspace`, i.e. what `str.strip()` removes): leading whitespace is dropped,
  trailing whitespace is held until non-whitespace follows and dropped when the segment ends.
  The concatenation of what it returns for any split of a text equals `text.strip()`.
- `CallScanner` reads one `<tool_call>` block body incrementally (see `ScanResult`). Its
  decisions depend only on the body text seen so far, never on how it was split, which is what
  makes streaming parses equal whole-text parses.
- `compact_json(value)` is the arguments encoding: `json.dumps(value, ensure_ascii=False,
  separators=(",", ":"))`; `loads_json` is `json.loads` that accepts raw control characters
  inside strings and rejects NaN/Infinity (which would not re-encode as JSON).
"""

from __future__ import annotations

import json
import math
import secrets
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from adapters.parsers.events import ParseEvent, ToolCallEnd


class OutputParser(ABC):
    """Splits one request's generated text into reasoning, content and tool calls, incrementally."""

    @abstractmethod
    def feed(self, text: str) -> list[ParseEvent]:
        """Consume the next piece of generated text; return the events it settles."""

    @abstractmethod
    def finish(self) -> list[ParseEvent]:
        """End of generation: return the events for everything still held back."""

    @property
    @abstractmethod
    def tool_calls(self) -> list[ToolCallEnd]:
        """The tool calls completed so far, in order."""


def partial_tag_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (0 when none).

    `tag` must start with "<" and contain no other "<", so the candidate suffix starts at the
    last "<" within reach."""
    start = text.rfind("<", max(0, len(text) - len(tag) + 1))
    if start < 0:
        return 0
    return len(text) - start if tag.startswith(text[start:]) else 0


def tag_may_start(text: str, pos: int, tag: str) -> bool:
    """`text[pos:]` is a proper prefix of `tag`: the tag may still follow at `pos`."""
    return len(text) - pos < len(tag) and tag.startswith(text[pos:])


def skip_space(text: str, pos: int) -> int:
    """The first index at or after `pos` whose character is not whitespace (`len(text)` if none)."""
    end = len(text)
    while pos < end and text[pos].isspace():
        pos += 1
    return pos


class TrimmedSegment:
    """Streams one segment of text without its leading and trailing whitespace."""

    def __init__(self) -> None:
        self._started = False  # non-whitespace text of this segment has been returned
        self._pending = ""  # whitespace held after the last returned text

    def push(self, text: str) -> str:
        """Take the next piece of the segment; return the text that is now certain."""
        if not self._started:
            text = text.lstrip()
            if not text:
                return ""
        core = text.rstrip()
        if not core:
            self._pending += text
            return ""
        out = self._pending + core
        self._pending = text[len(core) :]
        self._started = True
        return out

    def end(self) -> None:
        """The segment ends: held whitespace is dropped; the next push starts a new segment."""
        self._started = False
        self._pending = ""


def new_call_id(prefix: str, taken: set[str]) -> str:
    """`prefix` + 24 random hex characters, not in `taken` (which it is then added to)."""
    while True:
        call_id = f"{prefix}{secrets.token_hex(12)}"
        if call_id not in taken:
            taken.add(call_id)
            return call_id


def compact_json(value: Any) -> str:
    """The compact JSON encoding used for tool-call arguments."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-finite JSON constant {name}")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"non-finite JSON number {text}")
    return value


def loads_json(text: str) -> Any:
    """`json.loads` for model output; raises ValueError (or RecursionError) when it is not JSON."""
    return json.loads(text, strict=False, parse_constant=_reject_constant, parse_float=_finite_float)


@dataclass(frozen=True)
class ScanResult:
    """What a `CallScanner` settled in its latest `scan`.

    status "more": the body may still become a valid call; wait for more text.
    status "done": the body is a valid call; its first `end` characters (up to and including the
      closing `</tool_call>`) were consumed.
    status "reject": the body is malformed: its first `end` characters go back to the caller as
      content; the rest is read again as ordinary text.
    delta: arguments JSON text settled by this scan (only once the scanner has a name); the deltas
      of all scans of a "done" body concatenate to the call's complete arguments.
    """

    status: Literal["more", "done", "reject"]
    end: int = 0
    delta: str = ""


class CallScanner(Protocol):
    """Reads the body of one `<tool_call>` block (the text after the opening tag)."""

    @property
    def name(self) -> str | None:
        """The function name, once the scanner is committed to it (None before)."""

    def scan(self, body: str) -> ScanResult:
        """Continue over `body`, which only ever grows between calls (a "more" answer at the end
        of generation means the block is unterminated)."""
