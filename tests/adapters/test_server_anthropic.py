"""Anthropic Messages (what Claude Code speaks) against a real server: the `anthropic` SDK and raw SSE.

Protocol only: event grammar, block shapes, signatures, stop reasons, token counts and usage.
"""

from __future__ import annotations

import random
import re
import time
import uuid
from typing import Any

import httpx
import pytest
from server_fixture import (
    MODEL_NAME,
    ServerProcess,
    SseEvent,
    anthropic_client,
    anthropic_tools,
    check_arguments,
    parse_sse,
    pick_stop,
)

BILLING = "x-anthropic-billing-header: cc_version=2.1.332.3f6; cc_entrypoint=sdk-cli;"
THINKING: dict[str, Any] = {"type": "enabled", "budget_tokens": 1024}


def _user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def _post(server: ServerProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url(path), json=body, headers=server.headers(), timeout=120)


def _count(server: ServerProcess, body: dict[str, Any]) -> int:
    r = _post(server, "/v1/messages/count_tokens?beta=true", body)
    assert r.status_code == 200, r.text
    data = r.json()
    assert set(data) == {"input_tokens"}, data
    assert isinstance(data["input_tokens"], int) and data["input_tokens"] > 0
    return int(data["input_tokens"])


def _raw_stream(server: ServerProcess, body: dict[str, Any]) -> list[tuple[float, SseEvent]]:
    """(seconds since the request, event) for every SSE event, comments excluded."""
    start = time.monotonic()
    with httpx.stream("POST", server.url("/v1/messages?beta=true"), json={**body, "stream": True},
                      headers={**server.headers(), "anthropic-version": "2023-06-01",
                               "anthropic-beta": "interleaved-thinking-2025-05-14,made-up-beta-2030-01-01"},
                      timeout=120) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return [(time.monotonic() - start, e) for e in parse_sse(r.iter_lines()) if not e.comment]


def _check_event_grammar(events: list[SseEvent]) -> list[dict[str, Any]]:
    """message_start, ping*, (content_block_start, (delta|ping)*, content_block_stop)*, message_delta,
    message_stop; `event:` names equal `data.type`. Returns the blocks rebuilt from the deltas."""
    data = [e.json() for e in events]
    for e, d in zip(events, data, strict=True):
        assert e.event == d["type"], (e.event, d)
    kinds = [d["type"] for d in data]
    assert kinds[0] == "message_start", kinds
    assert kinds[-2:] == ["message_delta", "message_stop"], kinds
    blocks: list[dict[str, Any]] = []
    open_index: int | None = None
    for d in data[1:-2]:
        kind = d["type"]
        if kind == "ping":
            continue
        if kind == "content_block_start":
            assert open_index is None, "a block started before the previous one stopped"
            assert d["index"] == len(blocks)
            open_index = d["index"]
            blocks.append(dict(d["content_block"]))
        elif kind == "content_block_delta":
            assert d["index"] == open_index
            block, delta = blocks[d["index"]], d["delta"]
            if delta["type"] == "text_delta":
                assert block["type"] == "text"
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                assert block["type"] == "thinking"
                block["thinking"] += delta["thinking"]
            elif delta["type"] == "signature_delta":
                assert block["type"] == "thinking"
                block["signature"] += delta["signature"]
            elif delta["type"] == "input_json_delta":
                assert block["type"] == "tool_use"
                block["partial_json"] = block.get("partial_json", "") + delta["partial_json"]
            else:
                raise AssertionError(f"unknown delta {delta}")
        elif kind == "content_block_stop":
            assert d["index"] == open_index
            open_index = None
        else:
            raise AssertionError(f"unexpected event {kind} in the middle of a message")
    assert open_index is None
    start = data[0]["message"]
    assert start["role"] == "assistant" and start["content"] == [] and start["model"] == MODEL_NAME
    assert start["id"].startswith("msg_")
    return blocks


# ---------------------------------------------------------------- streaming grammar


def test_raw_stream_event_order_with_thinking(endless: ServerProcess) -> None:
    timed = _raw_stream(endless, {"model": MODEL_NAME, "messages": _user("hi"), "max_tokens": 8, "thinking": THINKING})
    events = [e for _, e in timed]
    blocks = _check_event_grammar(events)
    assert blocks and blocks[0]["type"] == "thinking"
    assert blocks[0]["thinking"] and blocks[0]["signature"], blocks[0]
    delta = events[-2].json()
    assert delta["delta"]["stop_reason"] == "max_tokens"
    assert delta["usage"]["output_tokens"] == 8


