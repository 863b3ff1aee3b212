"""The output parsers split Qwen3 / Qwen3.5 generations into reasoning, content and tool calls.

Proves: for both families, reasoning (opened by `<think>` or by `starts_in_reasoning`), content
and tool calls (JSON form, XML form typed by the tools' schemas) come out as documented in
`adapters.parsers`, including the whitespace rules; malformed or unterminated blocks come back as
content with their original text (abandoning an announced call); `<tool_call>` inside reasoning,
or without tools, is text; `ToolCallStart` comes as soon as the name is known and only a minimal
tag prefix is held back. Property tests: no text and no split makes `feed`/`finish` raise or break
the event invariants; any split gives the same merged events as the whole text; generated
well-formed outputs round-trip exactly.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adapters.parsers import (
    ContentDelta,
    OutputParser,
    ParseEvent,
    ReasoningDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    merge_events,
)
from adapters.parsers import (
    create_parser as _create_parser,
)


def create_parser(*args: Any, **kw: Any) -> OutputParser:
    """The raw parser: these tests check when it announces calls (adapters wrap it in SettledParser)."""
    kw.setdefault("settle_tool_calls", False)
    return _create_parser(*args, **kw)

FAMILIES = ("qwen3", "qwen3_5")

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string"},
                    "offset": {"type": "integer"},
                    "limit": {"type": ["integer", "null"]},
                    "recursive": {"type": "boolean"},
                    "globs": {"type": "array", "items": {"type": "string"}},
                    "options": {"type": "object"},
                    "ratio": {"anyOf": [{"type": "number"}, {"type": "null"}]},
                    "mode": {"enum": ["r", "w"]},
                    "level": {"enum": [1, 2, 3]},
                },
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
            },
        },
    },
]


# -- helpers --------------------------------------------------------------------------------------


def run(parser: OutputParser, pieces: Iterable[str]) -> list[ParseEvent]:
    events: list[ParseEvent] = []
    for piece in pieces:
        events += parser.feed(piece)
    events += parser.finish()
    return events


def parse(
    text: str | Sequence[str], family: str = "qwen3", tools: list[dict[str, Any]] | None = TOOLS, **kw: Any
) -> list[ParseEvent]:
    pieces = [text] if isinstance(text, str) else text
    return run(create_parser(family, tools, **kw), pieces)


@dataclass
class Parsed:
    reasoning: str
    content: str
    calls: list[tuple[str, dict[str, Any]]]
    arguments: list[str]


def summarize(events: list[ParseEvent]) -> Parsed:
    """Checks the event invariants and returns the run's reasoning, content and calls."""
    starts: dict[int, ToolCallStart] = {}
    args: dict[int, str] = {}
    calls: list[tuple[str, dict[str, Any]]] = []
    arguments: list[str] = []
    ended: set[int] = set()
    last_index = -1
    for event in events:
        if isinstance(event, ReasoningDelta | ContentDelta):
            assert event.text, "empty delta"
        elif isinstance(event, ToolCallStart):
            assert event.index == last_index + 1, "indexes count up from 0 and are never reused"
            last_index = event.index
            assert re.fullmatch(r"call_[0-9a-f]{24}", event.id) or not event.id.startswith("call_")
            starts[event.index] = event
            args[event.index] = ""
        elif isinstance(event, ToolCallArgsDelta):
            assert event.index in starts and event.index not in ended
            args[event.index] += event.text
        else:
            start = starts[event.index]
            assert event.index not in ended
            assert (event.id, event.name) == (start.id, start.name)
            assert args[event.index] == event.arguments
            value = json.loads(event.arguments)
            assert isinstance(value, dict)
            if not has_duplicate_keys(event.arguments):
                assert event.arguments == json.dumps(value, ensure_ascii=False, separators=(",", ":"))
            ended.add(event.index)
            calls.append((event.name, value))
            arguments.append(event.arguments)
    ids = [s.id for s in starts.values()]
    assert len(set(ids)) == len(ids)
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    return Parsed(reasoning, content, calls, arguments)


