"""Semantic anchors: prefill and decode checkpoints, the host spill tier, eviction policy, budgets,
and forced (replayed) output.

Every request served from a checkpoint is compared with a cold prefill of the same prompt on an
engine whose cache was just reset: same greedy tokens, logits within 1e-5 (relative), and
`RequestHandle.reuse` naming the checkpoint actually used.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from checkpoints import FULL, LIN, TinySpec, hf_step_logits, qwen3_5_moe_text, qwen3_moe_text, rel_err

from engine.anchors import Anchor, DecodeAnchor
from engine.engine import Engine
from engine.sampling import SamplingParams

HYBRID = TinySpec("anchors_q35", "qwen3_5_moe", qwen3_5_moe_text(layer_types=[LIN, LIN, FULL, LIN]), seed=21)
ATTN = TinySpec("anchors_q3", "qwen3_moe", qwen3_moe_text(), seed=22)
TOL = 1e-5


def toks(n: int, seed: int) -> list[int]:
    return [int(t) for t in torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(seed))]


PROMPT = toks(30, 1)


def greedy(n: int, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True, **kw)  # type: ignore[arg-type]


class Cold:
    """Reference runs: the same request on an engine with an empty cache."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def run(self, prompt: list[int], n: int = 4) -> tuple[list[int], torch.Tensor]:
        self.engine.reset_cache()
        h = self.engine.submit(prompt, greedy(n), capture_logits=True)
        out = h.result(timeout=120)
        assert h.reuse is not None and h.reuse.kv_tokens == 0 and h.reuse.recomputed_tokens == len(prompt)
        return out, torch.stack(h.logits)


def served(engine: Engine, cold: Cold, prompt: list[int], n: int = 4, **kw: object):  # type: ignore[no-untyped-def]
    """Runs `prompt` on `engine`, checks tokens and logits against the cold run; returns the handle."""
    h = engine.submit(prompt, greedy(n), capture_logits=True, **kw)  # type: ignore[arg-type]
    out = h.result(timeout=120)
    ref_out, ref_logits = cold.run(prompt, n)
    assert out == ref_out
    assert rel_err(torch.stack(h.logits), ref_logits) < TOL
    return h


def reuse(h) -> tuple[int, int, str | None, bool, int]:  # type: ignore[no-untyped-def]
    r = h.reuse
    assert r is not None
    return (r.kv_tokens, r.state_position, r.checkpoint_kind, r.from_host, r.recomputed_tokens)


def held(engine: Engine, session: str | None = None) -> dict[int, tuple[str, int, str]]:
    """position -> (kind, priority, tier) of the held checkpoints."""
    return {c["position"]: (c["kind"], c["priority"], c["tier"])  # type: ignore[misc]
            for c in engine.checkpoints(session)}


def budget_probe(engine: Engine) -> tuple[Callable[[int | None], None], list[str]]:
    """A listener that checks, on the engine thread after every token, that no budget is exceeded."""
    bad: list[str] = []
    s = engine.scheduler
    caps = engine.checkpoint_budget()

    def probe(_: int | None) -> None:
        if s.cache.num_snapshots > caps["device_slots"]:
            bad.append(f"device checkpoints {s.cache.num_snapshots} > {caps['device_slots']}")
        if s.cache.num_host_snapshots > caps["host_slots"]:
            bad.append(f"host checkpoints {s.cache.num_host_snapshots} > {caps['host_slots']}")
        working = sum(r.state_slot >= 0 for r in s.running)
        if s.states.num_free + s.cache.num_snapshots + working != s.states.capacity:
            bad.append("device state slots do not add up")
        if s.host_states.num_free + s.cache.num_host_snapshots != s.host_states.capacity:
            bad.append("host state slots do not add up")

    return probe, bad


