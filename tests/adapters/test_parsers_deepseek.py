"""The "deepseek_v3" and "kimi_k2" output parsers: DeepSeek-V3 / V3.1 and Kimi-K2 special-token tool calls.

Proves: calls as DeepSeek-V3's template writes them (`function<｜tool▁sep｜>NAME` and a ```json fence)
and as V3.1's does (`NAME<｜tool▁sep｜>ARGS`) parse to their arguments, several in one section; the
section markers vanish from content; `<think>` reasoning is split off; malformed calls come back as
content. No DeepSeek chat template is available offline, so the renderings are built here from the
templates' tool-call lines. Property test: any split of any text gives the same merged events as
the whole text, and the parser never raises.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adapters.parsers import ContentDelta, ReasoningDelta, ToolCallEnd, create_parser, merge_events

BEGIN, END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def v3(name: str, args: dict[str, Any]) -> str:
    return f"{CALL}function{SEP}{name}\n```json\n{json.dumps(args)}\n```{CALL_END}"


def v31(name: str, args: dict[str, Any]) -> str:
    return f"{CALL}{name}{SEP}{json.dumps(args, ensure_ascii=False)}{CALL_END}"


def parse(pieces: list[str], **kw: Any) -> list[Any]:
    parser = create_parser("deepseek_v3", TOOLS, settle_tool_calls=False, **kw)
    return merge_events([e for p in pieces for e in parser.feed(p)] + parser.finish())


def summary(events: list[Any]) -> tuple[str, str, list[tuple[str, Any]]]:
    return ("".join(e.text for e in events if isinstance(e, ReasoningDelta)),
            "".join(e.text for e in events if isinstance(e, ContentDelta)),
            [(e.name, json.loads(e.arguments)) for e in events if isinstance(e, ToolCallEnd)])


A = {"city": "Tōkyō", "days": 3, "units": None}
B = {"q": "<｜tool▁sep｜> inside a string"}


def test_both_forms_round_trip() -> None:
    for render in (v3, v31):
        text = "<think>plan</think>Checking." + BEGIN + render("get_weather", A) + render("search", B) + END
        want = ("plan", "Checking.", [("get_weather", A), ("search", B)])
        assert summary(parse([text])) == want
        assert summary(parse(list(text))) == want


def test_malformed_calls_are_content() -> None:
    for block in (f"{CALL}get_weather{SEP}not json{CALL_END}", f"{CALL}{SEP}{{}}{CALL_END}",
                  f"{CALL}function{SEP}x\nno fence{CALL_END}", f"{CALL}get_weather{SEP}[1, 2]{CALL_END}",
                  f"{CALL}get_weather{SEP}{{\"a\": 1}}"):
        _, content, calls = summary(parse(["x " + block]))
        assert calls == [] and content.startswith("x " + CALL), block


def test_no_tools_leaves_the_tokens_as_text() -> None:
    parser = create_parser("deepseek_v3", None, settle_tool_calls=False)
    text = BEGIN + v31("get_weather", A) + END
    events = merge_events(parser.feed(text) + parser.finish())
    assert summary(events)[1:] == (text, [])


FRAGMENTS = [BEGIN, END, CALL, CALL_END, SEP, "function", "get_weather", "\n", "```json", "```", '{"a": 1}', "{", "}",
             "<think>", "</think>", "<", "x", " "]


@st.composite
def texts(draw: st.DrawFn) -> str:
    if draw(st.booleans()):
        return "".join(draw(st.lists(st.sampled_from(FRAGMENTS), max_size=24)))
    text = draw(st.sampled_from(["", "ok ", "<think>hm</think>"])) + BEGIN
    for _ in range(draw(st.integers(1, 3))):
        text += draw(st.sampled_from([v3, v31]))(draw(st.sampled_from(["get_weather", "f"])), A)
    text += END
    if draw(st.booleans()):
        at = draw(st.integers(0, len(text)))
        text = text[:at] + draw(st.sampled_from([*FRAGMENTS, ""])) + text[at + draw(st.integers(0, 6)):]
    return text


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=texts(), cuts=st.lists(st.integers(0, 300), max_size=10))
def test_streaming_equals_whole_text(text: str, cuts: list[int]) -> None:
    def norm(events: list[Any]) -> list[Any]:  # call ids are random
        return [(type(e).__name__, getattr(e, "text", None), getattr(e, "name", None), getattr(e, "arguments", None))
                for e in events]

    points = sorted({c for c in cuts if c <= len(text)} | {0, len(text)})
    whole = parse([text])
    assert norm(parse([text[a:b] for a, b in itertools.pairwise(points)])) == norm(whole)
    assert norm(parse(list(text))) == norm(whole)


K_BEGIN, K_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
K_CALL, K_ARGS, K_CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"


def kimi(name: str, args: dict[str, Any], index: int) -> str:
    return f"{K_CALL}functions.{name}:{index}{K_ARGS}{json.dumps(args, ensure_ascii=False)}{K_CALL_END}"


def parse_kimi(pieces: list[str]) -> list[Any]:
    parser = create_parser("kimi_k2", TOOLS, settle_tool_calls=False)
    return merge_events([e for p in pieces for e in parser.feed(p)] + parser.finish())


def test_kimi_calls_round_trip() -> None:
    text = "<think>hm</think>Sure." + K_BEGIN + kimi("get_weather", A, 0) + kimi("search", B, 1) + K_END
    want = ("hm", "Sure.", [("get_weather", A), ("search", B)])
    assert summary(parse_kimi([text])) == want and summary(parse_kimi(list(text))) == want
    bad = K_BEGIN + f"{K_CALL}functions.x:0{K_ARGS}oops{K_CALL_END}" + K_END
    assert summary(parse_kimi([bad]))[2] == []


KIMI_FRAGMENTS = [K_BEGIN, K_END, K_CALL, K_ARGS, K_CALL_END, "functions.f:0", "get_weather", '{"a": 1}', "<", "x", "\n"]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(parts=st.lists(st.sampled_from(KIMI_FRAGMENTS), max_size=20), cuts=st.lists(st.integers(0, 300), max_size=10))
def test_kimi_streaming_equals_whole_text(parts: list[str], cuts: list[int]) -> None:
    text = "".join(parts)
    points = sorted({c for c in cuts if c <= len(text)} | {0, len(text)})

    def norm(events: list[Any]) -> list[Any]:
        return [(type(e).__name__, getattr(e, "text", None), getattr(e, "name", None), getattr(e, "arguments", None))
                for e in events]

    whole = norm(parse_kimi([text]))
    assert norm(parse_kimi([text[a:b] for a, b in itertools.pairwise(points)])) == whole
    assert norm(parse_kimi(list(text))) == whole