def has_duplicate_keys(text: str) -> bool:
    found = False

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        nonlocal found
        found = found or len({k for k, _ in items}) < len(items)
        return dict(items)

    json.loads(text, object_pairs_hook=pairs)
    return found


def normalized(events: list[ParseEvent]) -> list[ParseEvent]:
    """Merged events with the random call ids replaced by their index."""
    out: list[ParseEvent] = []
    for event in merge_events(events):
        if isinstance(event, ToolCallStart | ToolCallEnd):
            event = replace(event, id=str(event.index))
        out.append(event)
    return out


def split_at(text: str, cuts: Iterable[int]) -> list[str]:
    points = sorted({min(max(c, 0), len(text)) for c in cuts})
    pieces, last = [], 0
    for point in points:
        pieces.append(text[last:point])
        last = point
    pieces.append(text[last:])
    return pieces


def json_call(name: str, arguments: Any) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def xml_call(name: str, params: dict[str, str]) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


# -- unit tests: Qwen3 ----------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_reasoning_only(family: str) -> None:
    got = summarize(parse("<think>\nLet me think.\n\nStep two.\n</think>\n\n", family))
    assert (got.reasoning, got.content, got.calls) == ("Let me think.\n\nStep two.", "", [])


@pytest.mark.parametrize("family", FAMILIES)
def test_reasoning_then_content(family: str) -> None:
    events = parse("<think>\nHmm.\n</think>\n\nThe answer is 4.\n", family)
    assert merge_events(events) == [ReasoningDelta("Hmm."), ContentDelta("The answer is 4.")]


def test_unclosed_reasoning_is_all_reasoning() -> None:
    got = summarize(parse("<think>\nstill thinking <tool_call>\n"))
    assert (got.reasoning, got.content) == ("still thinking <tool_call>", "")


def test_content_only_no_think() -> None:
    assert merge_events(parse("\n\nJust an answer.  ")) == [ContentDelta("Just an answer.")]


def test_qwen3_content_and_one_call() -> None:
    text = 'I will read it.\n<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>'
    events = normalized(parse(text))
    assert events == [
        ContentDelta("I will read it."),
        ToolCallStart(0, "0", "read_file"),
        ToolCallArgsDelta(0, '{"path":"a.py"}'),
        ToolCallEnd(0, "0", "read_file", '{"path":"a.py"}'),
    ]


def test_qwen3_parallel_calls_and_ids() -> None:
    text = (
        "<think>\nTwo files.\n</think>\n\n"
        + json_call("read_file", {"path": "a"})
        + "\n"
        + json_call("read_file", {"path": "b", "offset": 3})
    )
    parser = create_parser("qwen3", TOOLS, id_prefix="call_")
    got = summarize(run(parser, [text]))
    assert got.reasoning == "Two files."
    assert got.content == ""
    assert got.calls == [("read_file", {"path": "a"}), ("read_file", {"path": "b", "offset": 3})]
    calls = parser.tool_calls
    assert [c.index for c in calls] == [0, 1]
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", c.id) for c in calls)
    assert calls[0].id != calls[1].id


def test_custom_id_prefix() -> None:
    parser = create_parser("qwen3", TOOLS, id_prefix="toolu_")
    run(parser, [json_call("x", {})])
    assert re.fullmatch(r"toolu_[0-9a-f]{24}", parser.tool_calls[0].id)


