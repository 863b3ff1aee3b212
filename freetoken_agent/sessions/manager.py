"""The session manager: every chat request passes through it before the engine and after it.

Contract (used by `ChatService`, from one asyncio loop):
- `normalise(req)` -> the request to render (see `normalise.py`), with the session's echoes
  reconciled (`echo.py`): the client's echo of the reply the engine generated for the session's
  previous request, when it is semantically that reply, is replaced by the message that renders
  to the generated text (arguments in generated order, the profile's `echo_additions` dropped);
  earlier echoes reconciled so are replaced the same way on every later request, so the prefix
  the engine cached keeps matching.
- `plan(req, ids)` (req normalised, ids its rendered prompt) -> `RequestPlan`: the client profile,
  the session id (the client's own id, else a hash of system prompt + first user message; None for
  a side request without a client id), whether it is a side request, the engine session tag, the
  ranked `Anchor`s and `DecodeAnchor`s under the server's `AnchorPolicy`, and where the prompt
  diverged from the session's previous request (prompt + generated ids) and why. Planning does not
  change any session.
- `record(plan, ids, output, handle, ttft_ms, finish_reason)` files the finished turn: reused and
  recomputed tokens (from the engine's `ReuseInfo` when it reports one, else its cached-token
  count), the checkpoint that served it, the echo's outcome (`echo`: reconciled, rewritten, or
  which part differed), and, for main requests, remembers the request as the
  session's new reference and teaches the per-client kind scores (`learning.py`). The turn's
  `checkpoints_held` / `checkpoint_bytes` (the session's checkpoints in the engine right after it)
  are filled in shortly after, off the event loop.
- `sessions()` / `session(id)` -> JSON-ready inspection dicts (`GET /v1/sessions[/{id}]`).

Side requests (titles, summaries, compaction prompts: a profile marker, or a request in a known
session whose system prompt and tool list both differ from the session's main ones) get no engine
session tag (the engine's policy evicts untagged, non-returning snapshots first), only
`system_end` + `prompt_end` anchors, no decode anchors and priorities lowered by `SIDE_PENALTY`,
so they never evict the main conversation's checkpoints. They are still counted in their
session's record. Sub-agents (parent headers) are sessions of their own with a `parent`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from freetoken_agent.service.types import ChatMessage, ChatRequest
from freetoken_agent.sessions.anchors import AnchorPlanner, AnchorPolicy
from freetoken_agent.sessions.divergence import Divergence, Snapshot, classify
from freetoken_agent.sessions.echo import EchoOutcome, EchoReconciler
from freetoken_agent.sessions.engine_api import Anchor, DecodeAnchor, engine_checkpoints, reuse_of
from freetoken_agent.sessions.learning import KindScores, serving_anchor
from freetoken_agent.sessions.normalise import message_key, normalise, system_text, tool_names
from freetoken_agent.sessions.profiles import Detection, detect, prefix_key
from freetoken_agent.tokenizer import ChatTokenizer

SIDE_PENALTY = 100
MAX_SESSIONS = 256
MAX_TURNS = 500


@dataclass
class RequestPlan:
    detection: Detection
    session_id: str | None
    side: str | None
    engine_session: str | None
    anchors: list[Anchor]
    decode_anchors: list[DecodeAnchor]
    messages: tuple[ChatMessage, ...]
    tools: tuple[str, ...]
    starts: list[int] | None
    divergence: Divergence | None
    echo: dict[str, Any] | None = None  # the outcome for the echo of the previous reply

    @property
    def client(self) -> str:
        return self.detection.profile.name


@dataclass
class Session:
    id: str
    client: str
    key_source: str
    parent: str | None
    created: float = field(default_factory=time.time)
    last_activity: float = field(default_factory=time.time)
    turn_count: int = 0
    side_requests: int = 0
    turns: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=MAX_TURNS))
    snapshot: Snapshot | None = None
    anchor_positions: list[tuple[int, str]] = field(default_factory=list)  # of the snapshot request
    anchors: list[dict[str, Any]] = field(default_factory=list)            # last main plan, for inspection
    main_tools: tuple[str, ...] | None = None
    main_system: str | None = None
    # message index -> (the client's echo, as message_key, the message rendered for it)
    echoes: dict[int, tuple[str, ChatMessage]] = field(default_factory=dict)
    # (message index, key of the message rendered) -> outcome of reconciling that echo
    echo_outcomes: OrderedDict[tuple[int, str], EchoOutcome] = field(default_factory=OrderedDict)


class SessionManager:
    def __init__(self, tokenizer: ChatTokenizer, policy: AnchorPolicy | str = AnchorPolicy.SEMANTIC,
                 engine: Any = None) -> None:
        self.tokenizer = tokenizer
        self.policy = AnchorPolicy(policy)
        self.engine = engine
        self.planner = AnchorPlanner(tokenizer)
        self.echo = EchoReconciler(tokenizer)
        self.scores = KindScores()
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ before the engine
    def normalise(self, req: ChatRequest) -> ChatRequest:
        return self._reconcile(normalise(req))

    def _reconcile(self, req: ChatRequest) -> ChatRequest:
        det = detect(req)
        if det.side is not None:
            return req
        with self._lock:
            sess = self._sessions.get(det.session_key or prefix_key(req))
            if sess is None:
                return req
            snap, known = sess.snapshot, dict(sess.echoes)
        messages = list(req.messages)
        applied = set()
        for k, (client_key, rendered) in known.items():
            if k < len(messages) and messages[k].role == "assistant" and message_key(messages[k]) == client_key:
                messages[k] = rendered
                applied.add(k)
        k = len(snap.messages) if snap is not None else -1
        if snap is not None and snap.starts and k < len(messages) and messages[k].role == "assistant" \
                and k not in applied:
            generated = self.tokenizer.decode(snap.ids[snap.starts[-1]:])
            client = messages[k]
            outcome = self.echo.reconcile(client, generated, det.profile.echo_additions)
            with self._lock:
                sess.echo_outcomes[(k, message_key(outcome.message))] = outcome
                while len(sess.echo_outcomes) > 8:
                    sess.echo_outcomes.popitem(last=False)
                if outcome.changed:
                    sess.echoes[k] = (message_key(client), outcome.message)
            messages[k] = outcome.message
            if outcome.changed:
                applied.add(k)
        if not applied:  # (messages compare equal across argument order: count replacements instead)
            return req
        return dataclasses.replace(req, messages=messages)

    def plan(self, req: ChatRequest, ids: list[int]) -> RequestPlan:
        det = detect(req)
        tools = tool_names(req)
        key = det.session_key or prefix_key(req)
        with self._lock:
            sess = self._sessions.get(key)
        sid: str | None = key
        side = det.side
        if side is None and sess is not None and sess.main_tools is not None and tools != sess.main_tools \
                and system_text(req) != sess.main_system:
            side = "different prompt"  # same session, another system prompt and tool set: a side call
        if side is not None and det.session_key is None:
            sid = None  # nothing to key it by: it joins no session
        profile = det.profile
        penalty = SIDE_PENALTY if side else 0

        def priority_of(kind: str) -> int:
            return self.scores.priority(profile, kind) - penalty

        messages = tuple(req.messages)
        starts = self.planner.message_starts(ids, messages, bool(req.tools))
        anchors = self.planner.plan(self.policy, messages, ids, starts, priority_of)
        decode: list[DecodeAnchor] = []
        if side:
            anchors = [a for a in anchors if a.kind in ("system_end", "prompt_end")]
        else:
            decode = self.planner.decode_anchors(self.policy, priority_of)
        divergence = None
        echo = None
        if not side and sess is not None and sess.snapshot is not None:
            divergence = classify(sess.snapshot, messages, tools, ids, starts)
            k = len(sess.snapshot.messages)
            with self._lock:
                outcome = sess.echo_outcomes.get((k, message_key(messages[k]))) if k < len(messages) else None
            if outcome is not None:
                echo = {"message": k, "reconciled": outcome.reconciled, "rewritten": outcome.changed,
                        "differed": outcome.differed}
        # Side requests carry no tag: a shared "<id>#side" tag would make the side calls look like a
        # returning conversation to the engine, whose policy then protects their snapshots.
        tag = None if side else sid
        return RequestPlan(detection=det, session_id=sid, side=side, engine_session=tag, anchors=anchors,
                           decode_anchors=decode, messages=messages, tools=tools, starts=starts,
                           divergence=divergence, echo=echo)

    # ------------------------------------------------------------------ after the engine
    def record(self, plan: RequestPlan, ids: list[int], output: list[int], handle: Any,
               ttft_ms: float | None, finish_reason: str) -> dict[str, Any] | None:
        if plan.session_id is None:
            return None
        det = plan.detection
        with self._lock:
            sess = self._sessions.get(plan.session_id)
            if sess is None:
                sess = Session(id=plan.session_id, client=det.profile.name, key_source=det.key_source,
                               parent=det.parent)
                self._sessions[plan.session_id] = sess
                while len(self._sessions) > MAX_SESSIONS:
                    self._sessions.popitem(last=False)
            self._sessions.move_to_end(plan.session_id)
            turn = self._turn(sess, plan, ids, output, handle, ttft_ms, finish_reason)
            sess.last_activity = time.time()
            if plan.side:
                sess.side_requests += 1
            else:
                sess.turn_count += 1
                sess.client = det.profile.name
                self._remember(sess, plan, ids, output)
            sess.turns.append(turn)
        self._count_held(sess.id, turn)
        return turn

    def _count_held(self, sid: str, turn: dict[str, Any]) -> None:
        """Fills the turn's `checkpoints_held` / `checkpoint_bytes` off the event loop: the engine's
        listing waits for its current step, which must not stall other streams."""
        if self.engine is None:
            return

        def fill() -> None:
            held, nbytes = self._held(sid)
            turn["checkpoints_held"] = None if held is None else len(held)
            turn["checkpoint_bytes"] = nbytes

        try:
            asyncio.get_running_loop().run_in_executor(None, fill)
        except RuntimeError:  # no loop (direct use from a thread): count now
            fill()

    def _turn(self, sess: Session, plan: RequestPlan, ids: list[int], output: list[int], handle: Any,
              ttft_ms: float | None, finish_reason: str) -> dict[str, Any]:
        reuse = reuse_of(handle)
        cached = int(getattr(handle, "cached_tokens", 0) or 0)
        if reuse is not None:
            kv, state_pos, kind = int(reuse.kv_tokens), int(reuse.state_position), reuse.checkpoint_kind
            from_host: bool | None = bool(reuse.from_host)
            recomputed = int(reuse.recomputed_tokens)
            reused = len(ids) - recomputed
        else:  # an engine without ReuseInfo: its prefix match is both the KV and the state position
            kv = state_pos = reused = cached
            recomputed, from_host = len(ids) - cached, None
            kind = dict(sess.anchor_positions).get(cached) if cached else None
        div = plan.divergence
        would = None
        if div is not None and sess.snapshot is not None:
            would = serving_anchor(sess.anchor_positions, min(div.position, len(sess.snapshot.ids)))
            if not plan.side:
                kinds = [would[1]] if would else []
                if kind and kind not in kinds:
                    kinds.append(kind)
                self.scores.learn(plan.client, kinds)
        return {
            "index": sess.turn_count + sess.side_requests, "at": time.time(), "side": plan.side,
            "client": plan.client, "prompt_tokens": len(ids), "completion_tokens": len(output),
            "reused_tokens": reused, "recomputed_tokens": recomputed, "kv_reused_tokens": kv,
            "state_reused_tokens": state_pos, "checkpoint_position": state_pos if state_pos else None,
            "checkpoint_kind": kind, "from_host": from_host,
            "divergence_position": div.position if div else None, "divergence_cause": div.cause if div else None,
            "divergence_message": div.message if div else None, "echo": plan.echo,
            "would_serve_position": would[0] if would else None, "would_serve_kind": would[1] if would else None,
            "anchors": len(plan.anchors), "decode_anchors": [d.kind for d in plan.decode_anchors],
            "ttft_ms": None if ttft_ms is None else round(ttft_ms, 3), "expert_cache_hit_rate": None,
            "finish_reason": finish_reason, "checkpoints_held": None, "checkpoint_bytes": None,
        }

    def _remember(self, sess: Session, plan: RequestPlan, ids: list[int], output: list[int]) -> None:
        sess.snapshot = Snapshot(messages=plan.messages, tools=plan.tools, prompt_len=len(ids),
                                 ids=array("i", ids + output), starts=tuple(plan.starts) if plan.starts else None,
                                 thinking_end_id=self.planner.decode_ids.get("thinking_end"))
        realised = self.planner.realised_decode_positions(len(ids), output, plan.decode_anchors)
        sess.anchor_positions = sorted([(a.position, a.kind) for a in plan.anchors] + realised)
        sess.anchors = [{"position": a.position, "kind": a.kind, "priority": a.priority} for a in plan.anchors] + \
            [{"position": p, "kind": k, "priority": None, "decode": True} for p, k in realised]
        if sess.main_tools is None or plan.tools:
            sess.main_tools = plan.tools
            sess.main_system = "\n".join(m.content for m in plan.messages if m.role == "system")

    # ------------------------------------------------------------------ inspection
    def _held(self, sid: str) -> tuple[list[dict[str, Any]] | None, int | None]:
        if self.engine is None:
            return None, None
        held = engine_checkpoints(self.engine, sid)
        if held is None:
            return None, None
        return held, sum(int(c.get("bytes", 0) or 0) for c in held)

    def sessions(self) -> list[dict[str, Any]]:
        with self._lock:
            items = list(self._sessions.values())
        out = []
        for s in reversed(items):  # most recent first
            held, nbytes = self._held(s.id)
            out.append({"id": s.id, "client": s.client, "parent": s.parent, "turns": s.turn_count,
                        "side_requests": s.side_requests, "created": s.created, "last_activity": s.last_activity,
                        "checkpoints": None if held is None else len(held), "checkpoint_bytes": nbytes})
        return out

    def session(self, sid: str) -> dict[str, Any] | None:
        with self._lock:
            s = self._sessions.get(sid)
            if s is None:
                return None
            turns = list(s.turns)
        held, nbytes = self._held(s.id)
        from freetoken_agent.sessions.profiles import BY_NAME

        profile = BY_NAME.get(s.client)
        return {"id": s.id, "client": s.client, "key_source": s.key_source, "parent": s.parent,
                "policy": self.policy.value, "created": s.created, "last_activity": s.last_activity,
                "turns_count": s.turn_count, "side_requests": s.side_requests,
                "checkpoints": held, "checkpoint_bytes": nbytes, "anchors": s.anchors,
                "kind_ranking": self.scores.ranking(profile) if profile else [],
                "turns": turns}