@pytest.mark.parametrize("thinking", [False, True], ids=["no-thinking", "thinking"])
def test_raw_stream_event_order(family_server: ServerProcess, thinking: bool) -> None:
    """The shipped demo may end at once (no blocks at all) or after a few tokens: the grammar holds."""
    body: dict[str, Any] = {"model": MODEL_NAME, "messages": _user("hello"), "max_tokens": 6}
    if thinking:
        body["thinking"] = THINKING
    events = [e for _, e in _raw_stream(family_server, body)]
    blocks = _check_event_grammar(events)
    assert {b["type"] for b in blocks} <= {"thinking", "text"}
    assert all(b["signature"] for b in blocks if b["type"] == "thinking")
    final = events[-2].json()
    assert final["delta"]["stop_reason"] in ("end_turn", "max_tokens")
    assert (final["delta"]["stop_reason"] == "max_tokens") == (final["usage"]["output_tokens"] == 6)


def test_raw_stream_text_block(endless: ServerProcess) -> None:
    events = [e for _, e in _raw_stream(endless, {"model": MODEL_NAME, "messages": _user("hello"),
                                                   "max_tokens": 6})]
    blocks = _check_event_grammar(events)
    assert [b["type"] for b in blocks] == ["text"]
    assert blocks[0]["text"]


def test_message_start_arrives_before_first_token(q35: ServerProcess) -> None:
    """Headers and message_start go out at once; keep-alive pings flow while a long prompt is prefilled."""
    rng = random.Random(uuid.uuid4().int)
    words = " ".join(f"{rng.choice(['alpha', 'beta', 'gamma', 'delta'])}{rng.randint(0, 999)}" for _ in range(1400))
    body = {"model": MODEL_NAME, "messages": _user(words), "max_tokens": 3}
    assert _count(q35, body) > 4000
    timed = _raw_stream(q35, body)
    kinds = [(t, e.event) for t, e in timed]
    assert kinds[0][1] == "message_start"
    # the first generated token is a content block, or (if the model ends at once) the message_delta
    first_token = next(t for t, k in kinds if k in ("content_block_start", "message_delta"))
    pings_before = [t for t, k in kinds if k == "ping" and t < first_token]
    assert kinds[0][0] < first_token / 2, kinds[:4]
    # the server's ping interval is 0.25 s (this prefill takes ~1 s on two cores; with half the
    # prompt the second ping raced the first token under a loaded CI machine): more than the immediate ping means the stream was open
    # (and flushed) while the prompt was still being prefilled
    assert len(pings_before) >= 2, kinds[:6]


# ---------------------------------------------------------------- SDK: thinking, text, tools


def test_sdk_thinking_blocks_have_signatures(endless: ServerProcess) -> None:
    client = anthropic_client(endless)
    msg = client.messages.create(model=MODEL_NAME, max_tokens=8, messages=_user("think"), thinking=THINKING)  # type: ignore[arg-type]
    assert msg.content[0].type == "thinking"
    assert msg.content[0].thinking and msg.content[0].signature
    assert msg.stop_reason == "max_tokens"
    with client.messages.stream(model=MODEL_NAME, max_tokens=8, messages=_user("think"),  # type: ignore[arg-type]
                                thinking=THINKING) as stream:  # type: ignore[arg-type]
        final = stream.get_final_message()
    assert final.content[0].type == "thinking"
    assert final.content[0].thinking == msg.content[0].thinking  # greedy
    assert final.content[0].signature == msg.content[0].signature
    assert final.usage.output_tokens == 8


def test_sdk_text_without_thinking(family_server: ServerProcess) -> None:
    client = anthropic_client(family_server)
    msg = client.messages.create(model=MODEL_NAME, max_tokens=6, messages=_user("say hi"))  # type: ignore[arg-type]
    assert msg.type == "message" and msg.role == "assistant" and msg.model == MODEL_NAME
    assert all(b.type == "text" and b.text for b in msg.content)
    assert 1 <= msg.usage.output_tokens <= 6
    assert msg.stop_reason == ("max_tokens" if msg.usage.output_tokens == 6 else "end_turn")


def test_sdk_text_block_max_tokens(endless: ServerProcess) -> None:
    msg = anthropic_client(endless).messages.create(model=MODEL_NAME, max_tokens=6, messages=_user("say hi"))  # type: ignore[arg-type]
    assert [b.type for b in msg.content] == ["text"]
    assert msg.stop_reason == "max_tokens" and msg.stop_sequence is None
    assert msg.usage.output_tokens == 6


@pytest.mark.parametrize(("name", "stream"), [("q35", False), ("q3", False), ("q3", True)])
def test_tool_choice_any_gives_tool_use(servers: dict[str, ServerProcess], name: str, stream: bool) -> None:
    client = anthropic_client(servers[name])
    kwargs: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": 64, "messages": _user("Weather in Paris?"),
                              "tools": anthropic_tools("get_weather", "get_time"), "tool_choice": {"type": "any"}}
    if stream:
        with client.messages.stream(**kwargs) as s:
            msg = s.get_final_message()
    else:
        msg = client.messages.create(**kwargs)
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert uses, msg
    assert msg.stop_reason in ("tool_use", "max_tokens")
    complete = uses if msg.stop_reason == "tool_use" else uses[:-1]
    for block in complete:
        assert block.id.startswith("toolu_")
        assert block.name in ("get_weather", "get_time")
        check_arguments(block.name, block.input)