def test_qwen3_unknown_function_and_odd_arguments() -> None:
    got = summarize(
        parse(
            '<tool_call>\n{"arguments": {"q": "\u00e9\\u00e9"}, "name": "web_search"}\n</tool_call>\n'
            '<tool_call>\n{"name": "list_dir"}\n</tool_call>\n'
            '<tool_call>\n{"name": "grep", "arguments": "{\\"pattern\\": \\"x\\"}"}\n</tool_call>\n'
            '<tool_call>\n{"name": "cat", "arguments": {"text": "line1\nline2"}}\n</tool_call>'
        )
    )
    assert got.content == ""
    assert got.calls == [
        ("web_search", {"q": "éé"}),
        ("list_dir", {}),
        ("grep", {"pattern": "x"}),
        ("cat", {"text": "line1\nline2"}),  # a raw newline inside a JSON string is tolerated
    ]


def test_qwen3_text_before_and_after_calls() -> None:
    text = "Let me check.\n\n" + json_call("read_file", {"path": "a"}) + "\n\nDone checking.\n"
    events = normalized(parse(text))
    assert [type(e).__name__ for e in events] == [
        "ContentDelta",
        "ToolCallStart",
        "ToolCallArgsDelta",
        "ToolCallEnd",
        "ContentDelta",
    ]
    assert summarize(events).content == "Let me check.Done checking."


@pytest.mark.parametrize(
    "block",
    [
        '<tool_call>\n{"name": "read_file", "arguments": {"path": }\n</tool_call>',  # bad JSON
        '<tool_call>\n{"arguments": {"path": "a"}}\n</tool_call>',  # missing name
        '<tool_call>\n{"name": "", "arguments": {}}\n</tool_call>',  # empty name
        '<tool_call>\n{"name": "f", "arguments": [1, 2]}\n</tool_call>',  # arguments not an object
        '<tool_call>\n["read_file", {}]\n</tool_call>',  # not an object
        "<tool_call>\nread_file(path='a')\n</tool_call>",  # unknown structure
        '<tool_call>\n{"name": "f", "arguments": {}}} trailing\n</tool_call>',  # junk after the object
        '<tool_call>\n{"name": "f", "arguments": {"x": NaN}}\n</tool_call>',  # not re-encodable
    ],
)
def test_qwen3_malformed_call_is_content(block: str) -> None:
    text = "Before. " + block
    for pieces in ([text], list(text)):
        got = summarize(parse(pieces))
        assert got.calls == []
        assert got.content == text


def test_unterminated_call_at_finish_is_content() -> None:
    text = 'Reading.\n<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n'
    parser = create_parser("qwen3", TOOLS)
    events = run(parser, [text])
    got = summarize(events)
    assert got.calls == [] and parser.tool_calls == []
    assert got.content == text.strip()
    # the name was known, so the call was announced, then abandoned (no ToolCallEnd)
    assert [type(e) for e in events].count(ToolCallStart) == 1
    assert not any(isinstance(e, ToolCallEnd) for e in events)


def test_abandoned_call_does_not_reuse_its_index() -> None:
    text = '<tool_call>\n{"name": "a", "arguments": {"x": 1}} oops\n</tool_call>\n' + json_call("b", {})
    events = parse(text)
    starts = [e for e in events if isinstance(e, ToolCallStart)]
    ends = [e for e in events if isinstance(e, ToolCallEnd)]
    assert [(s.index, s.name) for s in starts] == [(0, "a"), (1, "b")]
    assert [(e.index, e.name) for e in ends] == [(1, "b")]
    assert summarize(events).content == '<tool_call>\n{"name": "a", "arguments": {"x": 1}} oops\n</tool_call>'


def test_call_inside_reasoning_is_reasoning() -> None:
    inner = json_call("read_file", {"path": "a"})
    got = summarize(parse("<think>\nMaybe " + inner + "\n</think>\n\nNo call."))
    assert got.reasoning == "Maybe " + inner
    assert (got.content, got.calls) == ("No call.", [])


def test_tool_call_text_is_content_without_tools() -> None:
    text = "Here: " + json_call("read_file", {"path": "a"})
    for kw in ({"tools": None}, {"tools": []}, {"parse_tool_calls": False}):
        got = summarize(parse(text, **kw))
        assert (got.content, got.calls) == (text, [])


