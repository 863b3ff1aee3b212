"""The "glm4" output parser: GLM-4.5 / 4.6 / 4.7 reasoning and `<arg_key>` / `<arg_value>` tool calls.

Proves: the calls GLM's chat templates write (GLM-4.5: newlines between the elements; GLM-4.7:
none; `tojson` for non-string values, strings verbatim) parse to the arguments the calls were
rendered from, typed by the tools' schemas; reasoning in `<think>` is split off; a call with no
arguments gives `{}`; malformed blocks come back as content with their text; string arguments
stream before the block ends. No transformers chat template of GLM is available offline, so the
renderings are built here from the templates' tool-call lines. Property tests: any split of any
text (well-formed renders, random edits of them, random tag soup) gives the same merged events as
the whole text, and the parser never raises.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adapters.parsers import (
    ContentDelta,
    ReasoningDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    create_parser,
    merge_events,
)

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "edit", "parameters": {"type": "object", "properties": {
        "path": {"type": "string"}, "line": {"type": "integer"}, "force": {"type": "boolean"},
        "lines": {"type": "array"}, "meta": {"type": ["object", "null"]}}}}},
    {"type": "function", "function": {"name": "ls", "parameters": {"type": "object", "properties": {}}}},
]


def render(name: str, args: dict[str, Any], newlines: bool) -> str:
    """One call as GLM's templates write it (GLM-4.5 with newlines, GLM-4.7 without)."""
    sep = "\n" if newlines else ""
    out = f"<tool_call>{name}{sep}"
    for k, v in args.items():
        value = v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)
        out += f"<arg_key>{k}</arg_key>{sep}<arg_value>{value}</arg_value>{sep}"
    return out + "</tool_call>"


def parse(pieces: list[str], tools: list[dict[str, Any]] | None = TOOLS, **kw: Any) -> list[Any]:
    parser = create_parser("glm4", tools, settle_tool_calls=False, **kw)
    events = [e for p in pieces for e in parser.feed(p)] + parser.finish()
    return merge_events(events)


def summary(events: list[Any]) -> tuple[str, str, list[tuple[str, Any]]]:
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    calls = [(e.name, json.loads(e.arguments)) for e in events if isinstance(e, ToolCallEnd)]
    return reasoning, content, calls


ARGS = {"path": "src/a <b>.py", "line": 42, "force": True, "lines": ["x", 1], "meta": None}


def test_rendered_calls_round_trip() -> None:
    for newlines in (True, False):
        text = ("<think>look first</think>\nI will edit it." + render("edit", ARGS, newlines)
                + "\n" + render("ls", {}, newlines) + "\ndone")
        assert summary(parse([text])) == ("look first", "I will edit it.done", [("edit", ARGS), ("ls", {})])
        assert summary(parse(list(text))) == summary(parse([text]))


def test_types_follow_the_schema() -> None:
    text = ("<tool_call>edit<arg_key>path</arg_key><arg_value>123</arg_value><arg_key>line</arg_key>"
            "<arg_value>oops</arg_value><arg_key>other</arg_key><arg_value>[1]</arg_value></tool_call>")
    # a string param stays a string; an integer that does not decode stays raw; unknown keys are strings
    assert summary(parse([text]))[2] == [("edit", {"path": "123", "line": "oops", "other": "[1]"})]


def test_starts_in_reasoning_and_no_tools() -> None:
    text = "thinking</think>" + render("ls", {}, True)
    assert summary(parse([text], starts_in_reasoning=True)) == ("thinking", "", [("ls", {})])
    assert summary(parse([text], tools=None, starts_in_reasoning=True))[1] == render("ls", {}, True)


def test_malformed_blocks_are_content() -> None:
    for block in ("<tool_call>\n<arg_key>x</arg_key></tool_call>",  # no name
                  "<tool_call>ls<arg_value>1</arg_value></tool_call>",  # value without a key
                  "<tool_call>ls<arg_key>a\nb</arg_key><arg_value>1</arg_value></tool_call>",
                  "<tool_call>ls<arg_key>a</arg_key>text<arg_value>1</arg_value></tool_call>",
                  "<tool_call>edit<arg_key>path</arg_key><arg_value>unterminated"):
        _reasoning, content, calls = summary(parse(["x " + block]))
        assert calls == [] and content.startswith("x <tool_call>"), block


def test_string_arguments_stream_before_the_block_ends() -> None:
    parser = create_parser("glm4", TOOLS, settle_tool_calls=False)
    events = parser.feed("<tool_call>edit\n<arg_key>path</arg_key>\n<arg_value>src/ma")
    assert isinstance(events[0], ToolCallStart) and events[0].name == "edit"
    assert [e.text for e in events if isinstance(e, ToolCallArgsDelta)] == ['{"path":"src/ma']
    held = parser.feed("in.py</arg_")  # a possible partial close tag is held back
    assert [e.text for e in held if isinstance(e, ToolCallArgsDelta)] == ["in.py"]


FRAGMENTS = ["<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "<think>",
             "</think>", "edit", "ls", "path", "line", "\n", " ", "7", '"q"', "<", "x"]
soup = st.lists(st.sampled_from(FRAGMENTS), max_size=24).map("".join)


@st.composite
def rendered(draw: st.DrawFn) -> str:
    text = draw(st.sampled_from(["", "<think>hm</think>", "ok "]))
    for _ in range(draw(st.integers(1, 3))):
        args = draw(st.dictionaries(st.sampled_from(list(ARGS)), st.sampled_from([ARGS["path"], 3, False, [1], None]),
                                    max_size=3))
        text += render(draw(st.sampled_from(["edit", "ls"])), args, draw(st.booleans()))
    if draw(st.booleans()):  # a random edit
        at = draw(st.integers(0, len(text)))
        text = text[:at] + draw(st.sampled_from([*FRAGMENTS, ""])) + text[at + draw(st.integers(0, 5)):]
    return text


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.one_of(soup, rendered()), cuts=st.lists(st.integers(0, 200), max_size=10))
def test_streaming_equals_whole_text(text: str, cuts: list[int]) -> None:
    def norm(events: list[Any]) -> list[Any]:  # call ids are random
        return [(type(e).__name__, getattr(e, "text", None), getattr(e, "name", None), getattr(e, "arguments", None))
                for e in events]

    points = sorted({c for c in cuts if c <= len(text)} | {0, len(text)})
    pieces = [text[a:b] for a, b in itertools.pairwise(points)]
    whole = parse([text])
    assert norm(parse(pieces)) == norm(whole)
    for e in whole:
        if isinstance(e, ToolCallEnd):
            json.loads(e.arguments)