@pytest.mark.parametrize("name", ["q3", "endless"])
def test_tool_choice_any_single_call_stops_with_tool_use(servers: dict[str, ServerProcess], name: str) -> None:
    """`disable_parallel_tool_use`: exactly one tool_use block and stop_reason tool_use."""
    family_server = servers[name]
    r = _post(family_server, "/v1/messages", {
        "model": MODEL_NAME, "max_tokens": 64, "messages": _user("Weather in Paris?"),
        "tools": anthropic_tools("get_weather"), "tool_choice": {"type": "any", "disable_parallel_tool_use": True}})
    assert r.status_code == 200, r.text
    msg = r.json()
    uses = [b for b in msg["content"] if b["type"] == "tool_use"]
    assert len(uses) == 1, msg
    assert msg["stop_reason"] == "tool_use", msg
    assert isinstance(uses[0]["input"], dict)
    check_arguments("get_weather", uses[0]["input"])


def test_tool_choice_named_tool(q3: ServerProcess) -> None:
    r = _post(q3, "/v1/messages", {"model": MODEL_NAME, "max_tokens": 48, "messages": _user("Time?"),
                                   "tools": anthropic_tools("get_weather", "get_time"),
                                   "tool_choice": {"type": "tool", "name": "get_time"}})
    assert r.status_code == 200, r.text
    uses = [b for b in r.json()["content"] if b["type"] == "tool_use"]
    assert uses and all(b["name"] == "get_time" for b in uses)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_stop_sequences(endless: ServerProcess, stream: bool) -> None:
    client = anthropic_client(endless)
    base = client.messages.create(model=MODEL_NAME, max_tokens=24, messages=_user("Write a long sentence."))  # type: ignore[arg-type]
    text = "".join(b.text for b in base.content if b.type == "text")
    stop = pick_stop(text)
    kwargs: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": 24, "messages": _user("Write a long sentence."),
                              "stop_sequences": ["zz-not-there", stop]}
    if stream:
        with client.messages.stream(**kwargs) as s:
            msg = s.get_final_message()
    else:
        msg = client.messages.create(**kwargs)
    out = "".join(b.text for b in msg.content if b.type == "text")
    assert msg.stop_reason == "stop_sequence"
    assert msg.stop_sequence == stop
    assert stop not in out
    assert out == text[:text.find(stop)].rstrip()


# ---------------------------------------------------------------- requests Claude Code sends


def test_count_tokens_matches_usage(family_server: ServerProcess) -> None:
    body = {"model": MODEL_NAME, "system": "You are a coding agent.", "messages": _user("Count me please."),
            "max_tokens": 3}
    counted = _count(family_server, body)
    for _ in range(2):  # the second run may read the prompt from the cache: the sum stays the same
        usage = _post(family_server, "/v1/messages", body).json()["usage"]
        assert usage["input_tokens"] + usage["cache_read_input_tokens"] == counted, usage
        assert usage["cache_creation_input_tokens"] == 0
        assert 1 <= usage["output_tokens"] <= 3


def test_count_tokens_equals_openai_prompt_tokens(family_server: ServerProcess) -> None:
    """The same conversation costs the same tokens in both protocols (thinking on in both)."""
    count = _count(family_server, {"model": MODEL_NAME, "system": "Be brief.", "messages": _user("Hi there"),
                                   "thinking": THINKING})
    chat = httpx.post(family_server.url("/v1/chat/completions"), timeout=120, json={
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}],
        "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == count


def test_cache_read_on_repeat(q3: ServerProcess) -> None:
    body = {"model": MODEL_NAME, "system": "Cache test system prompt " + uuid.uuid4().hex,
            "messages": _user("Repeat after me: cache."), "max_tokens": 2}
    first = _post(q3, "/v1/messages", body).json()["usage"]
    second = _post(q3, "/v1/messages", body).json()["usage"]
    assert first["cache_read_input_tokens"] < second["cache_read_input_tokens"]
    assert second["cache_read_input_tokens"] > 0
    assert first["input_tokens"] + first["cache_read_input_tokens"] == \
        second["input_tokens"] + second["cache_read_input_tokens"]