@pytest.mark.parametrize("family", FAMILIES)
def test_starts_in_reasoning(family: str) -> None:
    text = "The user wants a.\n</think>\n\nSure." + "\n\n" + json_call("read_file", {"path": "a"})
    got = summarize(parse(text, family, starts_in_reasoning=True))
    assert (got.reasoning, got.content) == ("The user wants a.", "Sure.")
    assert got.calls == [("read_file", {"path": "a"})]
    # without the flag the same text has no reasoning: "</think>" is content text
    got = summarize(parse(text, family))
    assert got.reasoning == "" and got.content.startswith("The user wants a.\n</think>")


@pytest.mark.parametrize("family", FAMILIES)
def test_parse_reasoning_false(family: str) -> None:
    text = "<think>\nhmm\n</think>\n\nAnswer. " + json_call("read_file", {"path": "a"})
    got = summarize(parse(text, family, parse_reasoning=False, starts_in_reasoning=True))
    assert got.reasoning == ""
    assert got.content == "<think>\nhmm\n</think>\n\nAnswer."
    assert got.calls == [("read_file", {"path": "a"})]


def test_think_tag_split_and_leading_whitespace() -> None:
    got = summarize(parse(["\n", " <thi", "nk>", "\nabc\n", "</thi", "nk>\n\n", "Hi"]))
    assert (got.reasoning, got.content) == ("abc", "Hi")
    got = summarize(parse(["<thin", "king aloud"]))
    assert (got.reasoning, got.content) == ("", "<thinking aloud")


def test_minimal_hold_back() -> None:
    parser = create_parser("qwen3", TOOLS)
    assert parser.feed("Hello <tool_") == [ContentDelta("Hello")]  # " " and "<tool_" are held
    assert parser.feed("cat> x") == [ContentDelta(" <tool_cat> x")]
    assert parser.feed("<") == []
    assert parser.feed("b") == [ContentDelta("<b")]
    assert parser.finish() == []
    reasoning = create_parser("qwen3_5", TOOLS, starts_in_reasoning=True)
    assert reasoning.feed("a </") == [ReasoningDelta("a")]
    assert reasoning.feed("x") == [ReasoningDelta(" </x")]


def test_tag_split_across_feeds() -> None:
    pieces = ["Sure.<tool_", 'call>\n{"name": "read', '_file", "argu', 'ments": {}}\n</tool', "_call>"]
    got = summarize(parse(pieces))
    assert (got.content, got.calls) == ("Sure.", [("read_file", {})])


def test_start_is_emitted_as_soon_as_the_name_is_known() -> None:
    parser = create_parser("qwen3", TOOLS)
    assert parser.feed('<tool_call>\n{"name": "read_fi') == []
    events = parser.feed('le", "arguments": {"path": "a')
    assert [type(e) for e in events] == [ToolCallStart]
    assert parser.feed('"}}\n</tool_call') == []
    assert [type(e) for e in parser.feed(">")] == [ToolCallArgsDelta, ToolCallEnd]

    parser = create_parser("qwen3_5", TOOLS)
    assert parser.feed("<tool_call>\n<function=write_fi") == []
    events = parser.feed("le>\n<parameter=content>\nlong")
    assert events and isinstance(events[0], ToolCallStart) and events[0].name == "write_file"
    end = parser.feed("\n</parameter>\n</function>\n</tool_call>")
    assert isinstance(end[-1], ToolCallEnd) and end[-1].arguments == '{"content":"long"}'


def test_lifecycle_errors() -> None:
    parser = create_parser("qwen3", TOOLS)
    assert parser.feed("x <") == [ContentDelta("x")]
    assert parser.finish() == [ContentDelta(" <")]
    assert parser.finish() == []
    with pytest.raises(RuntimeError):
        parser.feed("more")
    with pytest.raises(ValueError, match="unknown parser family"):
        create_parser("llama", TOOLS)


