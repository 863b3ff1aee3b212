"""Client profiles: detection, session keys, side requests and normalisation, on the first
requests captured from the real clients (tests/clients/recorded) and on realistic bodies."""

from __future__ import annotations

import pytest
from sessions_support import recorded, render, req, sys_, to_request, user

from freetoken_agent.service import ChatMessage, ChatRequest
from freetoken_agent.sessions import detect
from freetoken_agent.sessions.normalise import message_key, normalise, strip_billing_header
from freetoken_agent.sessions.profiles import prefix_key


def test_claude_code_recorded() -> None:
    entry = recorded("claude-code")[0]
    r = normalise(to_request(entry))
    d = detect(r)
    assert d.profile.name == "claude-code"
    assert d.session_key == "ba93efcf-4f6c-4d5b-bf9b-b947932c0155"
    assert d.key_source == "x-claude-code-session-id"
    assert d.side is None and d.parent is None
    assert not any("x-anthropic-billing-header" in m.content for m in r.messages)


def test_claude_code_billing_block_is_stripped_even_unparsed() -> None:
    # The adapter strips it already; the manager's rule is idempotent and catches a glued header.
    text = "x-anthropic-billing-header: cc_version=2.1.332.cb7; cc_entrypoint=sdk-cli;\nYou are Claude."
    assert strip_billing_header(text) == "You are Claude."
    assert strip_billing_header("x-anthropic-billing-header: a;\n\nYou are Claude.") == "You are Claude."
    r = ChatRequest(messages=[sys_("x-anthropic-billing-header: cc_version=1.2.3.abc;"), sys_("Real"), user("hi")])
    assert [m.content for m in normalise(r).messages] == ["Real", "hi"]
    other = ChatRequest(messages=[sys_("x-anthropic-billing-header: cc_version=1.2.3.def;"), sys_("Real"), user("hi")])
    assert [message_key(m) for m in normalise(r).messages] == [message_key(m) for m in normalise(other).messages]


def test_claude_code_subagent_is_its_own_session() -> None:
    entry = recorded("claude-code")[0]
    headers = {**entry["headers"], "x-claude-code-agent-id": "agent-7"}
    d = detect(normalise(to_request({**entry, "headers": headers})))
    assert d.profile.name == "claude-code"
    assert d.session_key == "ba93efcf-4f6c-4d5b-bf9b-b947932c0155/agent-7"
    assert d.parent == "ba93efcf-4f6c-4d5b-bf9b-b947932c0155"


def test_opencode_recorded_title_is_side_main_is_not() -> None:
    title, main = recorded("opencode")
    dt, dm = detect(normalise(to_request(title))), detect(normalise(to_request(main)))
    assert dt.profile.name == dm.profile.name == "opencode"
    assert dt.session_key == dm.session_key == "ses_dd481f914ffe27ACNGJPGa542Z"
    assert dt.side == "marker"
    assert dm.side is None


def test_opencode_subagent_parent() -> None:
    _, main = recorded("opencode")
    headers = {**main["headers"], "x-session-id": "ses_child", "x-session-affinity": "ses_child",
               "x-parent-session-id": "ses_dd481f914ffe27ACNGJPGa542Z"}
    d = detect(normalise(to_request({**main, "headers": headers})))
    assert d.session_key == "ses_child" and d.parent == "ses_dd481f914ffe27ACNGJPGa542Z"


def test_codex_recorded() -> None:
    d = detect(normalise(to_request(recorded("codex")[0])))
    assert d.profile.name == "codex"
    assert d.session_key == "01a22b7d-de62-75e1-9735-534380a1b33f"
    assert d.side is None


def test_openclaw_recorded_session_from_runtime_line() -> None:
    d = detect(normalise(to_request(recorded("openclaw")[0])))
    assert d.profile.name == "openclaw"
    assert d.session_key == "4d58c91a-202a-439a-88b7-611654619b75"
    assert d.key_source == "content"


def test_openclaw_affinity_header_wins() -> None:
    entry = recorded("openclaw")[0]
    d = detect(normalise(to_request({**entry, "headers": {**entry["headers"], "x-session-affinity": "S1"}})))
    assert d.profile.name == "openclaw" and d.session_key == "S1"


