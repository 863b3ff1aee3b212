"""OpenAI Chat Completions against a real server, through the `openai` SDK, litellm and raw httpx.

The demo model has random weights, so these tests check the protocol (shapes, counts, finish
reasons, streaming order, constrained tool calls), never the meaning of the text.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import litellm
import openai
import pytest
from server_fixture import (
    MODEL_NAME,
    ServerProcess,
    chat_tools,
    check_arguments,
    openai_client,
    parse_sse,
    pick_stop,
)

from freetoken_agent.tokenizer import ChatTokenizer

NO_THINK: dict[str, Any] = {"chat_template_kwargs": {"enable_thinking": False}}


def _msgs(text: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": "You are terse."}, {"role": "user", "content": text}]


def _extra(obj: Any, key: str) -> Any:
    """A field the SDK model does not declare (e.g. `reasoning_content`)."""
    return (obj.model_extra or {}).get(key, getattr(obj, key, None))


def _stream(server: ServerProcess, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The JSON chunks of a raw streaming request; asserts SSE framing and the [DONE] end."""
    with httpx.stream("POST", server.url("/v1/chat/completions"), json={**body, "stream": True},
                      headers=server.headers(), timeout=120) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [e for e in parse_sse(r.iter_lines()) if not e.comment]
    assert events[-1].data == "[DONE]"
    assert all(e.data != "[DONE]" for e in events[:-1])
    return [e.json() for e in events[:-1]]


def _text_of_chunks(chunks: list[dict[str, Any]]) -> tuple[str, str]:
    reasoning, content = [], []
    for c in chunks:
        for ch in c["choices"]:
            reasoning.append(ch["delta"].get("reasoning_content") or "")
            content.append(ch["delta"].get("content") or "")
    return "".join(reasoning), "".join(content)


# ---------------------------------------------------------------- basic shapes and usage


def test_nonstream_shape_usage_and_length(family_server: ServerProcess, tokenizers: dict[str, ChatTokenizer]) -> None:
    client = openai_client(family_server)
    messages = _msgs("Say something about ships.")
    resp = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=8)  # type: ignore[arg-type]
    assert resp.object == "chat.completion"
    assert resp.id.startswith("chatcmpl-")
    assert resp.model == MODEL_NAME
    assert len(resp.choices) == 1 and resp.choices[0].index == 0
    assert resp.choices[0].message.role == "assistant"
    usage = resp.usage
    assert usage is not None
    assert 1 <= usage.completion_tokens <= 8
    # the demo model may end its turn early; "length" exactly when the budget ran out
    assert resp.choices[0].finish_reason == ("length" if usage.completion_tokens == 8 else "stop")
    expected_prompt = len(tokenizers[family_server.name].apply_chat_template(
        messages, add_generation_prompt=True, enable_thinking=True, tokenize=True))
    assert usage.prompt_tokens == expected_prompt
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details is not None
    assert isinstance(usage.prompt_tokens_details.cached_tokens, int)
    assert 0 <= usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens


def test_stream_role_first_and_usage_chunk_matches_nonstream(family_server: ServerProcess) -> None:
    body = {"model": MODEL_NAME, "messages": _msgs("Count the stars."), "max_tokens": 12}
    plain = httpx.post(family_server.url("/v1/chat/completions"), json=body, timeout=120).json()
    chunks = _stream(family_server, {**body, "stream_options": {"include_usage": True}})
    first = chunks[0]
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"].get("role") == "assistant"
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:] if c["choices"])
    assert len({c["id"] for c in chunks}) == 1
    last = chunks[-1]
    assert last["choices"] == []
    assert last["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    assert last["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"]
    assert last["usage"]["total_tokens"] == plain["usage"]["total_tokens"]
    assert "cached_tokens" in last["usage"]["prompt_tokens_details"]
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finals) == 1
    assert finals[0]["choices"][0]["finish_reason"] == plain["choices"][0]["finish_reason"]
    assert chunks.index(finals[0]) == len(chunks) - 2
    assert all("usage" not in c or c["usage"] is None for c in chunks[:-1])
    # greedy: the stream carries exactly the non-streamed text
    reasoning, content = _text_of_chunks(chunks)
    msg = plain["choices"][0]["message"]
    assert (reasoning, content) == (msg.get("reasoning_content") or "", msg["content"] or "")