# -- unit tests: Qwen3.5 XML form -------------------------------------------------------------------


def test_qwen3_5_xml_params_typed_by_schema() -> None:
    params = {
        "path": "123",
        "offset": "10",
        "limit": "null",
        "recursive": "true",
        "globs": '["*.py", "*.md"]',
        "options": '{"a": {"b": [1]}}',
        "ratio": "0.5",
        "mode": "r",
        "level": "2",
    }
    text = "thinking\n</think>\n\n" + xml_call("read_file", params)
    got = summarize(parse(text, "qwen3_5", starts_in_reasoning=True))
    assert got.reasoning == "thinking" and got.content == ""
    assert got.calls == [
        (
            "read_file",
            {
                "path": "123",
                "offset": 10,
                "limit": None,
                "recursive": True,
                "globs": ["*.py", "*.md"],
                "options": {"a": {"b": [1]}},
                "ratio": 0.5,
                "mode": "r",
                "level": 2,
            },
        )
    ]


def test_qwen3_5_arguments_stream_as_they_settle() -> None:
    parser = create_parser("qwen3_5", TOOLS)
    head = "<tool_call>\n<function=write_file>\n<parameter=path>\na.py\n</parameter>\n<parameter=content>\n"
    events = parser.feed(head + "line 1\n")
    assert normalized(events) == [
        ToolCallStart(0, "0", "write_file"),
        ToolCallArgsDelta(0, '{"path":"a.py","content":"line 1'),  # the trailing newline is held
    ]
    assert parser.feed('say "hi"\n</para') == [ToolCallArgsDelta(0, '\\nsay \\"hi\\"')]
    assert parser.feed("meter>\n<parameter=mode>\n") == [ToolCallArgsDelta(0, '","mode":"')]
    events = parser.feed("w\n</parameter>\n</function>\n</tool_call>")
    arguments = '{"path":"a.py","content":"line 1\\nsay \\"hi\\"","mode":"w"}'
    assert normalized(events) == [ToolCallArgsDelta(0, 'w"}'), ToolCallEnd(0, "0", "write_file", arguments)]
    # typed values come whole at their </parameter>
    parser = create_parser("qwen3_5", TOOLS)
    events = parser.feed("<tool_call>\n<function=read_file>\n<parameter=offset>\n12")
    assert [type(e) for e in events] == [ToolCallStart]
    assert parser.feed("\n</parameter>") == [ToolCallArgsDelta(0, '{"offset":12')]
    assert parser.feed("</tool_call>")[0] == ToolCallArgsDelta(0, "}")


def test_qwen3_5_repeated_parameter() -> None:
    text = xml_call("f", {"a": "1"}).replace("</function>", "<parameter=a>\n2\n</parameter>\n</function>")
    (call,) = [e for e in parse(text, "qwen3_5") if isinstance(e, ToolCallEnd)]
    assert call.arguments == '{"a":"1","a":"2"}'
    assert json.loads(call.arguments) == {"a": "2"}


def test_qwen3_5_untyped_fallbacks() -> None:
    params = {"offset": "ten", "recursive": "True", "ratio": "NaN", "unknown": "5"}
    got = summarize(parse(xml_call("read_file", params) + xml_call("nope", {"n": "5"}), "qwen3_5"))
    assert got.calls == [
        ("read_file", {"offset": "ten", "recursive": True, "ratio": "NaN", "unknown": "5"}),
        ("nope", {"n": "5"}),
    ]


def test_qwen3_5_multiline_string_param() -> None:
    code = "\ndef f():\n    return '</tool_call>'  # <function=x>\n\n"
    text = xml_call("write_file", {"path": "f.py", "content": code})
    got = summarize(parse(text, "qwen3_5"))
    assert got.calls == [("write_file", {"path": "f.py", "content": code})]
    # exactly one newline is stripped on each side
    raw = "<tool_call>\n<function=w>\n<parameter=a>\n\nx\n\n</parameter>\n<parameter=b>y</parameter>\n"
    raw += "</function>\n</tool_call>"
    assert summarize(parse(raw, "qwen3_5")).calls == [("w", {"a": "\nx\n", "b": "y"})]


