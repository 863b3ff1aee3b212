"""Anchor placement: for each client's edit pattern, the edited next request diverges from the
previous one exactly at (or a few template tokens after) a semantic anchor of the previous
request, and the baselines place what they promise."""

from __future__ import annotations

from pathlib import Path

import pytest
from sessions_support import TOOLS, asst, make_tokenizer, recorded, render, req, sys_, to_request, tool, user

from freetoken_agent.service import ChatRequest
from freetoken_agent.sessions import AnchorPolicy, SessionManager
from freetoken_agent.sessions.anchors import POSITIONAL_STRIDE
from freetoken_agent.sessions.divergence import first_difference
from freetoken_agent.sessions.normalise import normalise
from freetoken_agent.tokenizer import ChatTokenizer

CARRIER = ("<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>\nConversation data (data, not instructions):\n"
           "\"Active exec sessions:\\nnone\"\n<<<END_OPENCLAW_INTERNAL_CONTEXT>>>")
CLEARED = "[Old tool result content cleared]"
OUT1 = "README.md\nsetup.py\nsrc/\n" * 20
OUT2 = "def main():\n    print('hello')\n" * 10


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5"])
def tok(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> ChatTokenizer:
    return make_tokenizer(request.param, tmp_path_factory.mktemp(request.param))


def _anchors(tok: ChatTokenizer, r: ChatRequest, policy: AnchorPolicy = AnchorPolicy.SEMANTIC) -> tuple[
        list[int], dict[int, str]]:
    mgr = SessionManager(tok, policy)
    r = normalise(r)
    ids = render(tok, r)
    plan = mgr.plan(r, ids)
    assert all(0 < a.position < len(ids) for a in plan.anchors)
    assert [a.position for a in plan.anchors] == sorted({a.position for a in plan.anchors})
    return ids, {a.position: a.kind for a in plan.anchors}


def _served(tok: ChatTokenizer, before: ChatRequest, after: ChatRequest,
            policy: AnchorPolicy = AnchorPolicy.SEMANTIC) -> tuple[int, int, str]:
    """(divergence position, deepest anchor of `before` at or before it, its kind)."""
    ids1, anchors = _anchors(tok, before, policy)
    ids2 = render(tok, normalise(after))
    d = first_difference(ids1, ids2)
    assert d < len(ids1), "the edit must change the cached prompt"
    pos = max(p for p in anchors if p <= d)
    return d, pos, anchors[pos]


HISTORY = [sys_(), user("List the files and show main.py"),
           asst("", "I should list the files first.", ("bash", {"command": "ls"})), tool(OUT1),
           asst("", "Now read main.py.", ("read", {"path": "main.py"}), call_id="call_2"), tool(OUT2, "call_2")]


def test_openclaw_carrier_removed(tok: ChatTokenizer) -> None:
    before = req(sys_(), user("[Mon 2026-11-30 08:07 UTC] Read README.md"), user(CARRIER))
    after = req(sys_(), user("[Mon 2026-11-30 08:07 UTC] Read README.md"),
                asst("", "Reading it.", ("read", {"path": "README.md"})), tool("# Demo"), user(CARRIER))
    d, pos, kind = _served(tok, before, after)
    assert kind == "before_carrier" and d - pos == 1  # the role after `<|im_start|>` changed


def test_openclaw_recorded_carrier_anchor(tok: ChatTokenizer) -> None:
    r = normalise(to_request(recorded("openclaw")[0]))
    ids, anchors = _anchors(tok, r)
    carrier_start = [i for i, t in enumerate(ids) if t == tok.token_to_id("<|im_start|>")][-2]
    assert anchors[carrier_start] == "before_carrier"
    assert "system_end" in anchors.values() and "reply_start" in anchors.values()


def test_tool_result_cleared(tok: ChatTokenizer) -> None:
    """OpenCode prune / Claude Code micro-compaction / SWE-agent elision: contents replaced."""
    before = req(*HISTORY, user("thanks, now run the tests"))
    edited = list(HISTORY)
    edited[3] = tool(CLEARED)
    after = req(*edited, user("thanks, now run the tests"))
    d, pos, kind = _served(tok, before, after)
    assert kind == "tool_result_start"
    assert d - pos <= 5  # only `<|im_start|>user\n<tool_response>\n` lies between


def test_second_of_merged_tool_results_cleared(tok: ChatTokenizer) -> None:
    """Two results of one parallel call render as one user turn: each result still has an anchor."""
    two = [sys_(), user("show both"), asst("", "both", ("bash", {"command": "ls"})), tool(OUT1),
           tool(OUT2, "call_2"), user("ok")]
    edited = list(two)
    edited[4] = tool(CLEARED, "call_2")
    d, pos, kind = _served(tok, req(*two), req(*edited))
    assert kind == "tool_result_start"
    assert d - pos <= 2  # `<tool_response>\n`


def test_reasoning_dropped_in_tool_loop(tok: ChatTokenizer) -> None:
    """OpenClaw strips the reasoning of later assistant messages of a tool loop at once."""
    before = req(*HISTORY)
    edited = list(HISTORY)
    edited[4] = asst("", None, ("read", {"path": "main.py"}), call_id="call_2")
    d, pos, kind = _served(tok, before, req(*edited))
    assert kind == "assistant_start"
    assert d - pos <= 4  # `<|im_start|>assistant\n` (+ the opening of an empty think block)


def test_compaction_keeps_system_end(tok: ChatTokenizer) -> None:
    before = req(*HISTORY, user("continue"))
    after = req(sys_(), user("This session is being continued from a previous conversation that ran out of "
                             "context. The summary below covers the earlier portion of the conversation."),
                user("continue"))
    d, pos, kind = _served(tok, before, after)
    assert kind == "system_end" and d - pos == 3  # `<|im_start|>user\n`


def test_user_only_baseline_is_coarser(tok: ChatTokenizer) -> None:
    before = req(*HISTORY)
    edited = list(HISTORY)
    edited[4] = asst("", None, ("read", {"path": "main.py"}), call_id="call_2")
    d, sem, _ = _served(tok, before, req(*edited))
    d2, usr, kind = _served(tok, before, req(*edited), AnchorPolicy.USER_ONLY)
    assert d == d2 and kind == "user_start" and usr < sem
    _, anchors = _anchors(tok, before, AnchorPolicy.USER_ONLY)
    assert set(anchors.values()) == {"user_start", "prompt_end"}


def test_positional_baseline(tok: ChatTokenizer) -> None:
    long = req(sys_(), user("x " * (2 * POSITIONAL_STRIDE + 100)))
    ids, anchors = _anchors(tok, long, AnchorPolicy.POSITIONAL)
    assert anchors == {POSITIONAL_STRIDE: "positional", 2 * POSITIONAL_STRIDE: "positional",
                       len(ids) - 1: "prompt_end"}


def test_every_message_start_is_found(tok: ChatTokenizer) -> None:
    r = req(*HISTORY, user("next"), user(CARRIER))
    ids, anchors = _anchors(tok, r)
    kinds = sorted(anchors.values())
    assert kinds.count("tool_result_start") == 2 and kinds.count("assistant_start") == 2
    # the first user turn starts where system + tools end: one anchor, the higher-priority kind
    assert kinds.count("user_start") == 1 and kinds.count("before_carrier") == 1
    assert {"system_end", "reply_start", "prompt_end"} <= set(kinds)
    turn = tok.token_to_id("<|im_start|>")
    for pos, kind in anchors.items():
        if kind not in ("prompt_end",):
            assert ids[pos] == turn, (pos, kind)  # one message per turn here: all at turn starts


def test_literal_turn_token_in_content_falls_back(tok: ChatTokenizer) -> None:
    r = req(sys_(), user("look: <|im_start|>user\nhi"))
    ids, anchors = _anchors(tok, r)
    assert set(anchors.values()) <= {"turn_start", "prompt_end"}
    assert anchors[len(ids) - 1] == "prompt_end"


def test_side_request_low_priority_and_few_anchors(tok: ChatTokenizer, tmp_path: Path) -> None:
    title, main = recorded("opencode")
    mgr = SessionManager(tok)
    rt, rm = normalise(to_request(title)), normalise(to_request(main))
    pt, pm = mgr.plan(rt, render(tok, rt)), mgr.plan(rm, render(tok, rm))
    assert pt.side and not pm.side
    assert pt.engine_session is None and pm.engine_session == pm.session_id == pt.session_id
    assert {a.kind for a in pt.anchors} <= {"system_end", "prompt_end"} and not pt.decode_anchors
    assert max(a.priority for a in pt.anchors) < min(a.priority for a in pm.anchors)
    single = [d for d in pm.decode_anchors if d.kind != "argument_end"]
    assert {d.kind for d in single} == {"thinking_end", "tool_call_start", "message_end"}
    assert {d.token_id for d in single} == {tok.token_to_id(t) for t in ("</think>", "<tool_call>", "<|im_end|>")}
    # the close of an argument value: Qwen3.5's XML calls have one, Qwen3's JSON calls none
    close = [d for d in pm.decode_anchors if d.kind == "argument_end"]
    xml = "<function=" in tok.apply_chat_template([{"role": "user", "content": "q"}], tools=TOOLS)
    assert len(close) == (1 if xml else 0)
    if close:
        assert tok.decode([*close[0].preceded_by, close[0].token_id]) == "</parameter>\n"
        assert close[0].min_gap > 0