def assert_baseline(engine: Engine) -> None:
    """Idle: every slot is free or held by the cache; after a reset, every slot is free."""
    with engine._step_lock:
        s = engine.scheduler
        assert not s.running and not s.waiting
        assert s.kv.num_free + s.cache.cached_tokens == s.kv.capacity
        assert s.states.num_free + s.cache.num_snapshots == s.states.capacity
        assert s.host_states.num_free + s.cache.num_host_snapshots == s.host_states.capacity
    engine.reset_cache()
    s = engine.scheduler
    assert s.kv.num_free == s.kv.capacity
    assert s.states.num_free == s.states.capacity and s.host_states.num_free == s.host_states.capacity
    b = engine.checkpoint_budget()
    assert b["device_used"] == 0 and b["host_used"] == 0 and engine.checkpoints() == []


@pytest.fixture
def hybrid(tiny_checkpoint, make_engine):  # type: ignore[no-untyped-def]
    path, model = tiny_checkpoint(HYBRID)
    return path, model, Cold(make_engine(path))


# ------------------------------------------------------------------------------------------ prefill
def test_prefill_anchors_deepest_before_divergence(hybrid, make_engine) -> None:  # type: ignore[no-untyped-def]
    path, _, cold = hybrid
    engine = make_engine(path)
    h = engine.submit(PROMPT, greedy(4), session="main",
                      anchors=[Anchor(10, "system_end", 5), Anchor(20, "user_start", 1), Anchor(30, "prompt_end", 2)])
    out = h.result(timeout=120)
    assert reuse(h) == (0, 0, None, False, 30)
    assert held(engine, "main") == {10: ("system_end", 5, "device"), 20: ("user_start", 1, "device"),
                                    30: ("prompt_end", 2, "device"), 33: ("request_end", 0, "device")}
    assert held(engine, "other") == {}
    c = engine.checkpoints()[0]
    assert c["session"] == "main" and c["bytes"] == engine.checkpoint_budget()["slot_bytes"] > 0
    # divergence inside (10, 20): the checkpoint at 10
    assert reuse(served(engine, cold, [*PROMPT[:15], 1, 2, 3])) == (10, 10, "system_end", False, 8)
    # divergence exactly at 20: tokens [0, 20) agree, so the checkpoint at 20 is usable
    assert reuse(served(engine, cold, [*PROMPT[:20], (PROMPT[20] + 1) % 128, 5])) == (20, 20, "user_start", False, 2)
    # divergence inside (20, 30)
    assert reuse(served(engine, cold, [*PROMPT[:27], 4])) == (20, 20, "user_start", False, 8)
    # the whole prompt plus more: the prompt_end checkpoint
    assert reuse(served(engine, cold, [*PROMPT, 9, 9])) == (30, 30, "prompt_end", False, 2)
    # prompt and output, extended: the request_end checkpoint (all computed tokens)
    ext = [*PROMPT, *out, 7]
    assert reuse(served(engine, cold, ext)) == (33, 33, "request_end", False, len(ext) - 33)
    assert_baseline(engine)


def test_legacy_checkpoints_are_position_anchors(hybrid, make_engine) -> None:  # type: ignore[no-untyped-def]
    path, _, cold = hybrid
    engine = make_engine(path, prefill_chunk=7)  # chunks also end at the checkpoint, off the chunk grid
    engine.submit(PROMPT, greedy(2), checkpoints=[12, 12]).result(timeout=120)
    assert held(engine)[12] == ("position", 0, "device")
    assert reuse(served(engine, cold, [*PROMPT[:14], 3])) == (12, 12, "position", False, 3)
    # an explicit anchor at the same position takes precedence over the legacy one
    engine.reset_cache()
    engine.submit(PROMPT, greedy(2), checkpoints=[12], anchors=[Anchor(12, "user_start", 3)]).result(timeout=120)
    assert held(engine)[12] == ("user_start", 3, "device")
    assert_baseline(engine)


def test_attention_only_model_reuses_kv_without_snapshots(tiny_checkpoint, make_engine) -> None:  # type: ignore[no-untyped-def]
    path, _ = tiny_checkpoint(ATTN)
    engine, cold = make_engine(path), Cold(make_engine(path))
    engine.submit(PROMPT, greedy(2), anchors=[Anchor(10, "system_end", 5)], session="main").result(timeout=120)
    assert reuse(served(engine, cold, [*PROMPT[:15], 1, 2])) == (15, 15, None, False, 2)
    assert engine.checkpoints() == []
    assert engine.checkpoint_budget() == {"device_slots": 0, "device_used": 0, "host_slots": 0, "host_used": 0,
                                          "slot_bytes": 0}


