"""Splitting the reasoning block off the front of generated text.

Contract (`ThinkSplitter`): generated text either starts inside reasoning (`starts_inside`: the
prompt already ended with `<think>\\n`), or opens reasoning itself with `<think>` as its first
non-whitespace text, or has no reasoning at all. Reasoning runs up to the first `</think>` (or to
the end of generation when there is none); the text after `</think>` is returned as the rest,
untouched, for the content/tool-call stage. The reasoning text is the raw text between the
opening and `</think>` with its leading and trailing whitespace removed (`str.strip()`), so the
`\\n` after `<think>` and the newlines before `</think>` vanish. Nothing in reasoning is parsed:
`<tool_call>` and a second `<think>` are reasoning text. The splitter holds back only leading
whitespace and a possible `<think>` at the start, a possible partial `</think>` and trailing
whitespace; its output for any split of a text equals its output for the whole text.
"""

from __future__ import annotations

from adapters.parsers.base import TrimmedSegment, partial_tag_suffix

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


class ThinkSplitter:
    """Streams the reasoning at the front of the text; then hands the rest over once."""

    def __init__(self, *, starts_inside: bool) -> None:
        self._inside = starts_inside  # the reasoning block is open
        self._buf = ""  # held text
        self._trim = TrimmedSegment()
        self._done = False

    @property
    def done(self) -> bool:
        """The reasoning stage is over (the rest has been handed over)."""
        return self._done

    def push(self, text: str) -> tuple[str, str | None]:
        """Take the next piece of text. Returns (reasoning now certain, rest): rest is None while
        the text may still be reasoning, else the text that follows the reasoning stage."""
        if self._done:
            return "", text
        self._buf += text
        if not self._inside:
            stripped = self._buf.lstrip()
            if stripped.startswith(THINK_OPEN):
                self._inside = True
                self._buf = stripped[len(THINK_OPEN) :]
            elif THINK_OPEN.startswith(stripped):
                return "", None
            else:
                return "", self._hand_over(self._buf)
        close = self._buf.find(THINK_CLOSE)
        if close >= 0:
            reasoning = self._trim.push(self._buf[:close])
            return reasoning, self._hand_over(self._buf[close + len(THINK_CLOSE) :])
        keep = partial_tag_suffix(self._buf, THINK_CLOSE)
        reasoning = self._trim.push(self._buf[: len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep :]
        return reasoning, None

    def finish(self) -> tuple[str, str]:
        """End of generation: (the last reasoning, the rest). An unclosed block is all reasoning."""
        if self._done:
            return "", ""
        if not self._inside:
            return "", self._hand_over(self._buf)
        reasoning = self._trim.push(self._buf)
        return reasoning, self._hand_over("")

    def _hand_over(self, rest: str) -> str:
        self._done = True
        self._buf = ""
        self._trim.end()
        return rest
