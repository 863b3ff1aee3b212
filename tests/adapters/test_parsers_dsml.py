"""The "deepseek_v32" output parser: DeepSeek-V3.2's DSML tool calls.

Proves: calls written as V3.2's template writes them (`string="true"` values verbatim, others as
JSON) parse to their arguments, several in one `function_calls` section, whose markers vanish from
content; the `string` attribute wins over the schema, and without it the schema types the value;
string values stream before the call ends; malformed calls come back as content. Property test: any
split of any text (renders, random edits of them, tag soup) gives the same merged events as the
whole text, and the parser never raises. (Against the template itself: test_checkpoint_templates.)
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
    create_parser,
    merge_events,
)

D = "｜DSML｜"
BEGIN, END = f"<{D}function_calls>", f"</{D}function_calls>"
TOOLS = [{"type": "function", "function": {"name": "edit", "parameters": {"type": "object", "properties": {
    "path": {"type": "string"}, "line": {"type": "integer"}, "force": {"type": "boolean"}}}}}]


def invoke(name: str, args: dict[str, Any], attr: bool = True) -> str:
    out = f'<{D}invoke name="{name}">\n'
    for k, v in args.items():
        text = v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)
        mark = (' string="true"' if isinstance(v, str) else ' string="false"') if attr else ""
        out += f'<{D}parameter name="{k}"{mark}>{text}</{D}parameter>\n'
    return out + f"</{D}invoke>\n"


def parse(pieces: list[str], tools: list[dict[str, Any]] | None = TOOLS) -> list[Any]:
    parser = create_parser("deepseek_v32", tools, settle_tool_calls=False)
    return merge_events([e for p in pieces for e in parser.feed(p)] + parser.finish())


def summary(events: list[Any]) -> tuple[str, str, list[tuple[str, Any]]]:
    return ("".join(e.text for e in events if isinstance(e, ReasoningDelta)),
            "".join(e.text for e in events if isinstance(e, ContentDelta)),
            [(e.name, json.loads(e.arguments)) for e in events if isinstance(e, ToolCallEnd)])


A = {"path": "src/ü.py", "line": 3, "force": False, "text": "a\n</tag> \"q\" <", "meta": {"k": [1, 2.5, None]}}
B = {"n": "42"}  # a string that looks like a number: string="true" keeps it a string


def test_calls_round_trip() -> None:
    text = "<think>plan</think>Editing.\n\n" + BEGIN + "\n" + invoke("edit", A) + invoke("other", B) + END
    want = ("plan", "Editing.", [("edit", A), ("other", B)])
    assert summary(parse([text])) == want
    assert summary(parse(list(text))) == want


def test_attribute_wins_and_schema_types_the_rest() -> None:
    text = BEGIN + f'<{D}invoke name="edit"><{D}parameter name="line" string="true">7</{D}parameter>' \
        f'<{D}parameter name="path" string="false">[1]</{D}parameter><{D}parameter name="force">true' \
        f'</{D}parameter><{D}parameter name="x" string="false">not json</{D}parameter></{D}invoke>' + END
    assert summary(parse([text]))[2] == [("edit", {"line": "7", "path": [1], "force": True, "x": "not json"})]
    assert summary(parse([BEGIN + invoke("edit", {}) + END]))[2] == [("edit", {})]


def test_string_values_stream() -> None:
    parser = create_parser("deepseek_v32", TOOLS, settle_tool_calls=False)
    head = BEGIN + f'<{D}invoke name="edit">\n<{D}parameter name="path" string="true">src/lo'
    deltas = [e.text for e in parser.feed(head) if isinstance(e, ToolCallArgsDelta)]
    assert "".join(deltas) == '{"path":"src/lo'


def test_malformed_calls_are_content() -> None:
    for block in (f'<{D}invoke name="">' + f"</{D}invoke>", f'<{D}invoke name="a<b">' + f"</{D}invoke>",
                  f'<{D}invoke name="e">junk</{D}invoke>', f'<{D}invoke name="e"><{D}parameter name="">1'
                  f"</{D}parameter></{D}invoke>", f'<{D}invoke name="e"><{D}parameter name="k" string="maybe">1'
                  f"</{D}parameter></{D}invoke>"):
        _, content, calls = summary(parse(["x " + block]))
        assert calls == [] and content.startswith("x <"), block
    _, content, calls = summary(parse(['x <' + f'{D}invoke name="e">']))  # unterminated
    assert calls == [] and content == 'x <' + f'{D}invoke name="e">'


def test_no_tools_leaves_the_tags_as_text() -> None:
    text = BEGIN + invoke("edit", A) + END
    assert summary(parse([text], tools=None))[1:] == (text.strip(), [])


FRAGMENTS = [BEGIN, END, f'<{D}invoke name="', f"</{D}invoke>", f'<{D}parameter name="', f"</{D}parameter>",
             '">', '" string="true">', '" string="false">', "edit", "path", "1", '"', "<", ">", "\n", " ", "x",
             "<think>", "</think>"]


@st.composite
def texts(draw: st.DrawFn) -> str:
    if draw(st.booleans()):
        return "".join(draw(st.lists(st.sampled_from(FRAGMENTS), max_size=24)))
    text = draw(st.sampled_from(["", "ok ", "<think>hm</think>"])) + BEGIN + "\n"
    for _ in range(draw(st.integers(1, 3))):
        text += invoke(draw(st.sampled_from(["edit", "f"])), draw(st.sampled_from([A, B, {}])), draw(st.booleans()))
    text += END
    if draw(st.booleans()):
        at = draw(st.integers(0, len(text)))
        text = text[:at] + draw(st.sampled_from([*FRAGMENTS, ""])) + text[at + draw(st.integers(0, 6)):]
    return text


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=texts(), cuts=st.lists(st.integers(0, 400), max_size=10))
def test_streaming_equals_whole_text(text: str, cuts: list[int]) -> None:
    def norm(events: list[Any]) -> list[Any]:  # call ids are random
        return [(type(e).__name__, getattr(e, "text", None), getattr(e, "name", None), getattr(e, "arguments", None))
                for e in events]

    points = sorted({c for c in cuts if c <= len(text)} | {0, len(text)})
    whole = parse([text])
    assert norm(parse([text[a:b] for a, b in itertools.pairwise(points)])) == norm(whole)
    assert norm(parse(list(text))) == norm(whole)