# ------------------------------------------------------------------------------------------ decode
def _first_new(out: list[int], start: int = 1) -> int:
    """Index of the first output token (from `start`) that did not occur before it."""
    return next(i for i in range(start, len(out)) if out[i] not in out[:i])


def test_decode_anchor_checkpoints_state_after_the_token(hybrid, make_engine) -> None:  # type: ignore[no-untyped-def]
    path, model, cold = hybrid
    ref, _ = cold.run(PROMPT, 8)
    i = _first_new(ref)
    engine = make_engine(path)
    h = engine.submit(PROMPT, greedy(8), capture_logits=True, session="main",
                      decode_anchors=[DecodeAnchor(ref[i], "thinking_end", 4)])
    assert h.result(timeout=120) == ref
    assert len(h.logits) == 8
    pos = len(PROMPT) + i + 1  # the state after computing output[i]
    assert held(engine)[pos] == ("thinking_end", 4, "device")
    # a later prompt containing the generated text up to the anchor token reuses it exactly
    follow = [*PROMPT, *ref[:i + 1], 5, 6]
    assert reuse(served(engine, cold, follow)) == (pos, pos, "thinking_end", False, 2)
    # the reference of the reference: transformers stepping through the same tokens
    h2 = engine.submit(follow, greedy(2), capture_logits=True)
    out2 = h2.result(timeout=120)
    assert rel_err(torch.stack(h2.logits), hf_step_logits(model, follow, out2[:-1])) < 1e-4
    assert_baseline(engine)


@pytest.mark.parametrize("ending", ["length", "stop"])
def test_decode_anchor_on_the_last_token(hybrid, make_engine, ending: str) -> None:  # type: ignore[no-untyped-def]
    """A request that ends on an anchor token computes it in one extra step: the checkpoint is the
    state after it, and the caller sees exactly the tokens and logits of an ordinary request."""
    path, _, cold = hybrid
    ref, ref_logits = cold.run(PROMPT, 8)
    i = _first_new(ref, 2)
    engine = make_engine(path)
    params = greedy(i + 1) if ending == "length" else greedy(50, stop_token_ids=[ref[i]])
    h = engine.submit(PROMPT, params, capture_logits=True, decode_anchors=[DecodeAnchor(ref[i], "message_end", 2)])
    assert h.result(timeout=120) == ref[:i + 1]
    assert h.finish_reason == ending
    assert rel_err(torch.stack(h.logits), ref_logits[:i + 1]) < TOL
    pos = len(PROMPT) + i + 1
    assert held(engine)[pos] == ("message_end", 2, "device")
    assert max(held(engine)) == pos
    follow = [*PROMPT, *ref[:i + 1], 3]
    assert reuse(served(engine, cold, follow)) == (pos, pos, "message_end", False, 1)
    assert_baseline(engine)


# ------------------------------------------------------------------------------------------ host tier
def test_spill_to_host_and_restore(hybrid, make_engine) -> None:  # type: ignore[no-untyped-def]
    path, _, cold = hybrid
    engine = make_engine(path, checkpoint_slots=1, host_checkpoint_slots=4)
    probe, bad = budget_probe(engine)
    engine.submit(PROMPT, greedy(3), anchors=[Anchor(10, "system_end", 0), Anchor(20, "user_start", 0)],
                  listener=probe).result(timeout=120)
    # one device slot: each newer checkpoint pushed the older one down to the host tier
    assert held(engine) == {10: ("system_end", 0, "host"), 20: ("user_start", 0, "host"),
                            32: ("request_end", 0, "device")}
    h = served(engine, cold, [*PROMPT[:15], 8], listener=probe)
    assert reuse(h) == (10, 10, "system_end", True, 6)
    h = served(engine, cold, [*PROMPT[:25], 8], listener=probe)
    assert reuse(h) == (20, 20, "user_start", True, 6)
    b = engine.checkpoint_budget()
    assert (b["device_slots"], b["host_slots"]) == (1, 4) and b["device_used"] <= 1 and b["host_used"] <= 4
    assert not bad
    assert_baseline(engine)