def test_stream_without_include_usage_has_no_usage_chunk(q35: ServerProcess) -> None:
    chunks = _stream(q35, {"messages": _msgs("hello"), "max_tokens": 4})
    assert all(c["choices"] for c in chunks)
    assert all(c.get("usage") is None for c in chunks)


def test_finish_reason_length_at_max_tokens(endless: ServerProcess) -> None:
    resp = openai_client(endless).chat.completions.create(model=MODEL_NAME, messages=_msgs("Go on."),  # type: ignore[arg-type]
                                                          max_tokens=7)
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage is not None and resp.usage.completion_tokens == 7


def test_sdk_stream_and_nonstream_agree(endless: ServerProcess) -> None:
    client = openai_client(endless)
    messages = _msgs("Describe a cloud.")
    full = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=10)  # type: ignore[arg-type]
    stream = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=10,  # type: ignore[arg-type]
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert full.usage is not None
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    reasoning = "".join(_extra(c.choices[0].delta, "reasoning_content") or "" for c in chunks if c.choices)
    assert reasoning and reasoning == _extra(full.choices[0].message, "reasoning_content")


def test_cached_tokens_on_extended_conversation(q3: ServerProcess) -> None:
    """Qwen3 (full attention): a follow-up that extends prompt + answer reuses the cached prefix."""
    client = openai_client(q3)
    first_msgs = _msgs("Tell me about the cached prefix test number 7.")
    first = client.chat.completions.create(model=MODEL_NAME, messages=first_msgs, max_tokens=12)  # type: ignore[arg-type]
    assert first.usage is not None and first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens < first.usage.prompt_tokens
    answer = first.choices[0].message.content or ""
    follow = [*first_msgs, {"role": "assistant", "content": answer}, {"role": "user", "content": "And then?"}]
    second = client.chat.completions.create(model=MODEL_NAME, messages=follow, max_tokens=4)  # type: ignore[arg-type]
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens, (cached, first.usage.prompt_tokens)
    assert cached < second.usage.prompt_tokens


def test_reasoning_arrives_as_reasoning_content(endless: ServerProcess) -> None:
    client = openai_client(endless)
    resp = client.chat.completions.create(model=MODEL_NAME, messages=_msgs("Think first."), max_tokens=8)  # type: ignore[arg-type]
    reasoning = _extra(resp.choices[0].message, "reasoning_content")
    assert isinstance(reasoning, str) and reasoning  # Qwen3.5 starts inside <think>
    assert "<think>" not in reasoning and "</think>" not in reasoning
    off = client.chat.completions.create(model=MODEL_NAME, messages=_msgs("Think first."), max_tokens=8,  # type: ignore[arg-type]
                                         reasoning_effort="none")  # type: ignore[arg-type]
    assert not _extra(off.choices[0].message, "reasoning_content")
    assert off.choices[0].message.content
    chunks = _stream(endless, {"messages": _msgs("Think first."), "max_tokens": 8})
    streamed, _ = _text_of_chunks(chunks)
    assert streamed == reasoning


def test_n2_rejected(q35: ServerProcess) -> None:
    client = openai_client(q35)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_NAME, messages=_msgs("hi"), max_tokens=4, n=2)  # type: ignore[arg-type]
    assert info.value.status_code == 400
    body = info.value.body
    assert isinstance(body, dict) and body.get("param") == "n", body


def test_max_completion_tokens_honoured(endless: ServerProcess) -> None:
    client = openai_client(endless)
    resp = client.chat.completions.create(model=MODEL_NAME, messages=_msgs("go"), max_completion_tokens=5)  # type: ignore[arg-type]
    assert resp.usage is not None and resp.usage.completion_tokens == 5
    assert resp.choices[0].finish_reason == "length"
    both = client.chat.completions.create(model=MODEL_NAME, messages=_msgs("go"), max_completion_tokens=3,  # type: ignore[arg-type]
                                          max_tokens=9)
    assert both.usage is not None and both.usage.completion_tokens == 3


def test_seed_reproducible_at_temperature_1(endless: ServerProcess) -> None:
    client = openai_client(endless)

    def run(seed: int) -> tuple[str, str]:
        r = client.chat.completions.create(model=MODEL_NAME, messages=_msgs("Pick random words."), max_tokens=12,  # type: ignore[arg-type]
                                           temperature=1.0, seed=seed)
        m = r.choices[0].message
        return _extra(m, "reasoning_content") or "", m.content or ""

    a, b, c = run(1234), run(1234), run(98765)
    assert a == b
    assert a != c


