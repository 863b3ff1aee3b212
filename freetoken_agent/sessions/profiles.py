"""Client profiles: how each agent client is recognised, keyed into sessions, and where its edits land.

Contract: `detect(req)` (on a normalised `ChatRequest`) returns a `Detection`: the `ClientProfile`,
the session key the client itself gives (or None: the manager then hashes the prefix), where the
key came from, the parent session of a sub-agent, and why the request is a side request (title,
summary, compaction, ...) or None for a main-conversation request. Each profile carries the base
priority of every anchor kind, higher for the boundaries its edits are known to leave intact, and
`echo_additions`, the arguments it adds to a call it echoes (`echo.py` drops them again when the
engine did not generate them) (facts in shared/research/agent-clients.md):

- claude-code: append-only, but clears old tool results and drops unsigned thinking, so tool-result
  and assistant starts rank high; `X-Claude-Code-Session-Id`, sub-agents `x-claude-code-agent-id`;
  its echo of an Edit call carries `"replace_all": false` (first) when the model left it out.
- opencode: append-only, optional prune replaces old tool outputs; `x-session-id` /
  `x-session-affinity`, sub-agents `x-parent-session-id`; a title request comes first.
- openclaw: every request ends in a runtime-context carrier removed on the next request, and
  historical reasoning is stripped: `before_carrier` and assistant starts rank highest; session id
  from opt-in headers or the `sessionId=` runtime line of the user message.
- codex: append-only Responses history; `session-id` / `session_id` header.
- swe-agent: `last_n_observations` elides old observations: tool-result starts rank high.
- mini-swe-agent: strictly append-only: the reply's own end (`message_end`) ranks high.
- generic: anything else; generic session headers.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from freetoken_agent.service.types import ChatRequest
from freetoken_agent.sessions.normalise import first_user_text, system_text

CARRIER_MARK = "<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>"

# Base priorities shared by every profile; a profile overrides the kinds its edits favour.
BASE_PRIORITIES: Mapping[str, int] = MappingProxyType({
    "system_end": 60,          # survives everything but compaction (and a date change in the system)
    "user_start": 30,
    "system_turn_start": 25,   # a role=system message inside the conversation
    "assistant_start": 25,     # before its thinking: survives reasoning being dropped
    "tool_result_start": 20,   # survives tool-result clearing / elision (contents replaced)
    "before_carrier": 20,      # end of the last real message before OpenClaw's carrier
    "reply_start": 30,         # start of the generation prompt
    "prompt_end": 10,          # lets an identical resend reuse all but its last token
    "message_end": 35,         # decode: right after the reply's <|im_end|>
    "thinking_end": 15,        # decode: right after </think>
    "tool_call_start": 10,     # decode: right after <tool_call>
    "argument_end": 10,        # decode: after an argument value of a long generated call
    "positional": 10,          # baseline policy: every N tokens
})


def _priorities(**over: int) -> Mapping[str, int]:
    return MappingProxyType({**BASE_PRIORITIES, **over})


@dataclass(frozen=True)
class ClientProfile:
    name: str
    session_headers: tuple[str, ...] = ()      # lower-case header names giving the session id, in order
    parent_headers: tuple[str, ...] = ()       # headers naming the parent session of a sub-agent
    agent_headers: tuple[str, ...] = ()        # headers naming a sub-agent within the session
    user_agents: tuple[str, ...] = ()          # lower-case User-Agent prefixes
    id_headers: tuple[tuple[str, str], ...] = ()  # (header, value prefix) that identify the client
    markers: tuple[str, ...] = ()              # text in the system prompt / first user message
    side_markers: tuple[str, ...] = ()         # text that marks a side request (title, summary, ...)
    side_headers: tuple[tuple[str, str], ...] = ()  # (header, exact lower-case value) of side requests
    priorities: Mapping[str, int] = field(default_factory=lambda: BASE_PRIORITIES)
    edits: tuple[str, ...] = ()                # history edits this client makes (documentation, inspection)
    # (tool name or "*", key, value): arguments the client adds to a call when it echoes it
    echo_additions: tuple[tuple[str, str, object], ...] = ()

    def priority(self, kind: str) -> int:
        return self.priorities.get(kind, 0)


GENERIC_SESSION_HEADERS = ("x-session-id", "session_id", "session-id", "x-session-affinity")

CLAUDE_CODE = ClientProfile(
    name="claude-code", session_headers=("x-claude-code-session-id",),
    parent_headers=("x-claude-code-parent-agent-id",), agent_headers=("x-claude-code-agent-id",),
    user_agents=("claude-cli/", "claude-code/"), id_headers=(("x-app", "cli"),),
    side_headers=(("x-app", "cli-bg"),),  # background calls (summaries, suggestions) beside the main loop
    markers=("You are Claude Code", "Claude Agent SDK"),
    side_markers=("Generate a concise, sentence-case title", "Please write a 5-10 word title",
                  "Your task is to create a detailed summary of the conversation so far"),
    priorities=_priorities(tool_result_start=35, assistant_start=40),
    edits=("appended", "tool_result_cleared", "reasoning_dropped", "compaction"),
    echo_additions=(("Edit", "replace_all", False),))
OPENCODE = ClientProfile(
    name="opencode", session_headers=("x-session-id", "x-session-affinity"), parent_headers=("x-parent-session-id",),
    user_agents=("opencode/",), markers=("You are opencode",),
    side_markers=("You are a title generator", "Generate a title for this conversation"),
    priorities=_priorities(tool_result_start=35),
    edits=("appended", "tool_result_cleared", "compaction"))
OPENCLAW = ClientProfile(
    name="openclaw", session_headers=("session_id", "x-session-affinity"),
    markers=("<!-- openclaw:", "running inside OpenClaw", CARRIER_MARK),
    priorities=_priorities(before_carrier=55, assistant_start=45, user_start=35),
    edits=("runtime_context_removed", "reasoning_dropped", "tool_result_cleared", "compaction"))
CODEX = ClientProfile(
    name="codex", session_headers=("session-id", "session_id", "thread-id"),
    parent_headers=("x-codex-parent-thread-id",), agent_headers=("x-openai-subagent",),
    user_agents=("codex_", "codex-", "codex/"), id_headers=(("originator", "codex"),),
    markers=("running in the Codex CLI",),
    side_markers=("CONTEXT CHECKPOINT COMPACTION",),
    side_headers=(("x-openai-subagent", "compact"),),
    priorities=_priorities(message_end=50),
    edits=("appended", "compaction"))
SWE_AGENT = ClientProfile(
    name="swe-agent", session_headers=GENERIC_SESSION_HEADERS,
    markers=("SETTING: You are an autonomous programmer",),
    priorities=_priorities(tool_result_start=40, user_start=35),
    edits=("appended", "tool_result_cleared"))
MINI_SWE_AGENT = ClientProfile(
    name="mini-swe-agent", session_headers=GENERIC_SESSION_HEADERS,
    markers=("You are a helpful assistant that can interact with a computer", "<pr_description>",
             "Please solve this issue:"),
    priorities=_priorities(message_end=50),
    edits=("appended",))
GENERIC = ClientProfile(name="generic", session_headers=GENERIC_SESSION_HEADERS, edits=("appended",))

# Detection order: header / user-agent evidence first (exact), then text markers.
PROFILES: tuple[ClientProfile, ...] = (CLAUDE_CODE, OPENCODE, CODEX, OPENCLAW, SWE_AGENT, MINI_SWE_AGENT)
BY_NAME: Mapping[str, ClientProfile] = MappingProxyType({p.name: p for p in (*PROFILES, GENERIC)})

_OPENCLAW_SESSION = re.compile(r"\bsessionId=([A-Za-z0-9_.:-]{6,})")


@dataclass(frozen=True)
class Detection:
    profile: ClientProfile
    session_key: str | None       # the client's own session id (None: hash the prefix)
    key_source: str               # header name, "content" or "prefix-hash"
    parent: str | None = None     # parent session of a sub-agent
    side: str | None = None       # why this is a side request, or None


def _lower(headers: Mapping[str, str]) -> dict[str, str]:
    return {k.lower(): v for k, v in headers.items()}


def _identify(req: ChatRequest, h: Mapping[str, str]) -> ClientProfile:
    ua = h.get("user-agent", "").lower()
    for p in PROFILES:
        if any(ua.startswith(u) for u in p.user_agents):
            return p
        if any(h.get(name, "").lower().startswith(v) for name, v in p.id_headers):
            return p
        if p.session_headers and p.session_headers[0] in h and p.session_headers[0] not in GENERIC_SESSION_HEADERS:
            return p  # a header only this client sends
    text = system_text(req)[:20000] + "\n" + first_user_text(req)[:4000]
    tail = req.messages[-1].content[:200] if req.messages else ""
    for p in PROFILES:
        if any(m in text or m in tail for m in p.markers):
            return p
    return GENERIC


def prefix_key(req: ChatRequest) -> str:
    """A session key for clients that send none: the normalised system prompt plus the first user
    message, which every later request of the conversation repeats unchanged."""
    src = system_text(req) + "\x00" + first_user_text(req)
    return "h-" + hashlib.sha256(src.encode()).hexdigest()[:16]


def detect(req: ChatRequest) -> Detection:
    h = _lower(req.headers)
    profile = _identify(req, h)
    key, source = None, "prefix-hash"
    for name in (*profile.session_headers, *GENERIC_SESSION_HEADERS):
        if h.get(name):
            key, source = h[name], name
            break
    if key is None and profile is OPENCLAW:
        m = next((m for m in (_OPENCLAW_SESSION.search(x.content) for x in req.messages if x.role == "user") if m),
                 None)
        if m:
            key, source = m.group(1), "content"
    parent = next((h[n] for n in profile.parent_headers if h.get(n)), None)
    agent = next((h[n] for n in profile.agent_headers if h.get(n)), None)
    if key is not None and agent and not any(h.get(n, "").lower() == v for n, v in profile.side_headers):
        # a sub-agent inside the client's session: its own session
        parent, key = parent or key, f"{key}/{agent}"
    side = _side_reason(req, profile, h)
    return Detection(profile=profile, session_key=key, key_source=source, parent=parent, side=side)


def _side_reason(req: ChatRequest, profile: ClientProfile, h: Mapping[str, str]) -> str | None:
    if any(h.get(name, "").lower() == value for name, value in profile.side_headers):
        return "header"
    sys_text = system_text(req)
    first = first_user_text(req)
    last = next((m.content for m in reversed(req.messages) if m.role == "user"), "")
    # Side prompts put their instruction first: look at the heads only, never deep in a long history.
    heads = (sys_text[:2000], first[:2000], last[:2000])
    for marker in profile.side_markers:
        if any(marker in h for h in heads):
            return "marker"
    if not req.tools and not sys_text and len(req.messages) == 1 and "[Assistant" in first:
        return "compaction"  # OpenCode's compaction request: no system, no tools, a serialised history
    return None