def test_full_host_tier_drops_by_policy(hybrid, make_engine) -> None:  # type: ignore[no-untyped-def]
    path, _, cold = hybrid
    engine = make_engine(path, checkpoint_slots=1, host_checkpoint_slots=1)
    probe, bad = budget_probe(engine)
    engine.submit(PROMPT, greedy(1), listener=probe,
                  anchors=[Anchor(5, "a", 0), Anchor(10, "b", 3), Anchor(15, "c", 4)]).result(timeout=120)
    # 10 pushed 5 down to the host; 15 pushed 10 down, and on the full host tier 10 (priority 3)
    # displaced 5 (priority 0); the end state (priority 0) ranks below everything: not kept
    assert held(engine) == {10: ("b", 3, "host"), 15: ("c", 4, "device")}
    assert reuse(served(engine, cold, [*PROMPT[:12], 1], listener=probe)) == (10, 10, "b", True, 3)
    assert reuse(served(engine, cold, [*PROMPT[:8], 1], listener=probe)) == (0, 0, None, False, 9)
    assert not bad
    assert_baseline(engine)


def test_outranked_new_checkpoint_goes_straight_to_host(hybrid, make_engine) -> None:  # type: ignore[no-untyped-def]
    path, _, cold = hybrid
    engine = make_engine(path, checkpoint_slots=1, host_checkpoint_slots=4)
    out = engine.submit(PROMPT, greedy(3), anchors=[Anchor(10, "system_end", 5)]).result(timeout=120)
    # the end state (priority 0) ranks below the device's only checkpoint: stored on the host
    assert held(engine) == {10: ("system_end", 5, "device"), 32: ("request_end", 0, "host")}
    assert reuse(served(engine, cold, [*PROMPT, *out[:2], 1])) == (32, 32, "request_end", True, 1)
    assert_baseline(engine)


def test_zero_host_slots_drops_instead_of_spilling(hybrid, make_engine) -> None:  # type: ignore[no-untyped-def]
    path, _, cold = hybrid
    engine = make_engine(path, checkpoint_slots=1, host_checkpoint_slots=0)
    engine.submit(PROMPT, greedy(1), anchors=[Anchor(10, "a", 0), Anchor(20, "b", 0)]).result(timeout=120)
    assert held(engine) == {30: ("request_end", 0, "device")}
    assert reuse(served(engine, cold, [*PROMPT[:25], 1])) == (0, 0, None, False, 26)
    assert_baseline(engine)


# ------------------------------------------------------------------------------------------ eviction
@pytest.mark.parametrize("main_session", ["main", None])
def test_side_request_flood_keeps_main_session_anchors(hybrid, make_engine, main_session: str | None) -> None:  # type: ignore[no-untyped-def]
    """A returning session's best anchors survive a flood of one-off side sessions whose anchors
    have the same kinds and priorities; without a session tag they are evicted like any other."""
    path, _, cold = hybrid
    engine = make_engine(path, checkpoint_slots=3, host_checkpoint_slots=2, max_running=1)
    probe, bad = budget_probe(engine)
    main_anchors = [Anchor(10, "system_end", 5), Anchor(20, "user_start", 5)]
    for turn in range(2):
        engine.submit([*PROMPT, turn], greedy(3), anchors=main_anchors, session=main_session,
                      listener=probe).result(timeout=120)
    for k in range(12):
        side = toks(30, 100 + k)
        engine.submit(side, greedy(3), session=f"side-{k}", listener=probe,
                      anchors=[Anchor(10, "system_end", 5), Anchor(20, "user_start", 5)]).result(timeout=120)
        assert engine.checkpoint_budget()["device_used"] <= 3
    assert not bad
    positions = {c["position"] for c in engine.checkpoints() if c["session"] == main_session}
    if main_session is None:
        assert positions == set()
        return
    assert positions == {10, 20}
    assert {c["tier"] for c in engine.checkpoints(main_session)} == {"device"}
    h = served(engine, cold, [*PROMPT[:25], 2, 2], session="main")
    assert reuse(h) == (20, 20, "user_start", False, 7)
    assert_baseline(engine)


