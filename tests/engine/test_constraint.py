"""Token constraints: the sampler picks exactly from the distribution renormalised over the allowed set.

Greedy picks the best allowed token; random sampling matches the masked distribution's
frequencies; the engine consults and advances a constraint for every generated token.
"""

from __future__ import annotations

import pytest
import torch
from checkpoints import TinySpec, qwen3_moe_text

from engine.errors import EngineError
from engine.sampling import SamplingParams, sample


class Parity:
    def __init__(self, parity: int) -> None:
        self.parity, self.seen = parity, []

    def allowed(self, token_id: int) -> bool:
        return token_id % 2 == self.parity

    def advance(self, token_id: int) -> None:
        self.seen.append(token_id)


def test_greedy_picks_best_allowed() -> None:
    logits = torch.tensor([5.0, 4.0, 3.0, 9.0, 1.0])
    c = Parity(0)
    assert sample(logits, SamplingParams(), None, c) == 0
    assert sample(logits, SamplingParams(), None, Parity(1)) == 3
    assert c.seen == [0]


def test_sampling_matches_masked_distribution() -> None:
    logits = torch.tensor([0.5, 2.0, 1.0, 0.0, 1.5, -1.0])
    params = SamplingParams(temperature=0.8, seed=0)
    gen = torch.Generator().manual_seed(0)
    n = 20000
    counts = torch.zeros(6)
    for _ in range(n):
        counts[sample(logits, params, gen, Parity(0))] += 1
    masked = torch.tensor([0.5, float("-inf"), 1.0, float("-inf"), 1.5, float("-inf")]) / 0.8
    expected = torch.softmax(masked, -1)
    assert counts[1::2].sum() == 0
    assert torch.allclose(counts / n, expected, atol=0.015)


def test_engine_applies_constraint(tiny_checkpoint, make_engine) -> None:  # type: ignore[no-untyped-def]
    path, _ = tiny_checkpoint(TinySpec("q3_constraint", "qwen3_moe", qwen3_moe_text()))
    engine = make_engine(path)
    for params in (SamplingParams(max_tokens=12, ignore_eos=True),
                   SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.0, seed=3)):
        c = Parity(1)
        h = engine.submit([3, 4, 5, 6], params, capture_logits=True, constraint=c)
        out = h.result()
        assert all(t % 2 == 1 for t in out) and c.seen == out
        if params.greedy:
            for row, tok in zip(h.logits, out, strict=True):
                assert tok == int(torch.argmax(row.masked_fill(torch.arange(row.shape[0]) % 2 == 0, float("-inf"))))


class Exploding:
    def allowed(self, token_id: int) -> bool:
        raise ValueError("broken constraint")

    def advance(self, token_id: int) -> None:  # pragma: no cover
        pass


def test_failing_constraint_fails_only_its_request(tiny_checkpoint, make_engine) -> None:  # type: ignore[no-untyped-def]
    path, _ = tiny_checkpoint(TinySpec("q3_constraint", "qwen3_moe", qwen3_moe_text()))
    engine = make_engine(path)
    bad = engine.submit([3, 4, 5], SamplingParams(max_tokens=4), constraint=Exploding())
    good = engine.submit([3, 4, 6], SamplingParams(max_tokens=4, ignore_eos=True))
    with pytest.raises(EngineError, match="broken constraint"):
        bad.result(timeout=60)
    assert bad.finish_reason == "error"
    assert len(good.result(timeout=60)) == 4
    assert len(engine.submit([1, 2], SamplingParams(max_tokens=2, ignore_eos=True)).result(timeout=60)) == 2
