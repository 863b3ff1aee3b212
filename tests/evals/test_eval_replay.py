"""`freetoken-agent eval replay` against a real demo server on loopback: a JSONL trace (OpenAI chat
and Anthropic messages, forced replies) through the CLI, the report's per-turn reuse checked
against the server's own `/v1/sessions`, the plots written; `--no-force` replies sampled under a
cap; the project's capture format read; malformed JSONL refused with the line number."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from freetoken_agent.cli import main
from freetoken_agent.eval.replay import baseline_text, load, replay

SYSTEM = "You are a careful assistant. " * 20
TOOLS = [{"type": "function", "function": {"name": "read", "description": "Read a file",
                                           "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                                          "required": ["path"]}}}]


def _trace() -> list[dict[str, Any]]:
    r1 = {"reasoning": "Look at the file.", "content": "", "tool_calls": [{"name": "read",
                                                                           "arguments": {"path": "a.py"}}]}
    r2 = {"reasoning": "Done.", "content": "The file defines f.", "tool_calls": []}
    m1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is in a.py?"}]
    m2 = [*m1, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "read", "arguments": '{"path": "a.py"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "def f():\n    return 1\n"}]
    m3 = [*m2, {"role": "assistant", "content": "The file defines f."}, {"role": "user", "content": "Thanks!"}]
    h = {"x-session-affinity": "replay-test"}
    chat = [{"path": "/v1/chat/completions", "headers": h, "response": r,
             "body": {"model": "x", "stream": True, "max_tokens": 64, "tools": TOOLS, "messages": m}}
            for m, r in ((m1, r1), (m2, r2), (m3, r2))]
    anth = {"path": "/v1/messages", "headers": {"x-claude-code-session-id": "replay-anthropic"},
            "response": {"reasoning": "Short.", "content": "Hello.", "tool_calls": []},
            "body": {"model": "x", "stream": True, "max_tokens": 64, "system": SYSTEM,
                     "messages": [{"role": "user", "content": "Say hello."}]}}
    return [*chat, anth]


def _write(tmp: Path, reqs: list[dict[str, Any]]) -> Path:
    p = tmp / "trace.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in reqs))
    return p


def _sums_match_the_server(server: str, turns: list[dict[str, Any]]) -> int:
    """Per server session, the report's token sums equal the server's own `/v1/sessions` record;
    returns how many sessions the turns went to."""
    by_session: dict[str, list[dict[str, Any]]] = {}
    for t in turns:
        by_session.setdefault(t["server_session"], []).append(t)
    for sid, ts in by_session.items():
        server_turns = httpx.get(f"{server}/v1/sessions/{sid}").json()["turns"]
        assert len(server_turns) == len(ts)
        for key in ("prompt_tokens", "reused_tokens", "recomputed_tokens"):
            assert sum(t[key] for t in ts) == sum(s[key] for s in server_turns), key
    return len(by_session)


def _replay_cli(trace: Path, server: str, out: Path) -> dict[str, Any]:
    """`freetoken-agent eval replay TRACE --base-url SERVER` (the demo tokenizer counting); its result.json."""
    assert main(["eval", "replay", str(trace), "--base-url", server, "--tokenizer", "demo", "--out", str(out)]) == 0
    result: dict[str, Any] = json.loads((out / "result.json").read_text())
    return result


def test_replay_cli_reports_what_the_server_saw(demo_server: str, tmp_path: Path) -> None:
    trace = _write(tmp_path, _trace())
    out = tmp_path / "out"
    result = _replay_cli(trace, demo_server, out)
    turns = result["turns"]
    assert [t["status"] for t in turns] == [200] * 4
    assert result["server_sessions"] is True and result["forced"] is True
    # the forced reply came back: the first turn's tool call is one of the generated tokens
    assert all(t["completion_tokens"] and t["ttft_ms"] > 0 for t in turns)
    chat = turns[:3]
    assert chat[0]["reused_tokens"] == 0
    for t in chat[1:]:  # the later turns extend the first: most of their prompt is reused
        assert t["reused_tokens"] > t["recomputed_tokens"] > 0
        assert t["truly_new_tokens"] <= t["recomputed_tokens"] <= t["truly_new_tokens"] + 8
    # per server session, the report's sums are the server's own
    assert _sums_match_the_server(demo_server, turns) == 2
    run = result["runs"][0]
    assert run["requests"] == 4 and run["failed"] == 0
    assert run["worst_ttft_ms"] == max(t["ttft_ms"] for t in turns)
    # the decode drop is against one single-turn request's decode rate, measured in the same run
    assert result["baseline_decode_tps"] > 0
    assert run["decode_drop"] == round(1 - run["mean_decode_tps"] / result["baseline_decode_tps"], 3)
    md = (out / "report.md").read_text()
    assert "| trace | 0 | 200 |" in md
    causes = {t["divergence_cause"] for t in turns} - {None}
    assert causes and all(f"| {c} |" in md for c in causes)
    for png in ("ttft.png", "tokens.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"


def test_no_force_samples_under_the_cap(demo_server: str, tmp_path: Path) -> None:
    result = replay([load(_write(tmp_path, _trace()[:2]))], demo_server, force=False, max_tokens=5)
    assert result["forced"] is False
    assert [t["status"] for t in result["turns"]] == [200, 200]
    assert all(1 <= t["completion_tokens"] <= 5 for t in result["turns"])
    assert result["turns"][0]["truly_new_tokens"] is None  # no tokenizer given


def test_loads_the_capture_format_and_refuses_bad_lines(tmp_path: Path) -> None:
    data = Path(__file__).resolve().parents[2] / "evals" / "traces" / "data" / "codex.json"
    trace = load(data)
    assert trace.name == "codex" and trace.family == "qwen3_5"
    assert len(trace.requests) == json.loads(data.read_text())["n_requests"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(_trace()[0]) + "\n" + json.dumps({"path": "/v1/messages"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: each line needs"):
        load(bad)


def test_replay_cli_on_a_recorded_trace(demo_server: str, tmp_path: Path) -> None:
    """The CLI on a trace recorded from a real client (evals/traces/data/opencode.json: its title side
    request and first main steps, in the project's capture format): every turn answered, the later
    steps reuse most of their prompt, and per server session the report's sums are the server's own."""
    recorded = json.loads((Path(__file__).resolve().parents[2] / "evals/traces/data/opencode.json").read_text())
    recorded["requests"] = recorded["requests"][:5]
    trace = tmp_path / "opencode.json"
    trace.write_text(json.dumps(recorded))
    out = tmp_path / "out"
    result = _replay_cli(trace, demo_server, out)
    turns = result["turns"]
    assert [t["status"] for t in turns] == [200] * 5
    main_turns = [t for t in turns if t["reused_tokens"] > 0]
    assert len(main_turns) >= 3 and all(t["recomputed_tokens"] < t["prompt_tokens"] // 4 for t in main_turns)
    assert _sums_match_the_server(demo_server, turns) >= 1


def test_the_baseline_decodes_the_traces_own_words(tmp_path: Path) -> None:
    """The single-turn decode baseline forces the traces' reply text (reasoning and content), cut at
    a space to about 64-80 tokens, so the decode drop compares decode of the same kind of text; a
    trace with too little reply text falls back to the default baseline (None)."""
    data = Path(__file__).resolve().parents[2] / "evals" / "traces" / "data" / "opencode.json"
    trace = load(data)
    text = baseline_text([trace])
    assert text is not None and 200 <= len(text) <= 320 and not text.endswith(" ")
    replies = [r["reply"] for r in trace.requests if r.get("reply")]
    words = set(" ".join(str(r.get(k, "")) for r in replies for k in ("reasoning", "content")).split())
    assert set(text.split()[:-1]) <= words  # every whole word is the trace's own
    assert text.split()[0] == str(replies[0].get("reasoning") or replies[0].get("content")).split()[0]
    assert baseline_text([load(_write(tmp_path, _trace()[:1]))]) is None