def test_side_request_evicts_its_own_snapshots_first(hybrid, make_engine) -> None:  # type: ignore[no-untyped-def]
    path, _, _ = hybrid
    engine = make_engine(path, checkpoint_slots=3, host_checkpoint_slots=0, max_running=1)
    engine.submit(toks(30, 7), greedy(1), session="a", anchors=[Anchor(10, "x", 1)]).result(timeout=120)
    engine.submit(toks(30, 8), greedy(1), session="b", anchors=[Anchor(10, "x", 1)]).result(timeout=120)
    # device: a@10, b@10 (priority 1), and b's end state (priority 0) was not kept over... room: 3 slots
    before = {(c["session"], c["position"]) for c in engine.checkpoints()}
    assert ("a", 10) in before and ("b", 10) in before
    engine.submit(toks(30, 9), greedy(1), session="c",
                  anchors=[Anchor(5, "x", 1), Anchor(10, "x", 1), Anchor(15, "x", 1)]).result(timeout=120)
    after = {(c["session"], c["position"]) for c in engine.checkpoints()}
    # c's later anchors displaced c's earlier ones, never a's or b's of the same priority
    assert ("a", 10) in after and ("b", 10) in after and ("c", 15) in after
    assert_baseline(engine)


def test_lower_priority_goes_first(hybrid, make_engine) -> None:  # type: ignore[no-untyped-def]
    path, _, _ = hybrid
    engine = make_engine(path, checkpoint_slots=2, host_checkpoint_slots=0)
    engine.submit(PROMPT, greedy(1), anchors=[Anchor(5, "a", 9), Anchor(10, "b", 0), Anchor(15, "c", 4)]
                  ).result(timeout=120)
    assert {p: k for p, (k, _, _) in held(engine).items()} == {5: "a", 15: "c"}
    assert_baseline(engine)


def test_working_states_never_wait_for_checkpoints(hybrid, make_engine) -> None:  # type: ignore[no-untyped-def]
    """With an explicit shared pool full of checkpoints, admission spills one to the host tier."""
    path, _, cold = hybrid
    engine = make_engine(path, state_slots=2, max_running=2, checkpoint_slots=2, host_checkpoint_slots=4)
    engine.submit(PROMPT, greedy(1), anchors=[Anchor(10, "a", 1)]).result(timeout=120)
    assert engine.checkpoint_budget()["device_used"] == 2  # the anchor and the end state: pool full
    h = served(engine, cold, [*PROMPT[:12], 1])
    assert reuse(h)[:4] == (10, 10, "a", False)
    # admission moved the lower-priority end state down to the host tier to get a working slot
    assert held(engine)[30] == ("request_end", 0, "host")
    assert reuse(served(engine, cold, [*PROMPT, 5]))[:4] == (30, 30, "request_end", True)
    assert_baseline(engine)


# ------------------------------------------------------------------------------------------ forced
def test_forced_output_equal_to_greedy(hybrid, make_engine) -> None:  # type: ignore[no-untyped-def]
    path, _, cold = hybrid
    ref, ref_logits = cold.run(PROMPT, 8)
    engine = make_engine(path)
    h = engine.submit(PROMPT, greedy(100), capture_logits=True, forced_output=ref[:5])
    assert h.result(timeout=120) == ref[:5]
    assert h.finish_reason == "stop"
    assert rel_err(torch.stack(h.logits), ref_logits[:5]) < TOL
    assert_baseline(engine)


