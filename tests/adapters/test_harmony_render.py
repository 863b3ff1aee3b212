"""The harmony chat template renders what openai-harmony renders for the same conversation.

The chat-to-harmony mapping (stated here independently of the template): leading system/developer
messages are the developer instructions, later ones developer messages; an assistant message is
its reasoning on the analysis channel, then with tool calls a commentary preamble (its content)
and one `functions.NAME` commentary call per tool call, else its content on the final channel; a
tool message is `functions.NAME` to the assistant on the commentary channel. openai-harmony
renders the harmony messages (and applies its own analysis-dropping rule)."""

from __future__ import annotations

import json
from typing import Any

import openai_harmony as oh
import pytest
from harmony_reference import harmony_encoding

from freetoken_agent.tokenizer.build import chat_template
from freetoken_agent.tokenizer.chat import ChatTokenizer, compile_template

EFFORTS = {"low": oh.ReasoningEffort.LOW, "medium": oh.ReasoningEffort.MEDIUM, "high": oh.ReasoningEffort.HIGH}


def fn_tool(name: str, description: str, parameters: dict[str, Any] | None) -> dict[str, Any]:
    fn: dict[str, Any] = {"name": name, "description": description}
    if parameters is not None:
        fn["parameters"] = parameters
    return {"type": "function", "function": fn}


def call(cid: str, name: str, args: dict[str, Any]) -> dict[str, Any]:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


WEATHER = fn_tool("get_weather", "Gets the weather.\nIn one city.", {
    "type": "object",
    "properties": {
        "location": {"type": "string", "description": "City and country"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
        "days": {"type": "integer", "description": "How many days", "default": 1},
    },
    "required": ["location"],
})
RICH = fn_tool("edit_file", "Edits a file.", {
    "type": "object",
    "description": "The edit.",
    "properties": {
        "path": {"type": "string", "title": "Path", "examples": ["a.py", "b/c.txt"]},
        "dry": {"type": "boolean", "default": False},
        "ratio": {"type": "number", "default": 0.5, "nullable": True},
        "mode": {"type": ["string", "null"], "default": None},
        "lines": {"type": "array", "items": {"type": "integer"}},
        "anything": {"type": "array"},
        "meta": {"description": "Free-form."},
        "range": {
            "type": "object",
            "description": "Line range.",
            "properties": {"start": {"type": "integer", "description": "first"},
                           "hunks": {"type": "array", "items": {"type": "object",
                                     "properties": {"text": {"type": "string"}}}}},
            "required": ["start"],
        },
        "opts": {"type": "object"},
        "label": {"type": "string", "default": "x y"},
    },
    "required": ["path", "lines"],
})
NOARGS = fn_tool("now", "", None)
EMPTY = fn_tool("ping", "Pings.", {"type": "object", "properties": {}})

CORPUS: list[tuple[str, list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]] = [
    ("plain", [{"role": "user", "content": "Hello!"}], [], {}),
    ("system-high", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], [],
     {"reasoning_effort": "high"}),
    ("thinking-off", [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
     [], {"enable_thinking": False}),
    ("two-instructions", [{"role": "system", "content": "One."}, {"role": "developer", "content": "Two."},
                          {"role": "user", "content": "x"}, {"role": "system", "content": "Late note."},
                          {"role": "user", "content": "y"}], [], {"reasoning_effort": "low"}),
    ("tool-turn", [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "Need the tool.",
         "tool_calls": [call("c1", "get_weather", {"location": "Paris, FR"})]},
        {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 21}'},
    ], [WEATHER, RICH, NOARGS, EMPTY], {}),
    ("multi-turn-echo", [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "reasoning_content": "Call it.",
         "tool_calls": [call("c1", "get_weather", {"location": "Paris"})]},
        {"role": "tool", "tool_call_id": "c1", "content": "21C"},
        {"role": "assistant", "content": "It is 21C.", "reasoning_content": "Answer now."},
        {"role": "user", "content": "And Rome and Oslo? Use celsius."},
        {"role": "assistant", "content": "Checking both.", "reasoning_content": "Two calls.",
         "tool_calls": [call("c2", "get_weather", {"location": "Rome", "unit": "celsius"}),
                        call("c3", "get_weather", {"location": "Oslo"})]},
        {"role": "tool", "tool_call_id": "c2", "content": "25C"},
        {"role": "tool", "name": "get_weather", "content": "9C"},
        {"role": "assistant", "content": "Rome 25C, Oslo 9C.", "reasoning_content": "Done."},
        {"role": "user", "content": "Thanks — ünïcödé ✓"},
    ], [WEATHER], {"reasoning_effort": "medium"}),
    ("last-not-final", [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "", "reasoning_content": "r2", "tool_calls": [call("k", "now", {})]},
        {"role": "tool", "tool_call_id": "k", "content": "noon"},
    ], [NOARGS], {}),
]