MINI_SYSTEM = "You are a helpful assistant that can interact with a computer.\n\nYour response must contain..."
SWE_SYSTEM = "SETTING: You are an autonomous programmer, and you're working directly in the command line."


@pytest.mark.parametrize(("system", "first", "name"), [
    (MINI_SYSTEM, "Please solve this issue: the parser crashes", "mini-swe-agent"),
    (SWE_SYSTEM, "<uploaded_files>/repo</uploaded_files> We're currently solving the following issue", "swe-agent"),
    ("You are a helpful assistant.", "What is 2+2?", "generic"),
])
def test_headerless_clients_key_by_prefix(system: str, first: str, name: str) -> None:
    headers = {"user-agent": "OpenAI/Python 1.99.0", "content-type": "application/json"}
    r1 = req(sys_(system), user(first), headers=headers)
    r2 = req(sys_(system), user(first), ChatMessage(role="assistant", content="ok"), user("more"), headers=headers)
    d1, d2 = detect(normalise(r1)), detect(normalise(r2))
    assert d1.profile.name == d2.profile.name == name
    assert d1.session_key is None and d1.key_source == "prefix-hash"
    assert prefix_key(r1) == prefix_key(r2)  # the conversation keeps its key as it grows
    assert prefix_key(r1) != prefix_key(req(sys_(system), user(first + "!"), headers=headers))


def test_generic_session_header() -> None:
    d = detect(req(sys_(), user("hi"), headers={"X-Session-Id": "abc"}))
    assert d.profile.name == "generic" and d.session_key == "abc" and d.key_source == "x-session-id"


def test_equal_content_forms_render_equal(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A string and a list of text blocks (Claude Code sends its in-messages system turn both ways;
    mini-swe-agent's cache_control moves turn a string into a list) are one prompt."""
    from sessions_support import make_tokenizer

    from adapters import anthropic_messages, openai_chat

    tok = make_tokenizer("qwen3_5", tmp_path)
    a = openai_chat.to_chat_request({"messages": [{"role": "system", "content": "S"},
                                                  {"role": "user", "content": "hello"}]}, {})
    b = openai_chat.to_chat_request({"messages": [{"role": "system", "content": [{"type": "text", "text": "S"}]},
                                                  {"role": "user", "content": [{"type": "text", "text": "hello",
                                                                                "cache_control": {"type": "ephemeral"}}]}]},
                                    {})
    assert render(tok, normalise(a)) == render(tok, normalise(b))
    c = anthropic_messages.to_chat_request({"system": [{"type": "text", "text": "x-anthropic-billing-header: cc=1;"},
                                                       {"type": "text", "text": "S", "cache_control": {"type": "ephemeral"}}],
                                            "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5,
                                            "metadata": {"user_id": "u"}, "context_management": {"edits": []}}, {})
    c.enable_thinking = a.enable_thinking
    assert render(tok, normalise(c)) == render(tok, normalise(a))


def test_side_headers() -> None:
    entry = recorded("claude-code")[0]
    d = detect(normalise(to_request({**entry, "headers": {**entry["headers"], "x-app": "cli-bg"}})))
    assert d.profile.name == "claude-code" and d.side == "header"
    assert d.session_key == "ba93efcf-4f6c-4d5b-bf9b-b947932c0155"
    codex = recorded("codex")[0]
    d = detect(normalise(to_request({**codex, "headers": {**codex["headers"], "x-openai-subagent": "compact"}})))
    assert d.profile.name == "codex" and d.side == "header"
    assert d.session_key == "01a22b7d-de62-75e1-9735-534380a1b33f"  # compaction belongs to the session
    d = detect(normalise(to_request({**codex, "headers": {**codex["headers"], "x-openai-subagent": "review"}})))
    assert d.side is None and d.session_key == "01a22b7d-de62-75e1-9735-534380a1b33f/review"
    assert d.parent == "01a22b7d-de62-75e1-9735-534380a1b33f"