def test_forced_output_feeds_the_forced_ids(hybrid, make_engine) -> None:  # type: ignore[no-untyped-def]
    path, model, cold = hybrid
    ref, _ = cold.run(PROMPT, 4)
    forced = [(t + 1) % 128 for t in ref]  # never the greedy ids
    engine = make_engine(path)
    h = engine.submit(PROMPT, greedy(100), capture_logits=True, forced_output=forced)
    assert h.result(timeout=120) == forced and h.finish_reason == "stop"
    # the logits are the model's on the forced continuation (transformers as the reference)
    assert rel_err(torch.stack(h.logits), hf_step_logits(model, PROMPT, forced[:-1])) < 1e-4
    assert torch.stack(h.logits).argmax(-1).tolist()[0] == ref[0]
    # the next request's prefix is what the engine computed: prompt + forced ids
    ext = [*PROMPT, *forced, 1]
    assert reuse(served(engine, cold, ext)) == (33, 33, "request_end", False, len(ext) - 33)
    # max_tokens still applies
    h = engine.submit(PROMPT, greedy(2), forced_output=forced)
    assert h.result(timeout=120) == forced[:2] and h.finish_reason == "length"
    # an empty list: prefill only
    h = engine.submit(PROMPT, greedy(5), forced_output=[], capture_logits=True)
    assert h.result(timeout=120) == [] and h.finish_reason == "stop" and h.logits == []
    assert_baseline(engine)


def test_kv_pressure_evicts_leaves_without_snapshots_first(hybrid, make_engine) -> None:  # type: ignore[no-untyped-def]
    """On a hybrid model a radix leaf without a snapshot cannot be resumed inside; under KV
    pressure it goes before an older leaf that holds a (protected) checkpoint."""
    path, _, cold = hybrid
    engine = make_engine(path, kv_tokens=80, checkpoint_slots=1, host_checkpoint_slots=0, max_running=1)
    a, b, c = PROMPT, toks(30, 61), toks(30, 62)
    for _ in range(2):  # session "a" returns: its best checkpoint is protected
        engine.submit(a, greedy(1), session="a", anchors=[Anchor(30, "prompt_end", 0)]).result(timeout=120)
    engine.submit(b, greedy(1), session="b").result(timeout=120)  # its end state is not kept
    assert held(engine) == {30: ("prompt_end", 0, "device")}
    engine.submit(c, greedy(1), session="c").result(timeout=120)  # needs b's or a's KV
    assert reuse(served(engine, cold, [*a, 1], session="a")) == (30, 30, "prompt_end", False, 1)
    assert_baseline(engine)


def test_bad_forced_ids_are_rejected(hybrid, make_engine) -> None:  # type: ignore[no-untyped-def]
    from engine.errors import RequestError

    path, _, _ = hybrid
    engine = make_engine(path)
    with pytest.raises(RequestError, match="forced_output"):
        engine.submit(PROMPT, forced_output=[1, 128])
    with pytest.raises(RequestError, match="Anchor"):
        engine.submit(PROMPT, anchors=[10])  # type: ignore[list-item]


def test_concurrent_requests_with_anchors_under_tight_budgets(hybrid, make_engine) -> None:  # type: ignore[no-untyped-def]
    """Requests batched together, each checkpointing prefill and decode anchors into two tiny
    tiers: every output equals its cold run, no budget is ever exceeded, nothing leaks."""
    path, _, cold = hybrid
    engine = make_engine(path, checkpoint_slots=2, host_checkpoint_slots=2, max_running=3, prefill_chunk=16)
    probe, bad = budget_probe(engine)
    prompts = [[*PROMPT[:12], *toks(14 + 4 * i, 70 + i)] for i in range(3)]
    refs = [cold.run(p, 6) for p in prompts]
    handles = [engine.submit(p, greedy(6), capture_logits=True, session=f"s{i}", listener=probe,
                             anchors=[Anchor(8, "system_end", 2), Anchor(12, "user_start", i)],
                             decode_anchors=[DecodeAnchor(refs[i][0][2], "tool_call_start", 1)])
               for i, p in enumerate(prompts)]
    for h, (out, logits) in zip(handles, refs, strict=True):
        assert h.result(timeout=120) == out
        assert rel_err(torch.stack(h.logits), logits) < TOL
    assert not bad
    b = engine.checkpoint_budget()
    assert b["device_used"] <= 2 and b["host_used"] <= 2
    for c in engine.checkpoints():  # every held checkpoint restores to the cold result
        i = int(str(c["session"])[1:])
        full = prompts[i] + refs[i][0]
        pos = int(c["position"])  # type: ignore[call-overload]
        still = pos in {x["position"] for x in engine.checkpoints()}  # earlier probes may evict it
        h = served(engine, cold, [*full[:pos], 127])
        assert h.reuse.state_position == pos if still else h.reuse.state_position <= pos
    assert_baseline(engine)