def text(content: Any) -> str:
    return content if isinstance(content, str) else "".join(p["text"] for p in content or [])


def expected_conversation(messages: list[dict[str, Any]], tools: list[dict[str, Any]],
                          kwargs: dict[str, Any]) -> oh.Conversation:
    effort = kwargs.get("reasoning_effort") or ("medium" if kwargs.get("enable_thinking", True) else "low")
    out = [oh.Message.from_role_and_content(oh.Role.SYSTEM, oh.SystemContent.new().with_reasoning_effort(EFFORTS[effort]))]
    lead = 0
    while lead < len(messages) and messages[lead]["role"] in ("system", "developer"):
        lead += 1
    if lead or tools:
        dev = oh.DeveloperContent.new()
        if lead:
            dev = dev.with_instructions("\n\n".join(text(m["content"]) for m in messages[:lead]))
        if tools:
            dev = dev.with_function_tools([oh.ToolDescription.new(t["function"]["name"], t["function"]["description"],
                                                                  parameters=t["function"].get("parameters"))
                                           for t in tools])
        out.append(oh.Message.from_role_and_content(oh.Role.DEVELOPER, dev))
    names: dict[str, str] = {}
    for m in messages[lead:]:
        role = m["role"]
        if role in ("system", "developer"):
            out.append(oh.Message.from_role_and_content(oh.Role.DEVELOPER, text(m["content"])))
        elif role == "user":
            out.append(oh.Message.from_role_and_content(oh.Role.USER, text(m["content"])))
        elif role == "assistant":
            if m.get("reasoning_content"):
                out.append(oh.Message.from_role_and_content(oh.Role.ASSISTANT, m["reasoning_content"]).with_channel("analysis"))
            if m.get("tool_calls"):
                if text(m["content"]):
                    out.append(oh.Message.from_role_and_content(oh.Role.ASSISTANT, text(m["content"])).with_channel("commentary"))
                for c in m["tool_calls"]:
                    names[c["id"]] = c["function"]["name"]
                    args = json.dumps(json.loads(c["function"]["arguments"]), separators=(",", ":"), ensure_ascii=False)
                    out.append(oh.Message.from_role_and_content(oh.Role.ASSISTANT, args).with_channel("commentary")
                               .with_recipient("functions." + c["function"]["name"]).with_content_type("<|constrain|>json"))
            elif text(m["content"]):
                out.append(oh.Message.from_role_and_content(oh.Role.ASSISTANT, text(m["content"])).with_channel("final"))
        elif role == "tool":
            name = m.get("name") or names[m["tool_call_id"]]
            out.append(oh.Message.from_author_and_content(oh.Author.new(oh.Role.TOOL, f"functions.{name}"), m["content"])
                       .with_recipient("assistant").with_channel("commentary"))
    return oh.Conversation.from_messages(out)


@pytest.mark.parametrize("case", CORPUS, ids=[c[0] for c in CORPUS])
def test_template_renders_like_openai_harmony(case: tuple[str, Any, Any, Any]) -> None:
    _, messages, tools, kwargs = case
    enc = harmony_encoding()
    want = enc.decode(enc.render_conversation_for_completion(expected_conversation(messages, tools, kwargs),
                                                             oh.Role.ASSISTANT))
    template = compile_template(chat_template("gpt_oss"))
    tok = ChatTokenizer.__new__(ChatTokenizer)  # the template path only: no vocabulary needed
    tok._template, tok.named_tokens = template, {}  # type: ignore[attr-defined]
    got = ChatTokenizer.apply_chat_template(tok, messages, tools=tools or None, **kwargs)
    assert got == want


def test_unknown_tool_result_is_a_template_error() -> None:
    import jinja2

    template = compile_template(chat_template("gpt_oss"))
    with pytest.raises(jinja2.TemplateError, match="tool message"):
        template.render(messages=[{"role": "tool", "tool_call_id": "nope", "content": "x"}], tools=None,
                        add_generation_prompt=True)


def test_effort_from_each_protocol() -> None:
    from freetoken_agent.service import effort_level

    assert [effort_level(e) for e in ("minimal", "low", "medium", "high", "bogus")] == ["low", "low", "medium",
                                                                                        "high", None]
    assert [effort_level(budget_tokens=b) for b in (1024, 8000, 32000, None)] == ["low", "medium", "high", None]
