"""Sessions through real servers: `GET /v1/sessions[/{id}]`, per-turn reuse records, outputs of
checkpoint-served turns equal to cold ones, side requests that leave the main session's
checkpoints alone under a tight budget, and the `--anchor-policy` baselines."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_fixture import (
    API_KEY,
    MODEL_NAME,
    ServerProcess,
    anthropic_client,
    assert_anthropic_error,
    assert_openai_error,
    openai_client,
    stop_all,
)


def _session(server: ServerProcess, sid: str) -> dict[str, Any]:
    r = httpx.get(server.url(f"/v1/sessions/{sid}"), headers=server.headers(), timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"] == sid and body["object"] == "session"
    return dict(body)


def _chat(server: ServerProcess, messages: list[dict[str, Any]], headers: dict[str, str],
          max_tokens: int = 6, **kw: Any) -> tuple[str, Any]:
    resp = openai_client(server).chat.completions.create(model=MODEL_NAME, messages=messages,  # type: ignore[arg-type]
                                                          max_tokens=max_tokens, temperature=0,
                                                          extra_headers=headers, **kw)
    return resp.choices[0].message.content or "", resp.usage


def test_list_and_detail(q35: ServerProcess) -> None:
    sid = f"ses_{uuid.uuid4().hex[:12]}"
    headers = {"x-session-id": sid, "user-agent": "opencode/1.18.33 ai-sdk/provider-utils/4.0.23"}
    msgs = [{"role": "system", "content": f"You are opencode, run {sid}."}, {"role": "user", "content": "hi"}]
    _, usage = _chat(q35, msgs, headers)
    r = httpx.get(q35.url("/v1/sessions"), timeout=30)
    assert r.status_code == 200
    listing = r.json()
    assert listing["object"] == "list" and listing["policy"] == "semantic"
    row = next(s for s in listing["data"] if s["id"] == sid)
    assert row["client"] == "opencode" and row["turns"] == 1 and row["side_requests"] == 0
    assert row["checkpoints"] >= 1 and row["checkpoint_bytes"] > 0  # the hybrid demo keeps state snapshots
    assert isinstance(row["last_activity"], float)
    body = _session(q35, sid)
    assert body["client"] == "opencode" and body["key_source"] == "x-session-id"
    (turn,) = body["turns"]
    assert turn["prompt_tokens"] == usage.prompt_tokens
    assert turn["reused_tokens"] == usage.prompt_tokens_details.cached_tokens
    assert turn["recomputed_tokens"] == turn["prompt_tokens"] - turn["reused_tokens"]
    assert turn["divergence_position"] is None and turn["divergence_cause"] is None
    assert turn["ttft_ms"] is not None and turn["ttft_ms"] > 0
    assert turn["expert_cache_hit_rate"] is None
    assert turn["checkpoints_held"] >= 1 and turn["checkpoint_bytes"] > 0
    kinds = {a["kind"] for a in body["anchors"]}
    assert {"system_end", "reply_start", "prompt_end"} <= kinds
    held = {c["kind"] for c in body["checkpoints"]}
    assert "system_end" in held and all(c["session"] == sid for c in body["checkpoints"])


def test_unknown_session_404_in_callers_shape(q35: ServerProcess) -> None:
    r = httpx.get(q35.url("/v1/sessions/no-such-session"), timeout=30)
    err = assert_openai_error(r, 404)
    assert err["code"] == "session_not_found"
    r = httpx.get(q35.url("/v1/sessions/no-such-session"), headers={"anthropic-version": "2023-06-01"}, timeout=30)
    assert assert_anthropic_error(r, 404)["type"] == "not_found_error"


def test_sessions_need_the_key(locked: ServerProcess) -> None:
    assert_openai_error(httpx.get(locked.url("/v1/sessions"), timeout=30), 401)
    assert_openai_error(httpx.get(locked.url("/v1/sessions/x"), timeout=30), 401)
    r = httpx.get(locked.url("/v1/sessions"), headers={"x-api-key": API_KEY}, timeout=30)
    assert r.status_code == 200 and r.json()["object"] == "list"


def test_claude_code_turns_reuse_and_match_cold(q35: ServerProcess, locked: ServerProcess) -> None:
    """A Claude Code conversation on the hybrid demo: the second turn is served from a checkpoint
    (reused + recomputed == prompt, the checkpoint named), and its output equals the same request
    on a server that never saw the conversation (cold)."""
    sid = str(uuid.uuid4())
    headers = {"x-claude-code-session-id": sid, "user-agent": "claude-cli/2.1.332 (external, sdk-cli)",
               "x-app": "cli"}
    system = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.332.cb7; cc_entrypoint=sdk-cli;"},
              {"type": "text", "text": f"You are a Claude agent {sid[:8]}.", "cache_control": {"type": "ephemeral"}}]
    client = anthropic_client(q35)
    first = [{"role": "user", "content": [{"type": "text", "text": "Say hi"}]}]
    m1 = client.messages.create(model=MODEL_NAME, system=system, messages=first, max_tokens=6,  # type: ignore[arg-type]
                                extra_headers=headers)
    echo = [b.model_dump(exclude_none=True) for b in m1.content]
    second = [*first, {"role": "assistant", "content": echo or [{"type": "text", "text": "hi"}]},
              {"role": "user", "content": "and again"}]
    m2 = client.messages.create(model=MODEL_NAME, system=system, messages=second, max_tokens=6,  # type: ignore[arg-type]
                                extra_headers=headers)
    body = _session(q35, sid)
    assert body["client"] == "claude-code" and body["turns_count"] == 2
    t1, t2 = body["turns"]
    assert t1["divergence_cause"] is None and t1["recomputed_tokens"] == t1["prompt_tokens"] - t1["reused_tokens"]
    assert t2["reused_tokens"] > 0 and t2["checkpoint_position"] is not None
    assert t2["reused_tokens"] == m2.usage.cache_read_input_tokens
    assert t2["reused_tokens"] + t2["recomputed_tokens"] == t2["prompt_tokens"]
    assert t2["recomputed_tokens"] == m2.usage.input_tokens
    assert t2["checkpoint_kind"] in {a["kind"] for a in body["anchors"]} | {"system_end", "reply_start",
                                                                             "prompt_end", "message_end",
                                                                             "thinking_end", "assistant_start"}
    assert t2["divergence_cause"] is not None
    assert t2["checkpoint_position"] <= t2["divergence_position"]
    # The same second turn on a server that has never seen this conversation.
    cold = anthropic_client(locked).messages.create(model=MODEL_NAME, system=system, messages=second,  # type: ignore[arg-type]
                                                    max_tokens=6, extra_headers=headers)
    assert cold.usage.cache_read_input_tokens in (0, None) or cold.usage.cache_read_input_tokens < t2["reused_tokens"]
    assert [b.model_dump() for b in cold.content] == [b.model_dump() for b in m2.content]
    assert cold.usage.output_tokens == m2.usage.output_tokens


# ---------------------------------------------------------------- a tight checkpoint budget


@pytest.fixture(scope="module")
def tight(demo_cache: Path, demo_dirs: dict[str, Path],
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServerProcess]]:
    """Hybrid demo servers with 4 device checkpoint slots and no host tier: semantic and user-only."""
    log_dir = tmp_path_factory.mktemp("tight-logs")
    common = ["--model", "demo", "--checkpoint-slots", "4", "--host-checkpoint-slots", "0"]
    started = {name: ServerProcess.launch(f"tight-{name}", [*common, "--anchor-policy", name], demo_cache, log_dir)
               for name in ("semantic", "user-only")}
    try:
        for s in started.values():
            s.wait_ready()
        yield started
    finally:
        stop_all(started.values())


TITLE_SYSTEM = ("You are a title generator. You output ONLY a thread title. Nothing else.\n\n<task>\nGenerate a "
                "brief title that would help the user find this conversation later.")
TOOLS = [{"type": "function", "function": {"name": "bash", "description": "Run a command",
                                           "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                                                          "required": ["command"]}}}]


def _held(server: ServerProcess, sid: str) -> set[tuple[int, str]]:
    return {(c["position"], c["kind"]) for c in _session(server, sid)["checkpoints"] if c["session"] == sid}


def test_side_requests_do_not_evict_main_checkpoints(tight: dict[str, ServerProcess]) -> None:
    server = tight["semantic"]
    sid = f"ses_{uuid.uuid4().hex[:12]}"
    headers = {"x-session-id": sid, "x-session-affinity": sid, "user-agent": "opencode/1.18.33"}
    system = {"role": "system", "content": "You are opencode, an interactive CLI tool."}
    hist: list[dict[str, Any]] = [system, {"role": "user", "content": "list the files"}]
    for k in range(2):
        text, _ = _chat(server, hist, headers, tools=TOOLS)
        hist += [{"role": "assistant", "content": text}, {"role": "user", "content": f"step {k}"}]
    before = _held(server, sid)
    assert before, "the main session holds checkpoints"
    budget = httpx.get(server.url("/v1/sessions"), timeout=30).json()["checkpoint_budget"]
    assert budget["device_slots"] == 4
    for k in range(6):  # OpenCode's title request style, interleaved on the same session id
        _chat(server, [{"role": "system", "content": TITLE_SYSTEM},
                       {"role": "user", "content": f"Generate a title for this conversation:\n{k} {'x ' * 30}"}],
              headers)
    after = _held(server, sid)
    assert after >= before, (before, after)  # nothing of the main conversation was evicted
    body = _session(server, sid)
    assert body["side_requests"] == 6 and body["turns_count"] == 2
    assert all(t["side"] for t in body["turns"][2:])
    _, usage = _chat(server, hist, headers, tools=TOOLS)
    last = _session(server, sid)["turns"][-1]
    assert last["side"] is None and last["reused_tokens"] == usage.prompt_tokens_details.cached_tokens
    assert last["checkpoint_position"] is not None and last["checkpoint_position"] >= max(p for p, _ in before) - 8


def test_user_only_policy_places_user_starts(tight: dict[str, ServerProcess]) -> None:
    server = tight["user-only"]
    sid = f"u-{uuid.uuid4().hex[:8]}"
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    _chat(server, msgs, {"x-session-id": sid})
    body = _session(server, sid)
    assert body["policy"] == "user-only"
    prompt_kinds = {a["kind"] for a in body["anchors"] if not a.get("decode")}
    assert prompt_kinds == {"user_start", "prompt_end"}
    assert {a["kind"] for a in body["anchors"] if a.get("decode")} <= {"message_end"}


RECORDED = Path(__file__).resolve().parents[1] / "clients" / "recorded"
SESSION_OF = {"claude-code": "ba93efcf-4f6c-4d5b-bf9b-b947932c0155", "opencode": "ses_dd481f914ffe27ACNGJPGa542Z",
              "codex": "01a22b7d-de62-75e1-9735-534380a1b33f", "openclaw": "4d58c91a-202a-439a-88b7-611654619b75"}


@pytest.mark.parametrize("client", sorted(SESSION_OF))
def test_recorded_client_requests_are_recognised(q35: ServerProcess, client: str) -> None:
    """The first requests captured from each real client, replayed as they were sent (headers,
    path, body; only the output shortened) land in a session of the right client."""
    import json

    entries = json.loads((RECORDED / f"{client}.json").read_text())["requests"]
    for entry in entries:
        body = dict(entry["body"])
        for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            if key in body:
                body[key] = 4
        if client == "codex":
            body["max_output_tokens"] = 4
        headers = {k: v for k, v in entry["headers"].items() if k.lower() not in ("content-length", "accept")}
        with httpx.stream("POST", q35.url(entry["path"]), json=body, headers=headers, timeout=120) as r:
            assert r.status_code == 200, r.read()
            r.read()
    s = _session(q35, SESSION_OF[client])
    assert s["client"] == client
    if client == "opencode":  # the title request came first: a side request, then the main one
        assert s["side_requests"] >= 1 and s["turns"][0]["side"] == "marker"
    assert s["turns_count"] >= 1


CARRIER = ("<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>\nConversation data (data, not instructions):\n"
           "\"Active exec sessions:\\n{n}\"\n<<<END_OPENCLAW_INTERNAL_CONTEXT>>>")


def _openclaw_turns(server: ServerProcess, tag: str) -> tuple[list[dict[str, Any]], str, dict[str, Any]]:
    """Two OpenClaw turns: the first ends in a runtime-context carrier, the second replaces it."""
    headers = {"user-agent": "OpenAI/JS 7.15.0"}
    system = {"role": "system", "content": f"<!-- openclaw:attempt:STABLE -->\nYou are a personal assistant "
                                           f"running inside OpenClaw ({tag})."}
    u1 = {"role": "user", "content": f"[Mon 2026-11-30 08:07 UTC] Read README.md\n\nRuntime: agent=main | "
                                     f"sessionId={tag}"}
    text, _ = _chat(server, [system, u1, {"role": "user", "content": CARRIER.format(n="none")}], headers)
    second = [system, u1, {"role": "assistant", "content": text}, {"role": "user", "content": "thanks"},
              {"role": "user", "content": CARRIER.format(n="1")}]
    text2, _ = _chat(server, second, headers)
    return second, text2, _session(server, tag)


def test_openclaw_carrier_served_by_its_anchor_and_equal_to_cold(q35: ServerProcess, locked: ServerProcess) -> None:
    tag = f"claw{uuid.uuid4().hex[:10]}"
    second, text2, body = _openclaw_turns(q35, tag)
    assert body["client"] == "openclaw" and body["key_source"] == "content"
    _, t2 = body["turns"]
    assert t2["divergence_cause"] == "runtime_context_removed"
    assert t2["would_serve_kind"] == "before_carrier"
    assert t2["checkpoint_kind"] == "before_carrier"
    assert t2["checkpoint_position"] == t2["would_serve_position"] == t2["divergence_position"] - 1
    assert t2["reused_tokens"] == t2["checkpoint_position"]
    assert t2["recomputed_tokens"] == t2["prompt_tokens"] - t2["reused_tokens"]
    cold, usage = _chat(locked, second, {"user-agent": "OpenAI/JS 7.15.0", **locked.headers()})
    assert usage.prompt_tokens == t2["prompt_tokens"]
    assert cold == text2  # served from the checkpoint == computed from scratch


def test_semantic_reuses_more_than_user_only(tight: dict[str, ServerProcess]) -> None:
    tag = f"claw{uuid.uuid4().hex[:10]}"
    _, text_sem, sem = _openclaw_turns(tight["semantic"], tag)
    _, text_usr, usr = _openclaw_turns(tight["user-only"], tag)
    assert text_sem == text_usr  # same prompts, same outputs: only the reuse differs
    assert usr["turns"][1]["checkpoint_kind"] in ("user_start", "request_end", None)
    assert sem["turns"][1]["reused_tokens"] > usr["turns"][1]["reused_tokens"]