def test_system_string_and_blocks_count_the_same(family_server: ServerProcess) -> None:
    text = "You are Claude Code, a coding agent."
    as_string = _count(family_server, {"model": MODEL_NAME, "system": text, "messages": _user("hi")})
    as_blocks = _count(family_server, {"model": MODEL_NAME, "messages": _user("hi"),
                                       "system": [{"type": "text", "text": text}]})
    with_billing = _count(family_server, {"model": MODEL_NAME, "messages": _user("hi"), "system": [
        {"type": "text", "text": BILLING}, {"type": "text", "text": text, "cache_control": {"type": "ephemeral"}}]})
    assert as_string == as_blocks == with_billing


def test_billing_header_line_in_string_system_keeps_the_rest(q35: ServerProcess) -> None:
    """A client that joins the blocks into one string must not lose its instructions with the header."""
    text = "You are Claude Code, a coding agent."
    plain = _count(q35, {"model": MODEL_NAME, "system": text, "messages": _user("hi")})
    joined = _count(q35, {"model": MODEL_NAME, "system": f"{BILLING}\n{text}", "messages": _user("hi")})
    nothing = _count(q35, {"model": MODEL_NAME, "messages": _user("hi")})
    assert joined != nothing, "the whole system prompt was dropped with the billing header line"
    assert joined >= plain


def test_system_role_inside_messages(family_server: ServerProcess) -> None:
    """Claude Code 2.1.x puts a role:system message at messages[1], as a block list then as a string."""
    env = "Environment: linux, cwd /repo, date 2026-11-30."
    base = [{"role": "user", "content": "Fix the bug."}]
    as_blocks = {"model": MODEL_NAME, "max_tokens": 3, "system": [{"type": "text", "text": "You are an agent."}],
                 "messages": [base[0], {"role": "system", "content": [{"type": "text", "text": env}]},
                              {"role": "user", "content": "Go."}]}
    as_string = {**as_blocks, "messages": [base[0], {"role": "system", "content": env},
                                           {"role": "user", "content": "Go."}]}
    assert _count(family_server, as_blocks) == _count(family_server, as_string)
    r = _post(family_server, "/v1/messages?beta=true", as_blocks)
    assert r.status_code == 200, r.text


def test_unknown_fields_and_cache_control_ignored(q35: ServerProcess) -> None:
    plain = {"model": MODEL_NAME, "max_tokens": 3, "system": [{"type": "text", "text": "Be an agent."}],
             "tools": anthropic_tools("get_weather"),
             "messages": [{"role": "user", "content": [{"type": "text", "text": "Do it."}]}]}
    decorated = {
        **plain,
        "system": [{"type": "text", "text": "Be an agent.", "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
        "tools": [{**anthropic_tools("get_weather")[0], "cache_control": {"type": "ephemeral"}},
                  {"type": "web_search_20250305", "name": "web_search", "max_uses": 3}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Do it.",
                                                   "cache_control": {"type": "ephemeral"}}]}],
        "metadata": {"user_id": '{"device_id":"d","session_id":"s"}'},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "medium"},
        "thinking": {"type": "disabled"},
        "some_future_field": {"x": 1},
    }
    assert _count(q35, plain) == _count(q35, decorated)
    r = httpx.post(q35.url("/v1/messages?beta=true"), json=decorated, timeout=120,
                   headers={"anthropic-beta": "claude-code-20250219,context-management-2025-06-27",
                            "anthropic-version": "2023-06-01", "x-app": "cli",
                            "X-Claude-Code-Session-Id": str(uuid.uuid4())})
    assert r.status_code == 200, r.text


def test_history_with_thinking_tool_use_and_tool_result(family_server: ServerProcess) -> None:
    body = {"model": MODEL_NAME, "max_tokens": 3, "tools": anthropic_tools("get_weather"), "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Call the tool.", "signature": ""},
            {"type": "redacted_thinking", "data": "opaque"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_01", "name": "get_weather",
             "input": {"replace_all": False, "city": "Paris", "unit": "celsius"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_01", "content": [{"type": "text", "text": "sunny"}]},
            {"type": "tool_result", "tool_use_id": "toolu_01", "content": "failed", "is_error": True},
            {"type": "text", "text": "Go on."}]},
    ], "thinking": THINKING}
    r = _post(family_server, "/v1/messages", body)
    assert r.status_code == 200, r.text
    assert 1 <= r.json()["usage"]["output_tokens"] <= 3


def test_prompt_too_long_message_shape(locked: ServerProcess) -> None:
    """Claude Code recognises overflow by `prompt is too long: N tokens > M maximum`."""
    r = _post(locked, "/v1/messages", {"model": MODEL_NAME, "max_tokens": 8,
                                       "messages": _user("word " * 400)})
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    m = re.fullmatch(r"prompt is too long: (\d+) tokens > (\d+) maximum", body["error"]["message"])
    assert m, body
    assert int(m.group(1)) > int(m.group(2))