# ---------------------------------------------------------------- stop strings


@pytest.mark.parametrize("name", ["endless", "q3"])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_stop_string_cuts_output(servers: dict[str, ServerProcess], name: str, stream: bool) -> None:
    family_server = servers[name]
    body: dict[str, Any] = {"messages": _msgs("Write a long line of text."), "max_tokens": 24, **NO_THINK}
    base = httpx.post(family_server.url("/v1/chat/completions"), json=body, timeout=120).json()
    text = base["choices"][0]["message"]["content"]
    stop = pick_stop(text)
    expected = text[:text.find(stop)].rstrip()
    if stream:
        chunks = _stream(family_server, {**body, "stop": [stop, "never-appears-xyz"]})
        _, content = _text_of_chunks(chunks)
        finish = next(c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"])
    else:
        resp = httpx.post(family_server.url("/v1/chat/completions"), json={**body, "stop": stop}, timeout=120).json()
        content, finish = resp["choices"][0]["message"]["content"], resp["choices"][0]["finish_reason"]
        assert resp["usage"]["completion_tokens"] < base["usage"]["completion_tokens"]
    assert stop not in content
    assert content == expected
    assert finish == "stop"


# ---------------------------------------------------------------- tools


def _stream_calls(chunks: list[dict[str, Any]]) -> tuple[dict[int, dict[str, str]], list[str]]:
    calls: dict[int, dict[str, str]] = {}
    for c in chunks:
        if not c["choices"]:
            continue
        for tc in c["choices"][0]["delta"].get("tool_calls") or []:
            slot = calls.setdefault(tc["index"], {"id": "", "name": "", "arguments": ""})
            if tc.get("id"):
                assert not slot["id"], "the id comes once, with the first delta of a call"
                slot["id"] = tc["id"]
            fn = tc.get("function") or {}
            slot["name"] += fn.get("name") or ""
            slot["arguments"] += fn.get("arguments") or ""
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    return calls, finish


@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_tool_call_nonstream(family_server: ServerProcess, choice: str) -> None:
    """The constraint makes the output well-formed calls; with parallel calls allowed the (random) model
    may chain several, so the budget can end it ("length"), but every parsed call is valid."""
    client = openai_client(family_server)
    tool_choice: Any = "required" if choice == "required" else {"type": "function", "function": {"name": "get_time"}}
    resp = client.chat.completions.create(model=MODEL_NAME, messages=_msgs("What is the weather in Paris?"),  # type: ignore[arg-type]
                                          tools=chat_tools("get_weather", "get_time"),  # type: ignore[arg-type]
                                          tool_choice=tool_choice, max_tokens=64)
    choice0 = resp.choices[0]
    calls = choice0.message.tool_calls
    assert calls, choice0.message
    assert choice0.finish_reason in ("tool_calls", "length")
    for call in calls:
        assert call.type == "function"
        assert call.id
        assert call.function.name in ("get_weather", "get_time")  # type: ignore[union-attr]
        check_arguments(call.function.name, json.loads(call.function.arguments))  # type: ignore[union-attr]
        if choice == "named":
            assert call.function.name == "get_time"  # type: ignore[union-attr]


@pytest.mark.parametrize(("name", "choice"), [("q35", "required"), ("q3", "required"), ("endless", "named")])
def test_forced_single_tool_call_finishes_with_tool_calls(servers: dict[str, ServerProcess], name: str,
                                                          choice: str) -> None:
    """`parallel_tool_calls: false` + a forced choice: exactly one call, then the turn ends (whether or
    not the model would have chained another call: the endless model would)."""
    family_server = servers[name]
    tool_choice: Any = "required" if choice == "required" else {"type": "function", "function": {"name": "get_weather"}}
    resp = httpx.post(family_server.url("/v1/chat/completions"), timeout=120, json={
        "messages": _msgs("What is the weather in Paris?"), "tools": chat_tools("get_weather", "get_time"),
        "tool_choice": tool_choice, "parallel_tool_calls": False, "max_tokens": 64}).json()
    choice0 = resp["choices"][0]
    calls = choice0["message"].get("tool_calls") or []
    assert len(calls) == 1, choice0
    assert choice0["finish_reason"] == "tool_calls", choice0
    name = calls[0]["function"]["name"]
    check_arguments(name, json.loads(calls[0]["function"]["arguments"]))


def test_forced_tool_call_stream(family_server: ServerProcess) -> None:
    chunks = _stream(family_server, {"messages": _msgs("Weather in Oslo?"), "tools": chat_tools("get_weather"),
                                     "tool_choice": "required", "max_tokens": 64})
    calls, finish = _stream_calls(chunks)
    assert len(finish) == 1 and finish[0] in ("tool_calls", "length"), finish
    assert calls and sorted(calls) == list(range(len(calls)))
    for call in calls.values():
        assert call["id"] and call["name"] == "get_weather"
        check_arguments("get_weather", json.loads(call["arguments"]))


def test_tool_choice_none_gives_no_tool_calls(family_server: ServerProcess) -> None:
    resp = httpx.post(family_server.url("/v1/chat/completions"), timeout=120, json={
        "messages": _msgs("Weather in Rome?"), "tools": chat_tools("get_weather"), "tool_choice": "none",
        "max_tokens": 8}).json()
    msg = resp["choices"][0]
    assert not msg["message"].get("tool_calls")
    assert msg["finish_reason"] in ("length", "stop")


@pytest.mark.parametrize("parallel", [True, False])
def test_tools_with_parallel_tool_calls_accepted(q35: ServerProcess, parallel: bool) -> None:
    client = openai_client(q35)
    resp = client.chat.completions.create(model=MODEL_NAME, messages=_msgs("Weather?"), max_tokens=6,  # type: ignore[arg-type]
                                          tools=chat_tools("get_weather", "get_time"),  # type: ignore[arg-type]
                                          tool_choice="auto", parallel_tool_calls=parallel)
    assert resp.choices[0].finish_reason in ("length", "stop", "tool_calls")


def test_history_with_reasoning_and_tool_calls_accepted(family_server: ServerProcess) -> None:
    """What OpenCode / mini-swe-agent send back: reasoning_content, tool_calls and tool results."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are an agent."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "I should call the tool.",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather",
                                      "arguments": "{\"city\":\"Paris\",\"unit\":\"celsius\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"},
        {"role": "assistant", "content": None, "reasoning": "Now answer.",
         "tool_calls": [{"id": "call_2", "type": "function",
                         "function": {"name": "get_time", "arguments": {"zone": "CET"}}}]},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "12:00"}]},
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Thanks. Summarise."},
    ]
    r = httpx.post(family_server.url("/v1/chat/completions"), timeout=120, json={
        "messages": messages, "tools": chat_tools("get_weather", "get_time"), "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert 1 <= r.json()["usage"]["completion_tokens"] <= 4


# ---------------------------------------------------------------- litellm


def test_litellm_completion(endless: ServerProcess) -> None:
    resp: Any = litellm.completion(model=f"openai/{MODEL_NAME}", api_base=endless.v1, api_key="sk-unused",
                                   messages=_msgs("hello from litellm"), max_tokens=8)
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 8
    assert resp.usage.prompt_tokens > 0
    assert resp.choices[0].message.reasoning_content  # litellm keeps the field


def test_litellm_tool_call(q3: ServerProcess) -> None:
    resp: Any = litellm.completion(model=f"openai/{MODEL_NAME}", api_base=q3.v1, api_key="sk-unused",
                                   messages=_msgs("Weather in Lima?"), tools=chat_tools("get_weather"),
                                   tool_choice="required", max_tokens=64)
    assert resp.choices[0].finish_reason in ("tool_calls", "length")
    call = resp.choices[0].message.tool_calls[0]
    assert call.id and call.function.name == "get_weather"
    check_arguments("get_weather", json.loads(call.function.arguments))


def test_litellm_acompletion_stream(endless: ServerProcess) -> None:
    async def run() -> tuple[str, Any, list[str]]:
        stream: Any = await litellm.acompletion(model=f"openai/{MODEL_NAME}", api_base=endless.v1,
                                                api_key="sk-unused",
                                                messages=_msgs("stream please"), max_tokens=10, stream=True,
                                                stream_options={"include_usage": True}, **NO_THINK)
        content, usage, finish = [], None, []
        async for chunk in stream:
            if chunk.choices:
                content.append(chunk.choices[0].delta.content or "")
                if chunk.choices[0].finish_reason:
                    finish.append(chunk.choices[0].finish_reason)
            if getattr(chunk, "usage", None):
                usage = chunk.usage
        return "".join(content), usage, finish

    content, usage, finish = asyncio.run(run())
    assert content
    assert finish == ["length"]
    assert usage is not None and usage.completion_tokens == 10
