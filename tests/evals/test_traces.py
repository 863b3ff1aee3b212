"""Traces and replay: the sanitiser, forced output through every protocol, the scripted plan, and a
replay of a stored trace against a real server on loopback.

Servers are real `freetoken-agent serve` processes (the Qwen3.5 and Qwen3 demo models; the Qwen3.5
one is the evals' session-wide `demo_server`, tests/evals/conftest.py) talked to by
the openai and anthropic SDKs; nothing here is mocked.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from adapters.common import FORCED_OUTPUT_FIELD  # noqa: E402
from evals.traces import replay as rp  # noqa: E402
from evals.traces.sanitise import Sanitiser  # noqa: E402
from evals.traces.script import PLAN, PROMPTS, Call, Reply, Script, render  # noqa: E402
from evals.traces.scripted import normalise  # noqa: E402

DATA = REPO / "evals" / "traces" / "data"
MODEL = "freetoken-demo"
READ_TOOL = {"name": "read_file", "description": "Read a file",
             "parameters": {"type": "object", "properties": {"path": {"type": "string"},
                                                             "limit": {"type": "integer"}},
                            "required": ["path"]}}
FORCED_CALL = Reply(reasoning="I need to see the file first.", calls=[Call("read_file", {"path": "src/a.py",
                                                                                          "limit": 20})])


@pytest.fixture(scope="module")
def servers(demo_server: str) -> Iterator[dict[str, str]]:
    """One server per model family: qwen3_5 (hybrid, XML tool calls; the evals' shared demo server)
    and qwen3 (JSON tool calls)."""
    with rp.started_server(["--model", "demo:qwen3_moe"]) as q3:
        yield {"qwen3_5": demo_server, "qwen3": q3}


# ------------------------------------------------------------------------------------ sanitiser
def test_sanitiser_removes_paths_keys_and_ids() -> None:
    san = Sanitiser({"/tmp/fttrace-x_1/work": "/tmp/ftwork", "/home/alice": "/home/user"}, secrets=["hunter2-secret"])
    raw = {
        "system": "cwd /tmp/fttrace-x_1/work; memory at /root/.claude/projects/-tmp-fttrace-x-1-work/m",
        "key": "Authorization: Bearer abcdefgh12345678 and sk-ant-api03-ZZZZZZZZZZ and sk-live-1234567890",
        "secret": "pw=hunter2-secret", "home": "/home/alice/.config/opencode",
        "ids": ["550e8400-e29b-41d4-a716-446655440000", "550E8400-E29B-41D4-A716-446655440000",
                "6ba7b810-9dad-11d1-80b4-00c04fd430c8", "d" * 64],
        "/tmp/fttrace-x_1/work/calc.py": 1,
    }
    out = san.value(raw)
    text = json.dumps(out)
    for leak in ("fttrace", "alice", "abcdefgh12345678", "ZZZZZZZZZZ", "1234567890", "hunter2", "550e8400",
                 "6ba7b810", "d" * 64):
        assert leak not in text, leak
    assert "/tmp/ftwork" in out["system"] and "-tmp-ftwork" in out["system"]
    assert "/tmp/ftwork/calc.py" in out
    a, b, c, d = out["ids"]
    assert a == b != c  # stable per id (case-insensitive), distinct across ids
    assert len(a) == 36 and len(d) == 64  # same shape, so prompt lengths stay realistic
    assert san.headers({"authorization": "Bearer x", "x-api-key": "k", "x-session-id": "s"}) == {"x-session-id": "s"}


def test_stored_traces_hold_no_secrets() -> None:
    traces = sorted(DATA.glob("*.json"))
    if not traces:
        pytest.skip("no stored traces")
    for p in traces:
        text = p.read_text()
        for leak in ("fttrace-", "sk-freetoken-local", str(Path.home()) + "/", "/work/wt-"):
            assert leak not in text, (p.name, leak)
        for req in json.loads(text)["requests"]:
            assert not {"authorization", "x-api-key"} & {k.lower() for k in req["headers"]}, p.name


# ------------------------------------------------------------------------------------ script
def _chat(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> Any:
    return normalise("/v1/chat/completions", {"model": MODEL, "messages": messages,
                                              "tools": [{"type": "function", "function": t} for t in tools]})


def test_script_walks_the_plan_with_each_clients_tools() -> None:
    oc_tools = [{"name": "read", "parameters": {"properties": {"filePath": {}}}},
                {"name": "edit", "parameters": {"properties": {"filePath": {}, "oldString": {}, "newString": {}}}},
                {"name": "bash", "parameters": {"properties": {"command": {}, "workdir": {}}}}]
    codex_tools = [{"name": "exec_command", "parameters": {"properties": {"cmd": {}, "workdir": {}}}}]
    script = Script("/w", "qwen3_5")
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "s"}, {"role": "user", "content": PROMPTS[0]}]
    names = []
    for step in PLAN[0]:
        r = script.reply(_chat(msgs, oc_tools))
        names.append((r.calls[0].name, r.calls[0].arguments) if r.calls else ("answer", r.content))
        msgs += [{"role": "assistant", "content": "", "tool_calls": [
                     {"id": "c", "type": "function", "function": {"name": "x", "arguments": "{}"}}]},
                 {"role": "tool", "tool_call_id": "c", "content": "out"}]
        assert step[0] in ("read", "edit", "run", "answer")
    assert names[0] == ("read", {"filePath": "/w/calc.py"})
    assert names[2][0] == "edit" and names[2][1]["oldString"] == "    return a - b\n"
    assert names[3] == ("bash", {"command": "python3 test_calc.py", "workdir": "/w"})
    assert names[4][0] == "answer"
    # Codex has only a shell: reads and edits go through it.
    r = script.reply(_chat([{"role": "user", "content": PROMPTS[0]}], codex_tools))
    assert r.calls[0].name == "exec_command" and r.calls[0].arguments["cmd"] == "cat calc.py"
    # No tools, or no task prompt: a side request (title generation).
    assert script.reply(_chat([{"role": "user", "content": PROMPTS[0]}], [])).side
    assert script.reply(_chat([{"role": "user", "content": "Generate a title"}], oc_tools)).side


# ------------------------------------------------------------------------------------ forced output
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3"])
def test_forced_output_chat_completions(servers: dict[str, str], family: str) -> None:
    client = openai.OpenAI(base_url=servers[family] + "/v1", api_key="x", max_retries=0, timeout=120)
    forced = render(FORCED_CALL, family, thinking=True)
    kwargs: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "look at src/a.py"}],
                              "tools": [{"type": "function", "function": READ_TOOL}],
                              "extra_body": {FORCED_OUTPUT_FIELD: forced}, "max_tokens": 4}
    r = client.chat.completions.create(**kwargs)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls or []] == [
        ("read_file", {"path": "src/a.py", "limit": 20})]
    assert getattr(msg, "reasoning_content", None) == FORCED_CALL.reasoning
    # Streaming gives the same call, and max_tokens did not cut the forced reply short.
    stream = client.chat.completions.create(**kwargs, stream=True)
    args, names = "", []
    for chunk in stream:
        for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            names += [d.function.name] if d.function and d.function.name else []
            args += d.function.arguments or "" if d.function else ""
    assert names == ["read_file"] and json.loads(args) == {"path": "src/a.py", "limit": 20}


def test_forced_output_responses(servers: dict[str, str]) -> None:
    client = openai.OpenAI(base_url=servers["qwen3_5"] + "/v1", api_key="x", max_retries=0, timeout=120)
    forced = render(FORCED_CALL, "qwen3_5", thinking=True)
    r = client.responses.create(model=MODEL, input="look at src/a.py",
                                tools=[{"type": "function", **READ_TOOL}],
                                extra_body={FORCED_OUTPUT_FIELD: forced})
    calls = [o for o in r.output if o.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("read_file", {"path": "src/a.py", "limit": 20})]
    assert any(o.type == "reasoning" for o in r.output)


def test_forced_output_anthropic_messages(servers: dict[str, str]) -> None:
    client = anthropic.Anthropic(base_url=servers["qwen3_5"], api_key="x", max_retries=0, timeout=120)
    forced = render(Reply(reasoning="Reading it.", content="Let me check.",
                          calls=[Call("read_file", {"path": "b.py"})]), "qwen3_5", thinking=True)
    kwargs: dict[str, Any] = {
        "model": MODEL, "max_tokens": 2048, "thinking": {"type": "enabled", "budget_tokens": 1024},
        "messages": [{"role": "user", "content": "look at b.py"}],
        "tools": [{"name": READ_TOOL["name"], "description": "Read", "input_schema": READ_TOOL["parameters"]}],
        "extra_body": {FORCED_OUTPUT_FIELD: forced}}
    m = client.messages.create(**kwargs)
    kinds = [b.type for b in m.content]
    assert kinds == ["thinking", "text", "tool_use"], kinds
    assert m.content[0].thinking == "Reading it." and m.content[1].text == "Let me check."
    assert (m.content[2].name, m.content[2].input) == ("read_file", {"path": "b.py"})
    assert m.stop_reason == "tool_use"
    with client.messages.stream(**kwargs) as s:
        final = s.get_final_message()
    assert [b.type for b in final.content] == kinds and final.content[2].input == {"path": "b.py"}


def test_forced_output_refuses_a_non_string(servers: dict[str, str]) -> None:
    r = httpx.post(servers["qwen3_5"] + "/v1/chat/completions", timeout=60,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], FORCED_OUTPUT_FIELD: 3})
    assert r.status_code == 400 and FORCED_OUTPUT_FIELD in r.text


# ------------------------------------------------------------------------------------ replay
def test_replay_of_a_stored_trace_computes_the_numbers(servers: dict[str, str]) -> None:
    path = DATA / "opencode.json"
    trace = json.loads(path.read_text())
    trace["requests"] = trace["requests"][:5]  # title side request + the first main steps: enough, cheap
    result = rp.replay_traces([trace], base_url=servers["qwen3_5"], model="demo")
    sessions = result["traces"][0]["sessions"]
    turns = [t for s in sessions for t in s["turns"]]
    assert len(turns) == 5 and all(t["status"] == 200 for t in turns)
    # Local rendering is the server's: the same prompt length for every request.
    assert all(t["prompt_tokens"] == t["server_prompt_tokens"] for t in turns)
    main = [t for t in turns if not t["side"]]
    assert main[0]["truly_new"] > 1000  # the first main request shares only a little with the title request
    for t in main[1:]:  # each later step adds a tool result and a reply: far less than its prompt
        assert 0 < t["truly_new"] < t["prompt_tokens"] // 4
        assert t["recomputed"] is not None and t["recomputed"] <= t["prompt_tokens"]
        assert t["ttft_ms"] is not None and t["ttft_ms"] > 0
    s = next(s for s in sessions if s["requests"] >= 4)
    assert s["truly_new_tokens"] == sum(t["truly_new"] for t in s["turns"])
    assert s["ratio"] == round(s["recomputed_tokens"] / s["truly_new_tokens"], 3)
    assert s["worst_ttft_ms"] >= s["mean_ttft_ms"] > 0


# ------------------------------------------------------------------------------------ bench
def test_bench_check_flags_sessions_over_the_ratio() -> None:
    from evals.traces.bench import check, markdown

    def session(new: int, rec: int) -> dict[str, Any]:
        return {"session": "t/s", "requests": 2, "failed": 0, "prompt_tokens": 100, "truly_new_tokens": new,
                "recomputed_tokens": rec, "ratio": rec / new, "mean_ttft_ms": 1.0, "worst_ttft_ms": 2.0, "turns": []}

    ok = {"traces": [{"trace": "a", "sessions": [session(100, 110)]}]}
    bad = {"traces": [{"trace": "a", "sessions": [session(100, 110)]},
                      {"trace": "b", "sessions": [session(100, 111)]}]}
    assert check(ok) == []
    assert len(check(bad)) == 1 and check(bad)[0].startswith("b ")
    report = markdown({"semantic": bad, "user-only": ok}, [{"client": "a", "requests": [1, 2]}])
    assert "**fail**" in report and "| a | 1.100 | 1.100 |" in report


# ------------------------------------------------------------------------------------ capture
@pytest.mark.clients
@pytest.mark.slow
def test_capture_claude_code_multi_turn(tmp_path: Path) -> None:
    """The real Claude Code CLI runs the whole scripted task (2 user turns) against the scripted
    backend; the stored trace holds every model request, tool results included, sanitised."""
    from evals.clients.agents import clients_dir_default, installed
    from evals.traces import capture

    if not installed("claude-code", clients_dir_default()):
        pytest.skip("Claude Code is not installed under .clients/ (evals/clients/install.sh)")
    trace, ok = capture.capture("claude-code", None, "demo", 300, False, clients_dir_default())
    assert ok, trace["turns"]
    reqs = trace["requests"]
    assert len(reqs) >= 8 and all(r["status"] == 200 for r in reqs)
    assert [t["exit_code"] for t in trace["turns"]] == [0, 0]
    results = [b for r in reqs for m in r["body"]["messages"] if isinstance(m.get("content"), list)
               for b in m["content"] if b.get("type") == "tool_result"]
    assert len(results) >= 4
    called = [c["name"] for r in reqs for c in (r["reply"] or {}).get("tool_calls", [])]
    assert {"Read", "Edit", "Bash"} <= set(called)
    text = json.dumps(trace)
    assert "fttrace-" not in text and "sk-freetoken-local" not in text
    assert "/tmp/ftwork/calc.py" in text
