"""OpenAI Responses (what Codex speaks) against a real server: the `openai` SDK and raw SSE."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from server_fixture import (
    MODEL_NAME,
    ServerProcess,
    check_arguments,
    openai_client,
    parse_sse,
    responses_tools,
)

CODEX_TOOLS: list[dict[str, Any]] = [
    {"type": "web_search", "search_context_size": "low"},
    {"type": "web_search_preview"},
    {"type": "local_shell"},
    {"type": "custom", "name": "apply_patch", "description": "Apply a patch",
     "format": {"type": "grammar", "syntax": "lark", "definition": "start: \"*** Begin Patch\" /(.|\\n)*/"}},
    {"type": "custom", "name": "freeform", "description": "free text", "format": {"type": "text"}},
    {"type": "file_search", "vector_store_ids": ["vs_1"]},
    {"type": "mcp", "server_label": "x", "server_url": "http://127.0.0.1:1"},
    *responses_tools("get_weather"),
]


def _post(server: ServerProcess, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url("/v1/responses"), json=body, headers=server.headers(), timeout=120)


def _events(server: ServerProcess, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", server.url("/v1/responses"), json={**body, "stream": True}, headers=server.headers(),
                      timeout=120) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = [e for e in parse_sse(r.iter_lines()) if not e.comment]
    out = []
    for e in raw:
        d = e.json()
        assert e.event == d["type"], (e.event, d["type"])
        out.append(d)
    return out


def _check_sequence(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The event grammar of a Responses stream; returns the final response object."""
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"], kinds
    assert kinds[-1] in ("response.completed", "response.incomplete"), kinds
    seq = [e["sequence_number"] for e in events]
    assert seq == list(range(seq[0], seq[0] + len(seq))), seq
    assert all(events[i]["response"]["status"] == "in_progress" for i in (0, 1))
    added: dict[int, dict[str, Any]] = {}
    done: dict[int, dict[str, Any]] = {}
    for e in events[2:-1]:
        t = e["type"]
        if t == "response.output_item.added":
            assert e["output_index"] == len(added)
            assert all(i in done for i in added), "an item was added before the previous one was done"
            added[e["output_index"]] = e["item"]
            assert e["item"]["status"] == "in_progress"
        elif t == "response.output_item.done":
            assert e["output_index"] in added and e["output_index"] not in done
            done[e["output_index"]] = e["item"]
            assert e["item"]["id"] == added[e["output_index"]]["id"]
        else:
            assert "output_index" in e and e["output_index"] in added and e["output_index"] not in done, e
    assert set(added) == set(done)
    final = events[-1]["response"]
    assert final["output"] == [done[i] for i in sorted(done)]
    if kinds[-1] == "response.incomplete":
        assert final["status"] == "incomplete"
        assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    else:
        assert final["status"] == "completed"
    usage = final["usage"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert "cached_tokens" in usage["input_tokens_details"]
    return dict(final)


def test_string_input_sdk_shape(family_server: ServerProcess) -> None:
    client = openai_client(family_server)
    resp = client.responses.create(model=MODEL_NAME, input="Say hi.", max_output_tokens=8, instructions="Be brief.")
    assert resp.object == "response" and resp.model == MODEL_NAME
    assert resp.usage is not None and 1 <= resp.usage.output_tokens <= 8
    cut = resp.usage.output_tokens == 8
    assert resp.status == ("incomplete" if cut else "completed")
    assert (resp.incomplete_details is not None) == cut
    assert all(item.type in ("message", "reasoning") for item in resp.output)


def test_string_input_sdk(endless: ServerProcess) -> None:
    client = openai_client(endless)
    resp = client.responses.create(model=MODEL_NAME, input="Say hi.", max_output_tokens=8,
                                   reasoning={"effort": "none"})  # type: ignore[typeddict-item]
    assert resp.object == "response"
    assert resp.status == "incomplete"
    assert resp.incomplete_details is not None and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage is not None and resp.usage.output_tokens == 8
    assert resp.output and resp.output[0].type == "message"
    assert resp.output_text


def test_reasoning_item_when_thinking(endless: ServerProcess) -> None:
    resp = _post(endless, {"model": MODEL_NAME, "input": "Think.", "max_output_tokens": 6,
                       "reasoning": {"effort": "medium", "summary": "auto"}}).json()
    assert resp["output"][0]["type"] == "reasoning"
    assert resp["output"][0]["content"][0]["text"]


def test_stream_event_sequence(family_server: ServerProcess) -> None:
    events = _events(family_server, {"model": MODEL_NAME, "input": "Stream something.", "max_output_tokens": 8})
    final = _check_sequence(events)
    assert (events[-1]["type"] == "response.incomplete") == (final["usage"]["output_tokens"] == 8)


@pytest.mark.parametrize("effort", ["none", "medium"])
def test_stream_event_sequence_incomplete(endless: ServerProcess, effort: str) -> None:
    events = _events(endless, {"model": MODEL_NAME, "input": "Stream something.", "max_output_tokens": 8,
                               "reasoning": {"effort": effort}})
    final = _check_sequence(events)
    assert events[-1]["type"] == "response.incomplete"
    assert final["usage"]["output_tokens"] == 8
    kind = "response.output_text.delta" if effort == "none" else "response.reasoning_text.delta"
    assert [e for e in events if e["type"] == kind]
    assert [i["type"] for i in final["output"]] == ["message" if effort == "none" else "reasoning"]


def test_stream_sdk_events(q3: ServerProcess) -> None:
    client = openai_client(q3)
    stream = client.responses.create(model=MODEL_NAME, input="Hello", max_output_tokens=6, stream=True)
    events = list(stream)
    assert events[0].type == "response.created"
    assert events[-1].type in ("response.completed", "response.incomplete")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = [e.text for e in events if e.type == "response.output_text.done"]
    assert done == ([text] if text else [])


def test_item_input_with_calls_outputs_and_reasoning(family_server: ServerProcess) -> None:
    """A Codex history: developer prompt, reasoning with encrypted content, calls and their outputs."""
    body = {
        "model": MODEL_NAME, "instructions": "", "max_output_tokens": 4, "store": False, "stream": False,
        "tools": CODEX_TOOLS, "tool_choice": "auto", "parallel_tool_calls": True,
        "reasoning": {"effort": "low", "summary": "auto"}, "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "session-123", "text": {"verbosity": "low"},
        "client_metadata": {"x": "y"},
        "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "You are Codex."}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "Need the tool."}],
             "content": None, "encrypted_content": "gAAAAB..."},
            {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
             "arguments": "{\"city\":\"Paris\",\"unit\":\"celsius\"}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
            {"type": "custom_tool_call", "id": "ctc_1", "call_id": "call_2", "name": "apply_patch",
             "input": "*** Begin Patch\n*** End Patch"},
            {"type": "custom_tool_call_output", "call_id": "call_2", "output": "Done"},
            {"type": "local_shell_call", "id": "lsc_1", "call_id": "call_3", "status": "completed",
             "action": {"type": "exec", "command": ["ls"]}},
            {"type": "local_shell_call_output", "id": "call_3", "output": "a.py"},
            {"type": "web_search_call", "id": "ws_1", "status": "completed",
             "action": {"type": "search", "query": "x"}},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "It is sunny."}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Thanks."}]},
        ],
    }
    r = _post(family_server, body)
    assert r.status_code == 200, r.text
    assert 1 <= r.json()["usage"]["output_tokens"] <= 4


