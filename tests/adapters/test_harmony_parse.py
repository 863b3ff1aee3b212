"""The harmony output parser reads completions as openai-harmony does, maps channels to reasoning,
content and tool calls, never raises, and streams exactly what it parses whole."""

from __future__ import annotations

import json
from typing import Any

import openai_harmony as oh
import pytest
from harmony_reference import harmony_encoding
from hypothesis import given, settings
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
from adapters.parsers.harmony import HarmonyOutputParser

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def assistant(text: str, channel: str, recipient: str | None = None) -> oh.Message:
    msg = oh.Message.from_role_and_content(oh.Role.ASSISTANT, text).with_channel(channel)
    if recipient:
        msg = msg.with_recipient(recipient).with_content_type("<|constrain|>json")
    return msg


# Completions as the model writes them (the prompt ended with <|start|>assistant).
COMPLETIONS: list[list[oh.Message]] = [
    [assistant("Simple.", "analysis"), assistant("Hello there!", "final")],
    [assistant("Need weather.\nTwo lines.", "analysis"),
     assistant('{"location": "Paris, FR", "unit": "celsius"}', "commentary", "functions.get_weather")],
    [assistant("Let me look.", "commentary"), assistant('{"location":"Oslo"}', "commentary", "functions.get_weather")],
    [assistant("a", "analysis"), assistant("b", "analysis"), assistant("ünïcödé ✓ {not json", "final")],
    [assistant('{"q": [1, 2, {"x": null}]}', "analysis", "browser.search")],
    [assistant("", "final")],
]


def completion_tokens(messages: list[oh.Message]) -> list[int]:
    enc = harmony_encoding()
    tokens: list[int] = []
    for msg in messages:
        tokens += enc.render(msg)
    head = enc.encode("<|start|>assistant", allowed_special="all")
    assert tokens[: len(head)] == head
    tokens = tokens[len(head):]
    if messages[-1].channel == "final":  # the model ends its turn with <|return|>
        tokens[-1] = enc.encode("<|return|>", allowed_special="all")[0]
    return tokens


def run(text: str, pieces: list[int] | None = None, tools: Any = TOOLS, **kwargs: Any) -> tuple[list[Any], Any]:
    parser = create_parser("harmony", tools, **kwargs)
    events: list[Any] = []
    cuts = sorted(set(pieces or []))
    last = 0
    for cut in [*cuts, len(text)]:
        events += parser.feed(text[last:cut])
        last = cut
    events += parser.finish()
    return merge_events(events), parser


@pytest.mark.parametrize("messages", COMPLETIONS)
def test_messages_equal_openai_harmony_parse(messages: list[oh.Message]) -> None:
    enc = harmony_encoding()
    tokens = completion_tokens(messages)
    want = [(m.channel, m.recipient, m.content[0].text if m.content else "")
            for m in enc.parse_messages_from_completion_tokens(tokens, oh.Role.ASSISTANT)]
    parser = HarmonyOutputParser(parse_reasoning=True, parse_tool_calls=True, id_prefix="call_")
    parser.feed(enc.decode(tokens))
    parser.finish()
    assert [(m.channel, m.recipient, m.body) for m in parser.messages] == want


def test_channels_map_to_events() -> None:
    text = harmony_encoding().decode(completion_tokens(COMPLETIONS[1]))
    events, parser = run(text)
    call_id = parser.tool_calls[0].id
    args = '{"location":"Paris, FR","unit":"celsius"}'
    assert events == [ReasoningDelta("Need weather.\nTwo lines."), ToolCallStart(0, call_id, "get_weather"),
                      ToolCallArgsDelta(0, args), ToolCallEnd(0, call_id, "get_weather", args)]
    events, _ = run(harmony_encoding().decode(completion_tokens(COMPLETIONS[3])))
    assert events == [ReasoningDelta("a\n\nb"), ContentDelta("ünïcödé ✓ {not json")]


def test_preamble_is_content_and_other_recipients_keep_their_name() -> None:
    events, parser = run(harmony_encoding().decode(completion_tokens(COMPLETIONS[2])))
    assert events[0] == ContentDelta("Let me look.")
    assert [(c.name, json.loads(c.arguments)) for c in parser.tool_calls] == [("get_weather", {"location": "Oslo"})]
    _, parser = run(harmony_encoding().decode(completion_tokens(COMPLETIONS[4])))
    assert [(c.name, c.arguments) for c in parser.tool_calls] == [("browser.search", '{"q":[1,2,{"x":null}]}')]


def test_calls_off_bad_json_and_no_format_are_content() -> None:
    text = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"a": 1}<|call|>'
    assert run(text, tools=None)[0] == [ContentDelta('{"a": 1}')]
    bad = '<|channel|>commentary to=functions.f<|message|>{"a": <|call|>'
    assert run(bad)[0] == [ContentDelta('{"a": ')]
    assert run("just some text, no format")[0] == [ContentDelta("just some text, no format")]
    assert run("<|channel|>analysis<|message|>think", parse_reasoning=False)[0] == [ContentDelta("think")]
    unterminated = '<|channel|>commentary to=functions.get_weather json<|message|>{"location":"x"}'
    assert [c.name for c in run(unterminated)[1].tool_calls] == ["get_weather"]


FRAGMENTS = ["<|start|>", "assistant", "<|channel|>", "analysis", "final", "commentary", " to=functions.f",
             " <|constrain|>json", "<|message|>", "<|end|>", "<|call|>", "<|return|>", "{", "}", '"a":', "1",
             " ", "\n", "text", "<|", "|>", "ü"]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from(FRAGMENTS) | st.text(max_size=4), max_size=30), st.lists(st.integers(0, 200)),
       st.booleans())
def test_fuzz_never_raises_and_streaming_equals_whole(parts: list[str], cuts: list[int], calls: bool) -> None:
    text = "".join(parts)
    tools = TOOLS if calls else None
    whole, p1 = run(text, tools=tools)
    split, p2 = run(text, [c for c in cuts if c < len(text)], tools=tools)

    def strip(evs: list[Any]) -> list[Any]:
        return [(type(e).__name__, getattr(e, "text", None), getattr(e, "name", None),
                 getattr(e, "arguments", None)) for e in evs]

    assert strip(whole) == strip(split)
    assert p1.messages == p2.messages