def test_qwen3_5_parallel_calls_text_before_and_tolerance() -> None:
    text = (
        "Reading both.\n\n"
        + xml_call("read_file", {"path": "a"})
        + "\n"
        + "<tool_call>\n<function=read_file>\n<parameter=path>\nb\n</parameter>\n</tool_call>"  # no </function>
        + "\n<tool_call>\n<function= list_dir >\n</function>\n</tool_call>"  # no parameters
    )
    got = summarize(parse(text, "qwen3_5"))
    assert got.content == "Reading both."
    assert got.calls == [("read_file", {"path": "a"}), ("read_file", {"path": "b"}), ("list_dir", {})]


@pytest.mark.parametrize(
    "block",
    [
        "<tool_call>\n<fn=read_file>\n</fn>\n</tool_call>",  # unknown structure
        "<tool_call>\n<function=>\n</function>\n</tool_call>",  # missing name
        "<tool_call>\n<function=read\nfile>\n</function>\n</tool_call>",  # newline in the name
        "<tool_call>\n<function=read_file>\npath=a\n</function>\n</tool_call>",  # stray text
        "<tool_call>\n<function=read_file>\n<parameter=>\nx\n</parameter>\n</function>\n</tool_call>",
        "<tool_call>\n<function=read_file>\n</function>\njunk</tool_call>",
    ],
)
def test_qwen3_5_malformed_call_is_content(block: str) -> None:
    text = "Before.\n" + block
    for pieces in ([text], list(text)):
        got = summarize(parse(pieces, "qwen3_5"))
        assert got.calls == []
        assert got.content == text


def test_qwen3_5_unterminated_call_is_content() -> None:
    text = "<tool_call>\n<function=write_file>\n<parameter=content>\nhalf a fi"
    parser = create_parser("qwen3_5", TOOLS)
    events = run(parser, [text])
    assert summarize(events).content == text
    assert parser.tool_calls == []


def test_qwen3_5_call_inside_reasoning_is_reasoning() -> None:
    call = xml_call("read_file", {"path": "a"})
    got = summarize(parse("I could do " + call + "\n</think>\n\nOK.", "qwen3_5", starts_in_reasoning=True))
    assert (got.reasoning, got.content, got.calls) == ("I could do " + call, "OK.", [])


def test_odd_tools_lists_are_tolerated() -> None:
    tools: list[Any] = [
        1,
        {"function": None},
        {"type": "function", "function": {"name": "f", "parameters": {"properties": [1]}}},
        {"type": "function", "function": {"name": "g", "parameters": {"properties": {"n": {"type": 5}}}}},
        {"name": "h", "input_schema": {"type": "object", "properties": {"n": {"type": "integer"}}}},
    ]
    text = xml_call("f", {"n": "1"}) + xml_call("g", {"n": "1"}) + xml_call("h", {"n": "1"})
    got = summarize(parse(text, "qwen3_5", tools))
    assert got.calls == [("f", {"n": "1"}), ("g", {"n": "1"}), ("h", {"n": 1})]


def test_tags_inside_json_strings_are_string_text() -> None:
    arguments = {"text": "</tool_call> <tool_call> } {", "n": [1, {"a": "]"}]}
    got = summarize(parse("Writing." + json_call("write_file", arguments) + " done"))
    assert (got.content, got.calls) == ("Writing.done", [("write_file", arguments)])


def test_both_families_read_both_forms() -> None:
    json_text = json_call("read_file", {"offset": 1})
    xml_text = xml_call("read_file", {"offset": "1"})
    for family in FAMILIES:
        for text in (json_text, xml_text):
            assert summarize(parse(text, family)).calls == [("read_file", {"offset": 1})]


