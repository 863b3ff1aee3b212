"""A real server on the gpt-oss demo (`serve --model demo:gpt_oss`): harmony output maps onto each
protocol's reasoning and tool-call fields, whole and streamed, and the clients' echoes render.

The demo's random weights cannot write harmony, so the reply text is forced (the benchmark-only
`freetoken_forced_output` field): the forward passes still run; what is checked is the rendering,
the parser and the three protocol faces with the official SDKs."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from server_fixture import (
    ServerProcess,
    anthropic_client,
    build_demo_models,
    openai_client,
    stop_all,
)

FORCED = "freetoken_forced_output"
MODEL = "freetoken-demo"
CALL = ('<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary '
        'to=functions.get_weather <|constrain|>json<|message|>{"location": "Paris"}<|call|>')
FINAL = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>It is 21C.<|return|>"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                           "parameters": {"type": "object", "properties": {"location": {"type": "string"}},
                                                          "required": ["location"]}}}]


@pytest.fixture(scope="module")
def oss(demo_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    build_demo_models(demo_cache, ("gpt_oss",))
    server = ServerProcess.launch("gpt_oss", ["--model", "demo:gpt_oss", "--device", "cpu"], demo_cache,
                                  tmp_path_factory.mktemp("oss-logs"))
    try:
        server.wait_ready()
        yield server
    finally:
        stop_all([server])


def test_openai_chat_reasoning_and_tool_call(oss: ServerProcess) -> None:
    client = openai_client(oss)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris?"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,  # type: ignore[arg-type]
                                       reasoning_effort="high", extra_body={FORCED: CALL})
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert msg.tool_calls and msg.tool_calls[0].function.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads(msg.tool_calls[0].function.arguments) == {"location": "Paris"}  # type: ignore[union-attr]
    assert getattr(msg, "reasoning_content", None) == "Need the weather."
    stream = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,  # type: ignore[arg-type]
                                            stream=True, extra_body={FORCED: CALL})
    reasoning, names, args = "", [], ""
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        for call in delta.tool_calls or []:
            names += [call.function.name] if call.function and call.function.name else []
            args += call.function.arguments or "" if call.function else ""
    assert (reasoning, names, json.loads(args)) == ("Need the weather.", ["get_weather"], {"location": "Paris"})
    # the client echoes the call (re-serialised arguments, its own id) and the tool's result
    echo = [*messages, {"role": "assistant", "content": None, "reasoning_content": "Need the weather.",
                        "tool_calls": [{"id": "abc", "type": "function", "function": {
                            "name": "get_weather", "arguments": '{"location":"Paris"}'}}]},
            {"role": "tool", "tool_call_id": "abc", "content": "21C"}]
    r2 = client.chat.completions.create(model=MODEL, messages=echo, tools=TOOLS,  # type: ignore[arg-type]
                                        extra_body={FORCED: FINAL})
    assert r2.choices[0].message.content == "It is 21C." and r2.choices[0].finish_reason == "stop"
    assert r2.usage is not None and r.usage is not None and r2.usage.prompt_tokens > r.usage.prompt_tokens


@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_tool_choice_opens_the_call(oss: ServerProcess, choice: str) -> None:
    import httpx

    tools = [*TOOLS, {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}]
    tool_choice: Any = "required" if choice == "required" else {"type": "function", "function": {"name": "get_weather"}}
    forced = '{"location": "Oslo"}<|call|>'
    if choice == "required":  # the model writes the name after the prefix `to=functions.`
        forced = "get_weather <|constrain|>json<|message|>" + forced
    r = openai_client(oss).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Oslo?"}], tools=tools,  # type: ignore[arg-type]
        tool_choice=tool_choice, extra_body={FORCED: forced})
    calls = r.choices[0].message.tool_calls or []
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [  # type: ignore[union-attr]
        ("get_weather", {"location": "Oslo"})]
    bad = httpx.post(oss.url("/v1/chat/completions"), json={
        "model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": tools,
        "tool_choice": {"type": "function", "function": {"name": "missing"}}})
    assert bad.status_code == 400 and "missing" in bad.text


def test_anthropic_thinking_and_tool_use(oss: ServerProcess) -> None:
    client = anthropic_client(oss)
    tools = [{"name": "get_weather", "description": "Weather of a city.",
              "input_schema": TOOLS[0]["function"]["parameters"]}]
    r = client.messages.create(model=MODEL, max_tokens=64, tools=tools,  # type: ignore[arg-type]
                               thinking={"type": "enabled", "budget_tokens": 2048},
                               messages=[{"role": "user", "content": "Weather in Paris?"}], extra_body={FORCED: CALL})
    kinds = [b.type for b in r.content]
    assert kinds == ["thinking", "tool_use"] and r.stop_reason == "tool_use"
    assert r.content[0].thinking == "Need the weather."  # type: ignore[union-attr]
    assert r.content[1].name == "get_weather" and r.content[1].input == {"location": "Paris"}  # type: ignore[union-attr]
    follow = client.messages.create(model=MODEL, max_tokens=64, tools=tools,  # type: ignore[arg-type]
                                    messages=[{"role": "user", "content": "Weather in Paris?"},
                                              {"role": "assistant", "content": [b.model_dump() for b in r.content]},
                                              {"role": "user", "content": [{"type": "tool_result",
                                                                            "tool_use_id": r.content[1].id,  # type: ignore[union-attr]
                                                                            "content": "21C"}]}],
                                    extra_body={FORCED: FINAL})
    assert [b.type for b in follow.content][-1] == "text" and follow.content[-1].text == "It is 21C."  # type: ignore[union-attr]


def test_responses_reasoning_item_and_function_call(oss: ServerProcess) -> None:
    client = openai_client(oss)
    tools = [{"type": "function", "name": "get_weather", "parameters": TOOLS[0]["function"]["parameters"]}]
    r = client.responses.create(model=MODEL, input="Weather in Paris?", tools=tools,  # type: ignore[arg-type]
                                reasoning={"effort": "low"}, extra_body={FORCED: CALL})
    kinds = [item.type for item in r.output]
    assert kinds == ["reasoning", "function_call"]
    call = r.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"location": "Paris"}  # type: ignore[union-attr]
    echo: list[Any] = [{"role": "user", "content": "Weather in Paris?"}, *[item.model_dump() for item in r.output],
                       {"type": "function_call_output", "call_id": call.call_id, "output": "21C"}]  # type: ignore[union-attr]
    follow = client.responses.create(model=MODEL, input=echo, tools=tools,  # type: ignore[arg-type]
                                     extra_body={FORCED: FINAL})
    assert follow.output_text == "It is 21C."
    assert follow.usage is not None and r.usage is not None and follow.usage.input_tokens > r.usage.input_tokens


def test_session_anchors_use_harmony_boundaries(demo_cache: Path) -> None:
    from freetoken_agent.service import ChatMessage
    from freetoken_agent.sessions import AnchorPlanner, AnchorPolicy
    from freetoken_agent.tokenizer import ChatTokenizer

    tok = ChatTokenizer.from_dir(build_demo_models(demo_cache, ("gpt_oss",))["gpt_oss"])
    planner = AnchorPlanner(tok)
    decode = {(d.kind, d.token_id) for d in planner.decode_anchors(AnchorPolicy.SEMANTIC, lambda kind: 1)}
    ids = {name: tok.token_to_id(name) for name in ("<|end|>", "<|return|>", "<|call|>", "<|start|>")}
    assert decode == {("thinking_end", ids["<|end|>"]), ("message_end", ids["<|return|>"]),
                      ("message_end", ids["<|call|>"])}
    messages = [ChatMessage("user", "hi"), ChatMessage("assistant", "hello", reasoning="think"),
                ChatMessage("user", "again")]
    prompt = tok.apply_chat_template([m.to_template() for m in messages], tokenize=True)
    assert planner.message_starts(prompt, messages, False) is None
    anchors = planner.plan(AnchorPolicy.SEMANTIC, messages, prompt, None, lambda kind: 1)
    starts = [i for i, t in enumerate(prompt) if t == ids["<|start|>"]]
    assert [a.position for a in anchors if a.kind == "turn_start"] == starts[1:]  # every message boundary