def test_non_function_tools_tolerated_when_streaming(q35: ServerProcess) -> None:
    events = _events(q35, {"model": MODEL_NAME, "input": "hi", "max_output_tokens": 4, "tools": CODEX_TOOLS,
                           "tool_choice": {"type": "custom", "name": "apply_patch"}})
    _check_sequence(events)


def test_tool_choice_required_gives_function_call(family_server: ServerProcess) -> None:
    events = _events(family_server, {"model": MODEL_NAME, "input": "Weather in Paris?", "max_output_tokens": 64,
                                     "tools": CODEX_TOOLS, "tool_choice": "required"})
    final = _check_sequence(events)
    calls = [i for i in final["output"] if i["type"] == "function_call"]
    assert calls, final["output"]
    complete = calls if final["status"] == "completed" else calls[:-1]
    for call in complete:
        assert call["call_id"] and call["id"] and call["name"] == "get_weather"
        check_arguments("get_weather", json.loads(call["arguments"]))
    if final["status"] == "completed":
        assert all(i["type"] == "function_call" for i in final["output"])


@pytest.mark.parametrize("name", ["q35", "q3"])
def test_single_forced_function_call_completes(servers: dict[str, ServerProcess], name: str) -> None:
    family_server = servers[name]
    resp = _post(family_server, {"model": MODEL_NAME, "input": "Weather in Paris?", "max_output_tokens": 64,
                                 "tools": responses_tools("get_weather"), "parallel_tool_calls": False,
                                 "tool_choice": {"type": "function", "name": "get_weather"}}).json()
    calls = [i for i in resp["output"] if i["type"] == "function_call"]
    assert resp["status"] == "completed", resp
    assert len(calls) == 1, resp["output"]
    assert calls[0]["call_id"]
    check_arguments("get_weather", json.loads(calls[0]["arguments"]))


def test_previous_response_id_refused(q35: ServerProcess) -> None:
    client = openai_client(q35)
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL_NAME, input="again", previous_response_id="resp_123", max_output_tokens=4)
    assert info.value.status_code == 400
    body = info.value.body
    assert isinstance(body, dict) and body.get("param") == "previous_response_id"