# -- property tests -------------------------------------------------------------------------------

FRAGMENTS = [
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<function=",
    "</function>",
    "<parameter=",
    "</parameter>",
    "<function=read_file>",
    "<parameter=offset>",
    "<parameter=path>",
    "<tool_",
    "</thi",
    "<",
    ">",
    "\n",
    " ",
    "\t",
    "{",
    "}",
    "[",
    "]",
    '"',
    "\\",
    ":",
    ",",
    '"name"',
    '"arguments"',
    '{"name": "read_file", "arguments": ',
    '{"name": "f"}',
    '"a\\"b"',
    "12",
    "true",
    "null",
    "NaN",
]

grammar_texts = st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=6)), max_size=40).map("".join)
configs = st.fixed_dictionaries(
    {
        "family": st.sampled_from(FAMILIES),
        "tools": st.sampled_from([TOOLS, None]),
        "starts_in_reasoning": st.booleans(),
        "parse_reasoning": st.booleans(),
    }
)
PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _no(*tags: str) -> Any:
    return lambda s: not any(t in s for t in tags)


def free_text(*forbidden: str) -> st.SearchStrategy[str]:
    pieces = st.one_of(
        st.text(max_size=8),
        st.sampled_from(["<", "<tool", "<think", "</think", "{", "}", '"', "\n", "  ", "<function=x>"]),
        st.sampled_from(["</tool_call>", "<tool_call>", "</think>", "<think>", "</parameter>"]),
    )
    return st.lists(pieces, max_size=6).map("".join).filter(_no(*forbidden))


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**12), 10**12)
    | st.floats(allow_nan=False, allow_infinity=False)
    | free_text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)
identifiers = st.from_regex(r"[A-Za-z_][A-Za-z0-9_.-]{0,10}", fullmatch=True)


def json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if value is None:
        return "null"
    return {str: "string", list: "array", dict: "object"}[type(value)]


def scrub(value: Any) -> Any:
    """`value` with "</parameter>" removed from every string (it would end an XML value)."""
    if isinstance(value, str):
        while "</parameter>" in value:
            value = value.replace("</parameter>", "")
        return value
    if isinstance(value, list):
        return [scrub(v) for v in value]
    if isinstance(value, dict):
        return {scrub(k): scrub(v) for k, v in value.items()}
    return value


@st.composite
def well_formed(draw: st.DrawFn) -> tuple[str, dict[str, Any], Parsed]:
    family = draw(st.sampled_from(FAMILIES))
    starts_in_reasoning = draw(st.booleans())
    has_reasoning = starts_in_reasoning or draw(st.booleans())
    reasoning = draw(free_text("</think>")) if has_reasoning else ""
    n_calls = draw(st.integers(0, 3))
    contents = [draw(free_text("<tool_call>")) for _ in range(n_calls + 1)]
    if not has_reasoning:
        contents[0] = contents[0].lstrip()
        if contents[0].startswith("<think>"):
            contents[0] = "x" + contents[0]
    tools: list[dict[str, Any]] = []
    blocks: list[str] = []
    calls: list[tuple[str, dict[str, Any]]] = []
    for i in range(n_calls):
        name = f"{draw(identifiers)}_{i}"
        xml = draw(st.booleans()) if family == "qwen3" else draw(st.integers(0, 4)) > 0
        if xml:
            values = scrub(draw(st.dictionaries(identifiers, json_values, max_size=4)))
            properties = {k: {"type": json_type(v)} for k, v in values.items()}
            raw = {
                k: v if isinstance(v, str) else json.dumps(v, ensure_ascii=False) for k, v in values.items()
            }
            blocks.append(xml_call(name, raw))
        else:
            values = draw(st.dictionaries(st.text(max_size=6), json_values, max_size=4))
            properties = {}
            obj = {"name": name, "arguments": values}
            if draw(st.booleans()):
                obj = {"arguments": values, "name": name}
            encoded = json.dumps(
                obj, ensure_ascii=draw(st.booleans()), indent=draw(st.sampled_from([None, 2]))
            )
            blocks.append(f"<tool_call>\n{encoded}\n</tool_call>")
        tools.append(
            {"type": "function", "function": {"name": name, "parameters": {"properties": properties}}}
        )
        calls.append((name, values))
    text = ""
    if has_reasoning:
        text = ("" if starts_in_reasoning else "<think>\n") + reasoning + "\n</think>\n\n"
    text += contents[0]
    for block, content in zip(blocks, contents[1:], strict=True):
        text += "\n\n" + block + "\n" + content
    config = {
        "family": family,
        "tools": tools or TOOLS,
        "starts_in_reasoning": starts_in_reasoning,
    }
    expected = Parsed(
        reasoning.strip(),
        "".join(c.strip() for c in contents),
        calls,
        [json.dumps(v, ensure_ascii=False, separators=(",", ":")) for _, v in calls],
    )
    return text, config, expected


