"""Prefill checkpoints: snapshots of the recurrent state at requested prompt positions.

A request that diverges from an earlier one resumes from the deepest checkpoint at or before the
divergence (never from a wrong state), with logits equal to the reference; concurrent requests
that checkpoint the same prefix share KV slots without leaking any.
"""

from __future__ import annotations

import pytest
import torch
from checkpoints import (
    FULL,
    LIN,
    TinySpec,
    assert_no_leaks,
    hf_step_logits,
    qwen3_5_moe_text,
    qwen3_moe_text,
    rel_err,
)

from engine.sampling import SamplingParams

HYBRID = TinySpec("ckpt_q35", "qwen3_5_moe", qwen3_5_moe_text(layer_types=[LIN, LIN, FULL, LIN]))
ATTN = TinySpec("ckpt_q3", "qwen3_moe", qwen3_moe_text())
PROMPT = [int(t) for t in torch.randint(0, 128, (30,), generator=torch.Generator().manual_seed(11))]
GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)


def _check(engine, model, prompt: list[int], expect_cached: int) -> None:  # type: ignore[no-untyped-def]
    h = engine.submit(prompt, GREEDY, capture_logits=True)
    out = h.result(timeout=60)
    assert h.cached_tokens == expect_cached
    ref = hf_step_logits(model, prompt, out[:-1])
    assert rel_err(torch.stack(h.logits), ref) <= 1e-4
    assert out == ref.argmax(-1).tolist()


@pytest.mark.parametrize("spec", [HYBRID, ATTN], ids=repr)
def test_resume_from_deepest_checkpoint_before_divergence(spec: TinySpec, tiny_checkpoint, make_engine) -> None:  # type: ignore[no-untyped-def]
    path, model = tiny_checkpoint(spec)
    engine = make_engine(path, prefill_chunk=64)
    h = engine.submit(PROMPT, GREEDY, checkpoints=[10, 20, 29])
    h.result(timeout=60)
    hybrid = spec.family == "qwen3_5_moe"
    _check(engine, model, [*PROMPT[:15], 1, 2, 3], 10 if hybrid else 15)
    _check(engine, model, [*PROMPT[:25], 4, 5], 20 if hybrid else 25)
    _check(engine, model, PROMPT, 29)  # the same prompt resent: all but the last token reused
    assert_no_leaks(engine)


def test_concurrent_checkpoints_of_one_prefix_share_slots(tiny_checkpoint, make_engine) -> None:  # type: ignore[no-untyped-def]
    path, model = tiny_checkpoint(HYBRID)
    engine = make_engine(path, prefill_chunk=8, state_slots=16)
    handles = [engine.submit([*PROMPT, i], GREEDY, capture_logits=True, checkpoints=[8, 16, 24]) for i in range(3)]
    for i, h in enumerate(handles):
        out = h.result(timeout=60)
        assert out == hf_step_logits(model, [*PROMPT, i], out[:-1]).argmax(-1).tolist()
    assert_no_leaks(engine)
    _check(engine, model, [*PROMPT[:20], 9], 16)
    assert_no_leaks(engine)


def test_checkpoint_skipped_without_state_room(tiny_checkpoint, make_engine) -> None:  # type: ignore[no-untyped-def]
    path, model = tiny_checkpoint(HYBRID)
    engine = make_engine(path, max_running=2, state_slots=2)
    hold = engine.submit(PROMPT[:5], SamplingParams(max_tokens=200, ignore_eos=True))
    h = engine.submit(PROMPT, GREEDY, checkpoints=[10, 20])
    h.result(timeout=60)
    hold.abort()
    hold.result(timeout=60)
    assert_no_leaks(engine)
    _check(engine, model, [*PROMPT[:25], 7], 0)  # both snapshot slots were busy: nothing (wrong) reused
