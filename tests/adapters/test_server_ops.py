"""Operational behaviour of a real server: models, health, metrics, auth, bad input, overflow,
client disconnects, duplicate-request joining and concurrent requests."""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any

import anthropic
import httpx
import openai
import pytest
from server_fixture import (
    API_KEY,
    MODEL_NAME,
    SMALL_CONTEXT,
    ServerProcess,
    anthropic_client,
    assert_alive,
    assert_anthropic_error,
    assert_openai_error,
    async_anthropic_client,
    async_openai_client,
    chat_tools,
    openai_client,
    parse_sse,
    wait_idle,
)

CHAT, MESSAGES, RESPONSES, COUNT = "/v1/chat/completions", "/v1/messages", "/v1/responses", "/v1/messages/count_tokens"
USER = [{"role": "user", "content": "hi"}]
TOO_LONG_RE = re.compile(r"prompt is too long: (\d+) tokens > (\d+) maximum")


def _metric(server: ServerProcess, name: str) -> float:
    return server.metrics().get(name, 0.0)


# ---------------------------------------------------------------- models, health, metrics


def test_models_list(family_server: ServerProcess) -> None:
    models = openai_client(family_server).models.list()
    ids = [m.id for m in models.data]
    assert ids == [MODEL_NAME]
    card = models.data[0].model_dump()
    assert card["object"] == "model"
    assert card["context_window"] == card["context_length"] == card["max_model_len"] > 0
    assert card["max_input_tokens"] < card["context_window"]
    assert 0 < card["max_output_tokens"] <= card["context_window"]


def test_model_retrieve_anthropic_sdk(q35: ServerProcess) -> None:
    info = anthropic_client(q35).models.retrieve(MODEL_NAME)
    assert info.id == MODEL_NAME
    assert info.max_input_tokens is not None and info.max_input_tokens > 0
    assert info.max_tokens is not None and info.max_tokens > 0
    assert info.display_name == MODEL_NAME


def test_unknown_model_404(q35: ServerProcess) -> None:
    with pytest.raises(openai.NotFoundError):
        openai_client(q35).models.retrieve("no-such-model")
    with pytest.raises(anthropic.NotFoundError):
        anthropic_client(q35).models.retrieve("no-such-model")


def test_root_and_health_open(locked: ServerProcess) -> None:
    h = httpx.get(locked.url("/health"), timeout=10)
    assert h.status_code == 200
    assert h.json()["status"] == "ok" and h.json()["model"] == MODEL_NAME
    assert {"running", "waiting"} <= set(h.json())
    assert httpx.head(locked.url("/"), timeout=10).status_code == 200  # Claude Code probes the base URL


def test_metrics_counters_increase(q35: ServerProcess) -> None:
    r = httpx.get(q35.url("/metrics"), timeout=10)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    assert "# TYPE freetoken_prompt_tokens_total counter" in r.text
    before = q35.metrics()
    resp = httpx.post(q35.url(CHAT), json={"messages": USER, "max_tokens": 5}, timeout=60).json()
    after = q35.metrics()
    assert after["freetoken_completion_tokens_total"] - before["freetoken_completion_tokens_total"] == \
        resp["usage"]["completion_tokens"]
    assert after["freetoken_prompt_tokens_total"] - before["freetoken_prompt_tokens_total"] == \
        resp["usage"]["prompt_tokens"]
    key = 'freetoken_requests_total{route="/v1/chat/completions",status="200"}'
    assert after[key] == before.get(key, 0.0) + 1
    assert after["freetoken_time_to_first_token_seconds_count"] > before.get(
        "freetoken_time_to_first_token_seconds_count", 0.0)
    # one short prompt is one prefill pass, its checkpoints (system end, user start, reply start,
    # prompt end) taken inside it; the gauge follows the engine's step, published just after it
    for _ in range(20):
        if after["freetoken_prefill_passes"] > before["freetoken_prefill_passes"]:
            break
        time.sleep(0.1)
        after = q35.metrics()
    assert after["freetoken_prefill_passes"] - before["freetoken_prefill_passes"] == 1