@PROPERTY
@given(case=well_formed(), data=st.data())
def test_well_formed_output_round_trips(
    case: tuple[str, dict[str, Any], Parsed], data: st.DataObject
) -> None:
    text, config, expected = case
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    for pieces in ([text], split_at(text, cuts)):
        got = summarize(parse(pieces, **config))
        assert got == expected


@st.composite
def mutated(draw: st.DrawFn) -> str:
    """A well-formed output with a few random edits: inserted fragments, deleted spans, a cut end."""
    text = draw(well_formed())[0]
    for _ in range(draw(st.integers(0, 3))):
        op = draw(st.sampled_from(["insert", "delete", "truncate"]))
        at = draw(st.integers(0, len(text)))
        if op == "insert":
            text = text[:at] + draw(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=3))) + text[at:]
        elif op == "delete":
            text = text[:at] + text[at + draw(st.integers(1, 12)) :]
        else:
            text = text[:at]
    return text


texts = st.one_of(grammar_texts, well_formed().map(lambda case: case[0]), mutated())


@PROPERTY
@given(text=texts, config=configs, data=st.data())
def test_never_raises_and_keeps_invariants(text: str, config: dict[str, Any], data: st.DataObject) -> None:
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    for pieces in ([text], split_at(text, cuts)):
        parser = create_parser(**config)
        events = run(parser, pieces)
        got = summarize(events)
        assert [(c.name, json.loads(c.arguments)) for c in parser.tool_calls] == got.calls
        if not config["tools"]:
            assert got.calls == []
        if not config["parse_reasoning"]:
            assert got.reasoning == ""
            if not config["tools"]:
                assert got.content == text.strip()


@PROPERTY
@given(text=texts, config=configs, data=st.data())
def test_streaming_equals_whole_text(text: str, config: dict[str, Any], data: st.DataObject) -> None:
    whole = normalized(parse(text, **config))
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    assert normalized(parse(split_at(text, cuts), **config)) == whole
    assert normalized(parse(list(text), **config)) == whole


def test_settled_parser_announces_only_complete_calls() -> None:
    """The default parser holds a call until it completes; a dropped call is never announced."""
    good = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    bad = '<tool_call>\n{"name": "get_weather", "arguments": {"city": '
    for text, calls in ((good, 1), (bad, 0)):
        parser = _create_parser("qwen3", TOOLS)
        events = [e for ch in text for e in parser.feed(ch)] + parser.finish()
        starts = [i for i, e in enumerate(events) if isinstance(e, ToolCallStart)]
        ends = [i for i, e in enumerate(events) if isinstance(e, ToolCallEnd)]
        assert len(starts) == len(ends) == calls
        if calls:
            assert starts[0] < ends[0] and all(not isinstance(e, ToolCallStart) for e in events[ends[0]:])
