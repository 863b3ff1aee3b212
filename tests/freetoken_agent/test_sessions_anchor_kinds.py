"""Each anchor kind the session manager places serves a later, edited request exactly: on the hybrid
demo model (Gated DeltaNet + attention), a request that diverges right at a checkpoint of kind K
restores that checkpoint (ReuseInfo names K and its position) and yields the same logits, step by
step, as a cold prefill of the same prompt."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from engine.engine import Engine
from engine.options import EngineOptions
from engine.sampling import SamplingParams
from freetoken_agent.sessions.anchors import AnchorPolicy
from freetoken_agent.sessions.manager import SessionManager
from freetoken_agent.sessions.profiles import CARRIER_MARK
from freetoken_agent.tokenizer import ChatTokenizer
from tests.freetoken_agent.sessions_support import asst, render, req, sys_, tool, user

PROMPT_KINDS = ["system_end", "user_start", "assistant_start", "tool_result_start", "system_turn_start",
                "before_carrier", "reply_start", "prompt_end"]
DECODE_KINDS = ["thinking_end", "tool_call_start", "argument_end", "message_end"]


@pytest.fixture(scope="module")
def setup(demo_model: Callable[[str], Path]):
    model = demo_model("qwen3_5_moe")
    tok = ChatTokenizer.from_dir(model)
    conversation = req(
        sys_("You are a careful coding agent."),
        user("Fix the failing test in calc.py."),
        asst("", reasoning="Look at the file first.", call=("read", {"path": "calc.py"})),
        tool("def add(a, b):\n    return a - b\n"),
        sys_("Note: the repository uses pytest."),  # a system turn inside the conversation
        user("Go on."),
        user(f"{CARRIER_MARK}\nruntime: cwd=/repo sessionId=s1"),  # OpenClaw's trailing runtime-context carrier
    )
    ids = render(tok, conversation)
    plan = SessionManager(tok, AnchorPolicy.SEMANTIC).plan(conversation, ids)
    # the reply, forced, so the decode anchors are realised: thinking, a tool call whose first
    # argument is long enough for an argument_end checkpoint after it, end of message
    command = "pytest -q " + " ".join(f"tests/test_{i}.py" for i in range(40))
    reply = tok.encode("Subtraction is the bug.</think>\n\n<tool_call>\n<function=bash>\n<parameter=command>\n"
                       f"{command}\n</parameter>\n<parameter=timeout>\n60\n</parameter>\n</function>\n"
                       "</tool_call><|im_end|>")
    return model, tok, ids, plan, reply


def _logits(engine: Engine, prompt: list[int], **kw) -> tuple[list[torch.Tensor], object]:
    handle = engine.submit(prompt, SamplingParams(max_tokens=4, ignore_eos=True), capture_logits=True, **kw)
    handle.result(timeout=300)
    return handle.logits, handle.reuse


@pytest.fixture(scope="module")
def served(setup) -> Iterator[tuple[Engine, dict[str, int]]]:
    """One engine that served the conversation and its forced reply, and the checkpoints that turn
    took ({kind: position}). Each test's edited request then diverges on its own branch: it adds
    one `request_end` checkpoint there, which no other kind's request can reach, and the 32 slots
    hold all of them (12 + 12), so the tests share it in any order."""
    model, _, ids, plan, reply = setup
    with Engine(model, EngineOptions(dtype="float32", checkpoint_slots=32)) as engine:
        engine.submit(ids, SamplingParams(max_tokens=len(reply)), anchors=plan.anchors,
                      decode_anchors=plan.decode_anchors, session=plan.engine_session,
                      forced_output=reply).result(timeout=300)
        yield engine, {c["kind"]: c["position"] for c in engine.checkpoints()}


def _check(setup, served, kind: str) -> None:
    model, tok, ids, plan, reply = setup
    engine, held = served
    full = ids + reply
    assert kind in held, f"no {kind} checkpoint was taken (held: {sorted(held)})"
    pos = held[kind]
    edited = full[:pos] + tok.encode("An edit the cache has never seen.") + full[pos:pos + 3]
    got, reuse = _logits(engine, edited, session=plan.engine_session)
    assert reuse.checkpoint_kind == kind and reuse.state_position == pos, reuse
    assert reuse.recomputed_tokens == len(edited) - pos
    with Engine(model, EngineOptions(dtype="float32", checkpoint_slots=32)) as cold_engine:
        want, cold = _logits(cold_engine, edited)
    assert cold.state_position == 0
    for g, w in zip(got, want, strict=True):
        assert torch.allclose(g, w, rtol=1e-4, atol=1e-4 * w.abs().max().item()), (g - w).abs().max()


@pytest.mark.parametrize("kind", PROMPT_KINDS + DECODE_KINDS)
def test_turn_served_from_each_anchor_kind_equals_cold(setup, served, kind: str) -> None:
    _check(setup, served, kind)


def test_the_plan_places_every_kind(setup) -> None:
    _, _, ids, plan, _ = setup
    kinds = {a.kind for a in plan.anchors}
    assert set(PROMPT_KINDS) <= kinds, sorted(kinds)
    assert {d.kind for d in plan.decode_anchors} == set(DECODE_KINDS)
    assert all(0 < a.position < len(ids) for a in plan.anchors)
