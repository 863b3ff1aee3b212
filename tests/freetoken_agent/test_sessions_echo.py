"""Echo reconciliation (sessions/echo.py, the manager's normalise) and argument-boundary decode anchors,
on the real tokenizers and chat templates of both families; no engine."""

from __future__ import annotations

import json

import pytest
from sessions_support import make_tokenizer, render, sys_, tool, user

from engine.anchors import DecodeAnchor, decode_anchor_at
from freetoken_agent.service import ChatMessage, ChatRequest, ToolCall
from freetoken_agent.sessions.echo import EchoReconciler
from freetoken_agent.sessions.manager import SessionManager
from freetoken_agent.sessions.profiles import CLAUDE_CODE, CODEX
from freetoken_agent.tokenizer import ChatTokenizer

EDIT = {"type": "function", "function": {"name": "Edit", "parameters": {"type": "object", "properties": {
    "file_path": {"type": "string"}, "old_string": {"type": "string"}, "new_string": {"type": "string"},
    "replace_all": {"type": "boolean"}}}}}
ARGS = {"file_path": "/w/calc.py", "old_string": "    return a - b\n", "new_string": "    return a + b\n"}


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5"])
def tok(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> ChatTokenizer:
    return make_tokenizer(request.param, tmp_path_factory.mktemp(request.param))


def _call(args: dict | str, cid: str = "call_1") -> ChatMessage:
    return ChatMessage(role="assistant", reasoning="I fix it.", tool_calls=[ToolCall(id=cid, name="Edit", arguments=args)])


def _generated(tok: ChatTokenizer, m: ChatMessage) -> str:
    """What the engine generated for `m`: its rendering up to and including the end token."""
    seg = EchoReconciler(tok).segment(m)
    return seg[:seg.index("<|im_end|>") + len("<|im_end|>")]


@pytest.mark.parametrize("echo, defaults, reconciled, changed, differed", [
    (ARGS, (), True, False, None),
    ({"replace_all": False, **ARGS}, CLAUDE_CODE.echo_additions, True, True, None),   # Claude Code's real echo
    ({**ARGS, "replace_all": False}, CLAUDE_CODE.echo_additions, True, True, None),   # the key appended last
    (dict(reversed(list(ARGS.items()))), (), True, True, None),                        # keys reordered
    (json.dumps(ARGS, indent=3), (), True, False, None),                               # other whitespace
    ({"replace_all": False, **ARGS}, CODEX.echo_additions, False, False, "call 0 argument replace_all"),
    ({"replace_all": True, **ARGS}, CLAUDE_CODE.echo_additions, False, False, "call 0 argument replace_all"),
    ({**ARGS, "new_string": "    return b + a\n"}, (), False, False, "call 0 argument new_string"),
])
def test_reconcile(tok: ChatTokenizer, echo, defaults, reconciled: bool, changed: bool, differed) -> None:
    rec = EchoReconciler(tok)
    generated = _generated(tok, _call(ARGS))
    out = rec.reconcile(_call(echo, cid="toolu_99"), generated, defaults)
    assert (out.reconciled, out.differed) == (reconciled, differed)
    assert out.changed == changed
    if reconciled:  # renders to exactly what was generated, then the turn's end
        assert rec.segment(out.message).startswith(generated)
    else:
        assert out.message.tool_calls[0].arguments == echo


def test_parts_that_differ(tok: ChatTokenizer) -> None:
    rec = EchoReconciler(tok)
    generated = _generated(tok, _call(ARGS))
    other = ChatMessage(role="assistant", reasoning="Something else.", tool_calls=_call(ARGS).tool_calls)
    assert rec.reconcile(other, generated).differed == "reasoning"
    two = ChatMessage(role="assistant", reasoning="I fix it.", tool_calls=_call(ARGS).tool_calls * 2)
    assert rec.reconcile(two, generated).differed == "tool_calls"
    renamed = ChatMessage(role="assistant", reasoning="I fix it.", tool_calls=[ToolCall("c", "Write", ARGS)])
    assert rec.reconcile(renamed, generated).differed == "call 0 name"
    # a generation cut before the end token still matches an echo that continues with it
    assert rec.reconcile(_call(ARGS), generated[:-len("<|im_end|>")]).reconciled


def _session(tok: ChatTokenizer, headers: dict[str, str], echo_args: dict, generated_args: dict = ARGS):
    """Two requests of one session through the manager: the first's reply is `generated_args`
    (forced, ending on <|im_end|>), the second echoes it with `echo_args`."""
    mgr = SessionManager(tok)
    first = [sys_(), user("Fix calc.py.")]
    r1 = mgr.normalise(ChatRequest(messages=first, tools=[EDIT], headers=headers))
    ids1 = render(tok, r1)
    plan1 = mgr.plan(r1, ids1)
    gen = _call(generated_args)
    full = render(tok, ChatRequest(messages=[*first, gen], tools=[EDIT]))
    reply = full[len(ids1):]
    reply = reply[:reply.index(tok.token_to_id("<|im_end|>")) + 1]
    mgr.record(plan1, ids1, reply, None, None, "stop")
    r2 = ChatRequest(messages=[*first, _call(echo_args, cid="toolu_x"), tool("updated", "toolu_x")],
                     tools=[EDIT], headers=headers)
    n2 = mgr.normalise(r2)
    ids2 = render(tok, n2)
    plan2 = mgr.plan(n2, ids2)
    return mgr, ids1 + reply, ids2, plan2, n2, r2


def test_manager_renders_the_echo_as_generated(tok: ChatTokenizer) -> None:
    headers = {"x-claude-code-session-id": "s1", "user-agent": "claude-cli/2.1"}
    mgr, before, ids2, plan2, n2, r2 = _session(tok, headers, {"replace_all": False, **ARGS})
    assert ids2[:len(before)] == before  # the cached prefix holds
    assert plan2.divergence is not None and plan2.divergence.cause == "appended"
    assert plan2.echo == {"message": 2, "reconciled": True, "rewritten": True, "differed": None}
    mgr.record(plan2, ids2, tok.encode("Checking.<|im_end|>"), None, None, "stop")
    # the next request of the tool loop echoes the same call again: rendered the same way
    r3 = ChatRequest(messages=[*r2.messages, ChatMessage(role="assistant", content="Checking."), tool("ok", "c2")],
                     tools=[EDIT], headers=headers)
    n3 = mgr.normalise(r3)
    assert n3.messages[2] == n2.messages[2]
    assert render(tok, n3)[:len(ids2) - 1] == ids2[:-1]  # the generation prompt's last token may merge
    turn = mgr.session("s1")["turns"][-1]
    assert turn["echo"]["reconciled"] and turn["divergence_cause"] == "appended"


def test_manager_reports_what_differed(tok: ChatTokenizer) -> None:
    # an unknown client's extra key is not dropped: the echo renders as sent, the report says why
    _, before, ids2, plan2, n2, r2 = _session(tok, {"x-session-id": "s2"}, {**ARGS, "replace_all": False})
    assert n2.messages[2] == r2.messages[2]
    assert plan2.divergence is not None and plan2.divergence.cause == "echo_mismatch"
    assert plan2.echo is not None and plan2.echo["differed"] == "call 0 argument replace_all"
    assert ids2[:plan2.divergence.position] == before[:plan2.divergence.position]


def test_openclaw_carrier_label_despite_stripped_old_reasoning(tok: ChatTokenizer) -> None:
    """OpenClaw strips the reasoning of turns the template no longer shows and replaces its
    trailing carrier: the tokens diverge at the carrier, and the cause says so."""
    carrier = "<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>\nActive exec sessions: none\n<<<END_OPENCLAW_INTERNAL_CONTEXT>>>"
    mgr = SessionManager(tok)
    old_turn = [ChatMessage(role="assistant", content="Fixed.", reasoning="It was a sign error.")]
    history = [sys_("You are a personal assistant running inside OpenClaw."), user("Fix calc.py."), *old_turn,
               user("Now add mul.")]
    r1 = ChatRequest(messages=[*history, user(carrier)], tools=[EDIT], headers={"session_id": "oc1"})
    ids1 = render(tok, r1)
    mgr.record(mgr.plan(r1, ids1), ids1, tok.encode("Done.<|im_end|>"), None, None, "stop")
    stripped = [*history[:2], ChatMessage(role="assistant", content="Fixed."), history[3]]
    r2 = ChatRequest(messages=[*stripped, ChatMessage(role="assistant", content="Done."), user(carrier + " ")],
                     tools=[EDIT], headers={"session_id": "oc1"})
    ids2 = render(tok, r2)
    plan = mgr.plan(r2, ids2)
    assert plan.divergence is not None and plan.divergence.cause == "runtime_context_removed"


def test_decode_anchor_sequence_and_gap() -> None:
    a = DecodeAnchor(token_id=9, kind="argument_end", priority=1, preceded_by=(7, 8), min_gap=5)
    m = DecodeAnchor(token_id=2, kind="message_end", priority=5)
    assert decode_anchor_at([a, m], [1, 1, 1, 1, 7, 8, 9], 0) is a
    assert decode_anchor_at([a, m], [1, 1, 1, 1, 7, 8, 9], 3) is None  # 4 tokens since the last: gap too small
    assert decode_anchor_at([a, m], [1, 1, 1, 1, 6, 8, 9], 0) is None  # not preceded by (7, 8)
    assert decode_anchor_at([a, m], [7, 8, 9], 0, n=2) is None
    assert decode_anchor_at([a, m], [1, 2], 1) is m


def test_manager_reorders_keys_for_any_client(tok: ChatTokenizer) -> None:
    reordered = dict(reversed(list(ARGS.items())))
    _, before, ids2, plan2, n2, _ = _session(tok, {"x-session-id": "s3"}, reordered)
    assert list(n2.messages[2].tool_calls[0].arguments) == list(ARGS)  # the generated order
    assert ids2[:len(before)] == before
    assert plan2.divergence is not None and plan2.divergence.cause == "appended"