# ---------------------------------------------------------------- auth


@pytest.mark.parametrize("path", [CHAT, RESPONSES, "/v1/models", "/metrics"])
def test_auth_openai_shape(locked: ServerProcess, path: str) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": "wrong"}):
        if path in ("/v1/models", "/metrics"):
            r = httpx.get(locked.url(path), headers=headers, timeout=10)
        else:
            r = httpx.post(locked.url(path), json={"messages": USER, "input": "hi", "max_tokens": 1},
                           headers=headers, timeout=10)
        err = assert_openai_error(r, 401)
        assert err["type"] == "authentication_error"


@pytest.mark.parametrize("path", [MESSAGES, COUNT])
def test_auth_anthropic_shape(locked: ServerProcess, path: str) -> None:
    for headers in ({}, {"x-api-key": "wrong"}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(locked.url(path), json={"messages": USER, "max_tokens": 1}, headers=headers, timeout=10)
        err = assert_anthropic_error(r, 401)
        assert err["type"] == "authentication_error"


def test_auth_both_header_styles_work(locked: ServerProcess) -> None:
    for headers in ({"Authorization": f"Bearer {API_KEY}"}, {"x-api-key": API_KEY}):
        r = httpx.post(locked.url(CHAT), json={"messages": USER, "max_tokens": 1}, headers=headers, timeout=60)
        assert r.status_code == 200, r.text
        r = httpx.post(locked.url(MESSAGES), json={"messages": USER, "max_tokens": 1}, headers=headers, timeout=60)
        assert r.status_code == 200, r.text


def test_auth_with_sdks(locked: ServerProcess) -> None:
    assert openai_client(locked).models.list().data[0].id == MODEL_NAME
    with pytest.raises(openai.AuthenticationError):
        openai_client(locked, api_key="wrong").models.list()
    # anthropic SDK: api_key goes in x-api-key, auth_token in Authorization: Bearer
    msg = anthropic_client(locked).messages.create(model=MODEL_NAME, max_tokens=1, messages=USER)  # type: ignore[arg-type]
    assert msg.usage.output_tokens == 1
    bearer = anthropic.Anthropic(base_url=locked.base_url, auth_token=API_KEY, max_retries=0, timeout=60)
    assert bearer.messages.count_tokens(model=MODEL_NAME, messages=USER).input_tokens > 0  # type: ignore[arg-type]
    with pytest.raises(anthropic.AuthenticationError):
        anthropic_client(locked, api_key="wrong").messages.create(model=MODEL_NAME, max_tokens=1, messages=USER)  # type: ignore[arg-type]


# ---------------------------------------------------------------- bad input

BAD_TOOL_NO_NAME = {"type": "function", "function": {"description": "x", "parameters": {"type": "object"}}}
BAD_TOOL_PARAMS = {"type": "function", "function": {"name": "f", "parameters": "not a schema"}}
IMAGE_URL = "data:image/png;base64,iVBORw0KGgo="

BAD_REQUESTS: list[tuple[str, str, Any, int]] = [
    # (id, path, body (bytes = raw), status)
    ("chat-malformed-json", CHAT, b'{"messages": [', 400),
    ("chat-not-an-object", CHAT, b"[1, 2]", 400),
    ("chat-messages-string", CHAT, {"messages": "hi"}, 400),
    ("chat-temperature-hot", CHAT, {"messages": USER, "temperature": "hot"}, 400),
    ("chat-max-tokens-negative", CHAT, {"messages": USER, "max_tokens": -1}, 400),
    ("chat-unknown-model", CHAT, {"model": "gpt-17", "messages": USER}, 404),
    ("chat-empty-messages", CHAT, {"messages": []}, 400),
    ("chat-huge-max-tokens", CHAT, {"messages": USER, "max_tokens": 10**7}, 400),
    ("chat-tool-without-name", CHAT, {"messages": USER, "tools": [BAD_TOOL_NO_NAME]}, 400),
    ("chat-tool-params-not-object", CHAT, {"messages": USER, "tools": [BAD_TOOL_PARAMS]}, 400),
    ("chat-tool-properties-list", CHAT, {"messages": USER, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": ["a"]}}}]}, 400),
    ("chat-tool-choice-unknown", CHAT, {"messages": USER, "tools": chat_tools("get_weather"),
                                        "tool_choice": {"type": "function", "function": {"name": "nope"}}}, 400),
    ("chat-tool-choice-required-no-tools", CHAT, {"messages": USER, "tool_choice": "required"}, 400),
    ("chat-image", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this"}, {"type": "image_url", "image_url": {"url": IMAGE_URL}}]}]}, 400),
    ("chat-bad-role", CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400),
    ("chat-stop-number", CHAT, {"messages": USER, "stop": 5}, 400),
    ("chat-n-2", CHAT, {"messages": USER, "n": 2}, 400),
    ("chat-template-kwargs-list", CHAT, {"messages": USER, "max_tokens": 2, "chat_template_kwargs": [1]}, 400),
    ("chat-tool-calls-number", CHAT, {"messages": [*USER, {"role": "assistant", "content": "x", "tool_calls": 5},
                                                   {"role": "user", "content": "go"}], "max_tokens": 2}, 400),
    ("messages-malformed-json", MESSAGES, b"{not json", 400),
    ("messages-messages-string", MESSAGES, {"messages": "hi", "max_tokens": 4}, 400),
    ("messages-temperature-hot", MESSAGES, {"messages": USER, "max_tokens": 4, "temperature": "hot"}, 400),
    ("messages-max-tokens-negative", MESSAGES, {"messages": USER, "max_tokens": -1}, 400),
    ("messages-unknown-model", MESSAGES, {"model": "claude-9", "messages": USER, "max_tokens": 4}, 404),
    ("messages-empty", MESSAGES, {"messages": [], "max_tokens": 4}, 400),
    ("messages-huge-max-tokens", MESSAGES, {"messages": USER, "max_tokens": 10**7}, 400),
    ("messages-tool-without-name", MESSAGES, {"messages": USER, "max_tokens": 4,
                                              "tools": [{"input_schema": {"type": "object"}}]}, 400),
    ("messages-tool-schema-not-object", MESSAGES, {"messages": USER, "max_tokens": 4,
                                                   "tools": [{"name": "f", "input_schema": "nope"}]}, 400),
    ("messages-tool-choice-unknown", MESSAGES, {"messages": USER, "max_tokens": 4,
                                                "tools": [{"name": "f", "input_schema": {"type": "object"}}],
                                                "tool_choice": {"type": "tool", "name": "g"}}, 400),
    ("messages-image", MESSAGES, {"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}],
        "max_tokens": 4}, 400),
    ("messages-image-in-tool-result", MESSAGES, {"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]}],
        "max_tokens": 4}, 400),
    ("messages-bad-role", MESSAGES, {"messages": [{"role": "tool", "content": "x"}], "max_tokens": 4}, 400),
    ("count-malformed-json", COUNT, b"{", 400),
    ("count-messages-string", COUNT, {"messages": "hi"}, 400),
    ("responses-malformed-json", RESPONSES, b"nope", 400),
    ("responses-input-number", RESPONSES, {"input": 5}, 400),
    ("responses-temperature-hot", RESPONSES, {"input": "hi", "temperature": "hot"}, 400),
    ("responses-max-output-negative", RESPONSES, {"input": "hi", "max_output_tokens": -1}, 400),
    ("responses-unknown-model", RESPONSES, {"model": "gpt-17", "input": "hi"}, 404),
    ("responses-empty-input", RESPONSES, {"input": []}, 400),
    ("responses-huge-max-output", RESPONSES, {"input": "hi", "max_output_tokens": 10**7}, 400),
    ("responses-tool-without-name", RESPONSES, {"input": "hi", "tools": [{"type": "function", "parameters": {}}]}, 400),
    ("responses-tool-params-not-object", RESPONSES, {"input": "hi", "tools": [
        {"type": "function", "name": "f", "parameters": [1]}]}, 400),
    ("responses-tool-choice-unknown", RESPONSES, {"input": "hi", "tools": [
        {"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "g"}}, 400),
    ("responses-image", RESPONSES, {"input": [{"type": "message", "role": "user", "content": [
        {"type": "input_image", "image_url": IMAGE_URL}]}]}, 400),
    ("responses-instructions-number", RESPONSES, {"input": "hi", "instructions": 7}, 400),
]


@pytest.mark.parametrize(("path", "body", "status"), [b[1:] for b in BAD_REQUESTS], ids=[b[0] for b in BAD_REQUESTS])
def test_bad_request_answered_in_protocol_shape(q35: ServerProcess, path: str, body: Any, status: int) -> None:
    if isinstance(body, bytes):
        r = httpx.post(q35.url(path), content=body, headers={"content-type": "application/json"}, timeout=30)
    else:
        r = httpx.post(q35.url(path), json=body, timeout=30)
    if path.startswith("/v1/messages"):
        err = assert_anthropic_error(r, status)
        assert err["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    else:
        err = assert_openai_error(r, status)
        if status == 404:
            assert err["code"] == "model_not_found"
    assert "internal error" not in err["message"]
    assert_alive(q35)


@pytest.mark.parametrize("path", [CHAT, MESSAGES, RESPONSES])
def test_malformed_tool_arguments_in_history_are_not_a_server_error(family_server: ServerProcess, path: str) -> None:
    """A client echoing a call whose arguments are not a JSON object (a truncated call, a list) gets
    an answer (or a 400), never a 500."""
    if path == CHAT:
        body: dict[str, Any] = {"max_tokens": 2, "messages": [*USER, {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": tru"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}
    elif path == MESSAGES:
        body = {"max_tokens": 2, "messages": [*USER, {"role": "assistant", "content": [
            {"type": "tool_use", "id": "t1", "name": "f", "input": [1, 2]}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]}]}
    else:
        body = {"max_output_tokens": 2, "input": [{"type": "message", "role": "user", "content": "hi"},
                                                  {"type": "function_call", "call_id": "c1", "name": "f",
                                                   "arguments": "{\"a\": tru"},
                                                  {"type": "function_call_output", "call_id": "c1", "output": "ok"}]}
    r = httpx.post(family_server.url(path), json=body, timeout=60)
    assert r.status_code in (200, 400), r.text
    assert_alive(family_server)


def test_seed_out_of_range_is_refused_not_hung(q35: ServerProcess) -> None:
    """A seed torch cannot take (>= 2**64) must be a 400, not a request that never answers."""
    try:
        r = httpx.post(q35.url(CHAT), json={"messages": USER, "max_tokens": 2, "temperature": 1.0, "seed": 2**64},
                       timeout=5)
    except httpx.ReadTimeout:
        pytest.fail("no answer within 5 s: the engine thread died on torch.Generator().manual_seed(2**64)")
    finally:
        assert_alive(q35)
    assert_openai_error(r, 400)


def test_bad_stream_options_refused_without_leaking_a_generation(endless: ServerProcess) -> None:
    r = httpx.post(endless.url(CHAT), json={"messages": USER, "max_tokens": 200, "stream": True,
                                        "stream_options": "yes"}, timeout=30)
    try:
        assert_openai_error(r, 400)
        assert wait_idle(endless, 2.0) < 2.0, "the refused request's generation is still running"
    finally:
        wait_idle(endless, 60.0)


# ---------------------------------------------------------------- context window (server started with 256)


def test_context_overflow_openai(locked: ServerProcess) -> None:
    client = openai_client(locked)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "word " * 400}],
                                       max_tokens=4)
    assert info.value.code == "context_length_exceeded"
    m = TOO_LONG_RE.search(str(info.value.message))
    assert m and int(m.group(1)) > int(m.group(2)) == SMALL_CONTEXT - 1
    r = httpx.post(locked.url(RESPONSES), json={"input": "word " * 400}, headers=locked.headers(), timeout=30)
    assert assert_openai_error(r, 400)["code"] == "context_length_exceeded"
    assert_alive(locked)


def test_context_overflow_anthropic_sdk(locked: ServerProcess) -> None:
    with pytest.raises(anthropic.BadRequestError) as info:
        anthropic_client(locked).messages.create(model=MODEL_NAME, max_tokens=4,
                                                 messages=[{"role": "user", "content": "word " * 400}])
    m = TOO_LONG_RE.search(str(info.value.message))
    assert m and int(m.group(2)) == SMALL_CONTEXT - 1
    # counting an over-long prompt is not an error: that is how clients measure it
    n = anthropic_client(locked).messages.count_tokens(model=MODEL_NAME,
                                                       messages=[{"role": "user", "content": "word " * 400}])
    assert n.input_tokens == int(m.group(1))


@pytest.mark.parametrize(("path", "field"), [(CHAT, "max_tokens"), (MESSAGES, "max_tokens"),
                                             (RESPONSES, "max_output_tokens")])
def test_max_tokens_over_context_window(locked: ServerProcess, path: str, field: str) -> None:
    r = httpx.post(locked.url(path), json={"messages": USER, "input": "hi", field: SMALL_CONTEXT + 1},
                   headers=locked.headers(), timeout=30)
    if path == MESSAGES:
        assert_anthropic_error(r, 400)
    else:
        assert_openai_error(r, 400)
    ok = httpx.post(locked.url(path), json={"messages": USER, "input": "hi", field: 2}, headers=locked.headers(),
                    timeout=60)
    assert ok.status_code == 200, ok.text


# ---------------------------------------------------------------- disconnects


STREAM_BODIES: dict[str, dict[str, Any]] = {
    CHAT: {"messages": [{"role": "user", "content": "Talk for a long time."}], "max_tokens": 3000, "stream": True},
    MESSAGES: {"messages": [{"role": "user", "content": "Talk for a long time."}], "max_tokens": 3000, "stream": True},
    RESPONSES: {"input": "Talk for a long time.", "max_output_tokens": 3000, "stream": True},
}


@pytest.mark.parametrize("path", list(STREAM_BODIES))
def test_stream_disconnect_frees_the_slot(endless: ServerProcess, path: str) -> None:
    """Closing the connection mid-stream aborts the generation at once. Repeated, with unread data
    left in the client's buffer (as when a user interrupts an agent): when the cleanup waits for the
    abandoned response generator to be garbage-collected, some rounds lag by seconds."""
    delays = []
    for round_ in range(5):
        assert wait_idle(endless, 120) < 120
        with httpx.Client(timeout=60) as client, \
                client.stream("POST", endless.url(path), json=STREAM_BODIES[path]) as r:
            assert r.status_code == 200
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith("data:")
                if seen == 6 + round_:
                    assert endless.health()["running"] == 1
                    break  # leaving the line iterator closes the connection
        delays.append(wait_idle(endless, 2.0))
    wait_idle(endless, 120)
    assert all(d < 2.0 for d in delays), f"seconds until the slot was freed, per round: {delays}"
    assert endless.metrics()["freetoken_request_kv_tokens"] == 0, "KV of abandoned streams is still held"
    assert_alive(endless)


def test_nonstream_disconnect_frees_the_slot(endless: ServerProcess) -> None:
    assert wait_idle(endless, 30) < 30
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(endless.url(CHAT), json={"messages": [{"role": "user", "content": "Go on and on."}],
                                        "max_tokens": 150}, timeout=0.8)
    try:
        assert wait_idle(endless, 2.0) < 2.0, "a non-streaming generation kept running after its client left"
    finally:
        wait_idle(endless, 120)
    assert endless.metrics()["freetoken_request_kv_tokens"] == 0, "KV of the abandoned request is still held"
    assert_alive(endless)


# ---------------------------------------------------------------- joining and concurrency


async def _stream_deltas(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    async with client.stream("POST", url, json=body) as r:
        assert r.status_code == 200
        lines = [line async for line in r.aiter_lines()]
    return [e.json()["choices"][0]["delta"] for e in parse_sse(lines)
            if not e.comment and e.data != "[DONE]" and e.json().get("choices")]


def test_duplicate_streaming_requests_are_joined(endless: ServerProcess) -> None:
    body = {"messages": [{"role": "user", "content": f"Join test on {endless.name}"}], "max_tokens": 40,
            "stream": True}
    joined_before = _metric(endless, "freetoken_joined_requests_total")

    async def both() -> list[list[dict[str, Any]]]:
        async with httpx.AsyncClient(timeout=120) as client:
            return list(await asyncio.gather(*[_stream_deltas(client, endless.url(CHAT), body)
                                               for _ in range(2)]))

    a, b = asyncio.run(both())
    assert a == b and len(a) > 1
    assert _metric(endless, "freetoken_joined_requests_total") == joined_before + 1
    solo = httpx.post(endless.url(CHAT), json={**body, "stream": False}, timeout=60).json()
    msg = solo["choices"][0]["message"]
    assert "".join(d.get("reasoning_content") or "" for d in a) == (msg.get("reasoning_content") or "")
    assert "".join(d.get("content") or "" for d in a) == (msg["content"] or "")


def test_four_different_requests_at_once(endless: ServerProcess) -> None:
    """Chat, streamed chat, Anthropic and Responses together: each equals its run alone (greedy)."""
    prompts = ["first prompt about rivers", "second prompt about mountains", "third about seas", "fourth about sky"]

    async def run_all() -> list[str]:
        oa, an = async_openai_client(endless), async_anthropic_client(endless)

        async def chat(p: str) -> str:
            r = await oa.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": p}],
                                                 max_tokens=16, reasoning_effort="none")  # type: ignore[arg-type]
            return r.choices[0].message.content or ""

        async def chat_stream(p: str) -> str:
            s = await oa.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": p}],
                                                 max_tokens=16, reasoning_effort="none", stream=True)  # type: ignore[arg-type]
            return "".join([c.choices[0].delta.content or "" async for c in s if c.choices])

        async def messages(p: str) -> str:
            m = await an.messages.create(model=MODEL_NAME, max_tokens=16, messages=[{"role": "user", "content": p}])
            return "".join(b.text for b in m.content if b.type == "text")

        async def responses(p: str) -> str:
            r = await oa.responses.create(model=MODEL_NAME, input=p, max_output_tokens=16,
                                          reasoning={"effort": "none"})  # type: ignore[typeddict-item]
            return r.output_text

        calls = [chat(prompts[0]), chat_stream(prompts[1]), messages(prompts[2]), responses(prompts[3])]
        return list(await asyncio.gather(*calls))

    together = asyncio.run(run_all())
    alone = []
    for path, p in [(CHAT, prompts[0]), (CHAT, prompts[1])]:
        r = httpx.post(endless.url(path), json={"messages": [{"role": "user", "content": p}], "max_tokens": 16,
                                            "reasoning_effort": "none"}, timeout=60).json()
        alone.append(r["choices"][0]["message"]["content"])
    m = httpx.post(endless.url(MESSAGES), json={"messages": [{"role": "user", "content": prompts[2]}],
                                            "max_tokens": 16}, timeout=60).json()
    alone.append("".join(b["text"] for b in m["content"] if b["type"] == "text"))
    r = httpx.post(endless.url(RESPONSES), json={"input": prompts[3], "max_output_tokens": 16,
                                             "reasoning": {"effort": "none"}}, timeout=60).json()
    alone.append("".join(c["text"] for i in r["output"] if i["type"] == "message" for c in i["content"]))
    assert all(together), together
    assert together == alone
