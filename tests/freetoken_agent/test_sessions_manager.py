"""The session manager over whole conversations: divergence position and cause for each client
edit, which anchor would have served it, learning, side requests, and inspection records.
The engine is replaced by what it would have produced: the reply's tokens as the chat template
renders them (so an unedited echo is an exact extension) and a handle carrying the reuse counts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from sessions_support import TOOLS, asst, make_tokenizer, recorded, render, sys_, to_request, tool, user

from engine.anchors import ReuseInfo
from freetoken_agent.service import ChatMessage, ChatRequest
from freetoken_agent.sessions import SessionManager
from freetoken_agent.sessions.normalise import normalise
from freetoken_agent.sessions.profiles import OPENCLAW
from freetoken_agent.tokenizer import ChatTokenizer

CARRIER = "<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>\nActive exec sessions: none\n<<<END_OPENCLAW_INTERNAL_CONTEXT>>>"
OUT = "README.md\nsetup.py\nsrc/\n" * 20
HEADERS = {"x-session-id": "ses_1", "user-agent": "opencode/1.18.33"}


@dataclass
class Handle:
    """What `record` reads of an engine handle after the request ended."""
    cached_tokens: int = 0
    reuse: ReuseInfo | None = None


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5"])
def tok(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> ChatTokenizer:
    return make_tokenizer(request.param, tmp_path_factory.mktemp(request.param))


class Conversation:
    """Drives a SessionManager the way ChatService does, turn by turn."""

    def __init__(self, tok: ChatTokenizer, headers: dict[str, str] | None = None, tools: bool = True) -> None:
        self.tok, self.mgr = tok, SessionManager(tok)
        self.headers = HEADERS if headers is None else headers
        self.tools = tools

    def request(self, *messages: ChatMessage, headers: dict[str, str] | None = None,
                tools: bool | None = None) -> ChatRequest:
        return ChatRequest(messages=list(messages), tools=TOOLS if (self.tools if tools is None else tools) else [],
                           headers=self.headers if headers is None else headers)

    def reply_ids(self, r: ChatRequest, ids: list[int], reply: ChatMessage) -> list[int]:
        """The ids the model generates for `reply`: its rendering as the newest turn, up to <|im_end|>."""
        text = self.tok.apply_chat_template([m.to_template() for m in [*r.messages, reply]], tools=r.tools or None,
                                            add_generation_prompt=False, tokenize=False)
        full = self.tok.encode(text)  # type: ignore[arg-type]
        assert full[:len(ids)] == ids, "the generation prompt must be a prefix of the reply's rendering"
        end = self.tok.token_to_id("<|im_end|>")
        return full[len(ids):len(full) - full[::-1].index(end)]

    def turn(self, *messages: ChatMessage, reply: ChatMessage | None = None, handle: Handle | None = None,
             **kw: Any) -> dict[str, Any]:
        r = normalise(self.request(*messages, **kw))
        ids = render(self.tok, r)
        plan = self.mgr.plan(r, ids)
        out = self.reply_ids(r, ids, reply) if reply is not None else [self.tok.token_to_id("<|im_end|>")]
        turn = self.mgr.record(plan, ids, out, handle or Handle(), 12.5, "stop")
        assert turn is not None
        turn["_ids"], turn["_plan"] = ids, plan
        return turn


A1 = asst("", "I will list the files.", ("bash", {"command": "ls"}))
A2 = asst("Here they are: README.md, setup.py.", "The listing is short.")


def test_append_only(tok: ChatTokenizer) -> None:
    c = Conversation(tok)
    t1 = c.turn(sys_(), user("list files"), reply=A1)
    assert t1["divergence_cause"] is None  # the first request of a session has nothing to diverge from
    t2 = c.turn(sys_(), user("list files"), A1, tool(OUT), reply=A2)
    assert t2["divergence_cause"] == "appended"
    assert t2["divergence_position"] == t1["prompt_tokens"] + t1["completion_tokens"]
    assert t2["would_serve_kind"] == "message_end"  # the reply's own end: exactly where the next turn starts
    assert t2["would_serve_position"] == t2["divergence_position"]


def test_reasoning_dropped_by_template_at_new_user_turn(tok: ChatTokenizer) -> None:
    c = Conversation(tok)
    t1 = c.turn(sys_(), user("hello"), reply=A2)
    t2 = c.turn(sys_(), user("hello"), A2, user("and now?"))
    assert t2["divergence_cause"] == "reasoning_dropped"
    assert t1["prompt_tokens"] - 4 <= t2["divergence_position"] <= t1["prompt_tokens"]
    assert t2["would_serve_kind"] in ("reply_start", "prompt_end")


def test_openclaw_carrier_and_learning(tok: ChatTokenizer) -> None:
    c = Conversation(tok, headers={"user-agent": "OpenAI/JS 7.15.0", "x-session-affinity": "claw"})
    sys_claw = sys_("<!-- openclaw:attempt:STABLE -->\nYou are a personal assistant running inside OpenClaw.")
    hist: list[ChatMessage] = [sys_claw, user("[Mon 2026-11-30 08:07 UTC] read README.md")]
    before = c.mgr.scores.priority(OPENCLAW, "before_carrier")
    for k in range(4):
        reply = asst("", f"read file {k}", ("read", {"path": f"f{k}.py"}), call_id=f"call_{k}")
        t = c.turn(*hist, user(CARRIER), reply=reply)
        if k:
            assert t["client"] == "openclaw"
            assert t["divergence_cause"] == "runtime_context_removed"
            assert t["would_serve_kind"] == "before_carrier"
        hist += [reply, tool(f"contents {k}", f"call_{k}")]
    after = c.mgr.scores.priority(OPENCLAW, "before_carrier")
    assert after > before  # served three divergences: ranked up for this client
    assert c.mgr.scores.priority(OPENCLAW, "user_start") == OPENCLAW.priority("user_start")  # never served
    ranking = c.mgr.session("claw")["kind_ranking"]  # type: ignore[index]
    assert ranking[0]["kind"] == "before_carrier"


def test_tool_result_cleared(tok: ChatTokenizer) -> None:
    c = Conversation(tok)
    hist = [sys_(), user("list files"), A1, tool(OUT)]
    c.turn(*hist, user("next"), reply=A2)
    cleared = [sys_(), user("list files"), A1, tool("[Old tool result content cleared]")]
    t = c.turn(*cleared, user("next"), A2, user("more"))
    assert t["divergence_cause"] == "tool_result_cleared"
    assert t["divergence_message"] == 3
    assert t["would_serve_kind"] == "tool_result_start"


def test_compaction_and_system_change(tok: ChatTokenizer) -> None:
    c = Conversation(tok)
    c.turn(sys_(), user("list files"), A1, tool(OUT), reply=A2)
    t = c.turn(sys_(), user("This session is being continued from a previous conversation that ran out of context."),
               user("go on"))
    assert t["divergence_cause"] == "compaction" and t["would_serve_kind"] == "system_end"
    t = c.turn(sys_("You are a coding agent. Today's date: Tue Dec 01 2026"), user("go on"))
    assert t["divergence_cause"] == "system_changed" and t["would_serve_kind"] is None
    assert t["side"] is None  # same tools: still the main conversation


def test_echo_mismatch(tok: ChatTokenizer) -> None:
    """Claude Code re-sends its Edit call with an added `"replace_all": false` key."""
    c = Conversation(tok)
    call = asst("", "edit it", ("edit", {"path": "a.py", "old": "x", "new": "y"}))
    c.turn(sys_(), user("fix a.py"), reply=call)
    echoed = asst("", "edit it", ("edit", {"replace_all": False, "path": "a.py", "old": "x", "new": "y"}))
    t = c.turn(sys_(), user("fix a.py"), echoed, tool("ok"))
    assert t["divergence_cause"] == "echo_mismatch"
    assert t["divergence_position"] > t["_plan"].starts[2]  # inside the echoed reply


def test_side_request_leaves_main_reference(tok: ChatTokenizer) -> None:
    title, main = recorded("opencode")
    c = Conversation(tok)
    rt, rm = normalise(to_request(title)), normalise(to_request(main))
    ids_m = render(tok, rm)
    plan_m = c.mgr.plan(rm, ids_m)
    c.mgr.record(plan_m, ids_m, [tok.token_to_id("<|im_end|>")], Handle(), None, "stop")
    ids_t = render(tok, rt)
    plan_t = c.mgr.plan(rt, ids_t)
    side_turn = c.mgr.record(plan_t, ids_t, [tok.token_to_id("<|im_end|>")], Handle(), None, "stop")
    assert plan_t.side and side_turn is not None and side_turn["divergence_cause"] is None
    rm2 = normalise(ChatRequest(messages=[*rm.messages, ChatMessage(role="assistant", content=""),
                                          user("again")], tools=rm.tools, headers=rm.headers))
    plan2 = c.mgr.plan(rm2, render(tok, rm2))
    assert plan2.divergence is not None and plan2.divergence.position >= len(ids_m) - 5  # not the title's prefix
    s = c.mgr.session(plan_m.session_id)  # type: ignore[arg-type]
    assert s is not None and s["turns_count"] == 1 and s["side_requests"] == 1


def test_reuse_info_and_inspection(tok: ChatTokenizer) -> None:
    c = Conversation(tok)
    t1 = c.turn(sys_(), user("list files"), reply=A1, handle=Handle(cached_tokens=0))
    assert t1["reused_tokens"] == 0 and t1["recomputed_tokens"] == t1["prompt_tokens"]
    assert t1["checkpoint_position"] is None and t1["from_host"] is None
    n2 = len(render(tok, normalise(c.request(sys_(), user("list files"), A1, tool(OUT)))))
    served = t1["prompt_tokens"] + t1["completion_tokens"] - 1
    info = ReuseInfo(kv_tokens=served, state_position=served, checkpoint_kind="tool_call_start", from_host=True,
                     recomputed_tokens=n2 - served)
    t2 = c.turn(sys_(), user("list files"), A1, tool(OUT), reply=A2, handle=Handle(served, info))
    assert t2["reused_tokens"] == served and t2["recomputed_tokens"] == n2 - served
    assert t2["checkpoint_kind"] == "tool_call_start" and t2["from_host"] is True
    assert t2["kv_reused_tokens"] == t2["state_reused_tokens"] == t2["checkpoint_position"] == served
    # an engine without ReuseInfo: the checkpoint kind is looked up among the session's anchors
    t3 = c.turn(sys_(), user("list files"), A1, tool(OUT), A2, user("thanks"),
                handle=Handle(cached_tokens=t2["_plan"].anchors[-1].position))
    assert t3["checkpoint_kind"] == "prompt_end"
    listing = c.mgr.sessions()
    assert [s["id"] for s in listing] == ["ses_1"] and listing[0]["turns"] == 3
    assert listing[0]["client"] == "opencode"
    full = c.mgr.session("ses_1")
    assert full is not None and full["client"] == "opencode" and len(full["turns"]) == 3
    for turn in full["turns"]:
        for key in ("prompt_tokens", "reused_tokens", "recomputed_tokens", "divergence_position",
                    "divergence_cause", "checkpoint_position", "kv_reused_tokens", "state_reused_tokens",
                    "checkpoint_kind", "from_host", "ttft_ms", "expert_cache_hit_rate"):
            assert key in turn
        assert turn["expert_cache_hit_rate"] is None and turn["ttft_ms"] == 12.5
    assert c.mgr.session("nope") is None


def test_headerless_sessions_by_prefix(tok: ChatTokenizer) -> None:
    c = Conversation(tok, headers={})
    s1 = c.turn(sys_("You are a helpful assistant that can interact with a computer."),
                user("Please solve this issue: bug"), reply=A1)
    s2 = c.turn(sys_("You are a helpful assistant that can interact with a computer."),
                user("Please solve this issue: bug"), A1, tool(OUT), reply=A2)
    assert s1["_plan"].session_id == s2["_plan"].session_id and s1["_plan"].session_id.startswith("h-")
    assert s2["client"] == "mini-swe-agent" and s2["divergence_cause"] == "appended"


def test_resend_and_truncation(tok: ChatTokenizer) -> None:
    c = Conversation(tok)
    c.turn(sys_(), user("list files"), A1, tool(OUT), reply=A2)
    t = c.turn(sys_(), user("list files"), A1, tool(OUT))
    assert t["divergence_cause"] == "resend" and t["divergence_position"] == t["prompt_tokens"]
    t = c.turn(sys_(), user("list files"))
    assert t["divergence_cause"] == "truncated"


def test_claude_code_side_call_with_other_prompt(tok: ChatTokenizer) -> None:
    """A haiku-style side call: same session id, another system prompt, no tools."""
    c = Conversation(tok, headers={"x-claude-code-session-id": "cc1", "user-agent": "claude-cli/2.1.332"})
    main = c.turn(sys_("You are a Claude agent."), user("fix the bug"), reply=A1)
    side = c.turn(sys_("Summarise the user's request in five words."), user("fix the bug"), tools=False)
    assert main["side"] is None and side["side"] == "different prompt"
    plan = side["_plan"]
    assert plan.engine_session is None and not plan.decode_anchors
    assert all(a.priority < 0 for a in plan.anchors)
    t = c.turn(sys_("You are a Claude agent."), user("fix the bug"), A1, tool(OUT))
    assert t["side"] is None and t["divergence_cause"] == "appended"  # the side call changed no reference
    s = c.mgr.session("cc1")
    assert s is not None and s["turns_count"] == 2 and s["side_requests"] == 1 and s["client"] == "claude-code"


def test_kind_scores_policy() -> None:
    from freetoken_agent.sessions.learning import BONUS, DECAY, KindScores, serving_anchor
    from freetoken_agent.sessions.profiles import CODEX

    scores = KindScores()
    for _ in range(5):
        scores.learn("codex", ["message_end"])
    expected = round(BONUS * (1 - DECAY ** 5))
    assert scores.bonus("codex", "message_end") == expected > 0
    assert scores.priority(CODEX, "message_end") == CODEX.priority("message_end") + expected
    scores.learn("codex", ["user_start"])  # one lesson for another kind: the old one decays
    assert scores.bonus("codex", "message_end") < expected
    assert scores.bonus("opencode", "message_end") == 0  # per client
    assert scores.lessons("codex") == 6
    assert serving_anchor([(5, "a"), (9, "b"), (12, "c")], 10) == (9, "b")
    assert serving_anchor([(5, "a")], 4) is None