def test_anchors_inside_a_chunk_add_no_passes(hybrid, make_engine, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Checkpoints inside one prefill chunk are taken within its pass (`SeqEntry.cuts`): a 30-token
    prompt with anchors at 7, 16 and 29 is one forward pass, not four, and a request resumed from
    each of those checkpoints gives a cold prefill's tokens and logits. With no free state slot for
    a cut the chunk ends at that anchor instead (the earlier cuts still inside the pass)."""
    path, _, cold = hybrid
    engine = make_engine(path)
    passes: list[int] = []
    forward = engine.decoder.forward

    def counted(batch, kv, states):  # type: ignore[no-untyped-def]
        passes.append(batch.num_tokens)
        return forward(batch, kv, states)

    monkeypatch.setattr(engine.decoder, "forward", counted)
    anchors = [Anchor(7, "system_end", 5), Anchor(16, "user_start", 1), Anchor(29, "prompt_end", 2)]
    h = engine.submit(PROMPT, greedy(1), session="main", anchors=anchors)
    h.result(timeout=120)
    assert passes == [30] and engine.scheduler.prefill_passes == 1
    assert {7, 16, 29} <= set(held(engine, "main"))
    for p in (7, 16, 29):
        assert reuse(served(engine, cold, [*PROMPT[:p], 3, 1, 4, 1, 5]))[:3] == (p, p, anchors[[7, 16, 29].index(p)].kind)
    # one free state slot beyond the working one: the cut at 7 takes it, the pass ends at 16
    engine.reset_cache()
    s = engine.scheduler
    taken = [s.states.alloc() for _ in range(s.states.num_free - 2)]
    passes.clear()
    h = engine.submit(PROMPT, greedy(1), session="main", anchors=anchors)
    h.result(timeout=120)
    for slot in taken:
        s.states.free(slot)
    assert passes == [16, 13, 1]  # the cut at 7 in the first pass; then no slot is free for 29 either


def test_a_cut_spills_a_lower_ranked_checkpoint_instead_of_ending_the_pass(hybrid, make_engine, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """With every state slot taken (device checkpoints of priority 0 and the working state), an anchor
    of a higher priority inside a chunk still gets its cut: the lowest-ranked device checkpoint moves
    to the host tier (`CheckpointStore.cut_slot`), the prompt is one pass, and both resume exactly;
    an anchor that outranks none of them ends the chunk as before."""
    path, _, cold = hybrid
    engine = make_engine(path, state_slots=3, max_running=1, checkpoint_slots=2, host_checkpoint_slots=4)
    first = toks(30, 50)
    engine.submit(first, greedy(1), session="main", anchors=[Anchor(10, "a", 0)]).result(timeout=120)
    assert {p: t for p, (_, _, t) in held(engine, "main").items()} == {10: "device", 30: "device"}
    passes: list[int] = []
    forward = engine.decoder.forward

    def counted(batch, kv, states):  # type: ignore[no-untyped-def]
        passes.append(batch.num_tokens)
        return forward(batch, kv, states)

    monkeypatch.setattr(engine.decoder, "forward", counted)
    engine.submit(PROMPT, greedy(1), session="main", anchors=[Anchor(12, "system_end", 5)]).result(timeout=120)
    assert passes == [30]
    tiers = held(engine, "main")
    assert tiers[12] == ("system_end", 5, "device") and "host" in {t for _, _, t in tiers.values()}
    assert reuse(served(engine, cold, [*PROMPT[:12], 3, 1]))[:3] == (12, 12, "system_end")
    assert reuse(served(engine, cold, [*first[:10], 9]))[:3] == (10, 10, "a")
    assert_baseline(engine)
