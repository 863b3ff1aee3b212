"""The sampler's draw (engine/sampling.py `sample`, `draw_index`) is a draw from the filtered
distribution:
- `draw_index` returns the first token whose float64 cumulative probability exceeds u * total (an
  explicit loop over the distribution agrees for many u, zeros and ties included), never a
  zero-probability token, and stays in range for u just below one;
- `sample` at a temperature, with top-k and top-p, follows the filtered softmax (chi-square over
  20k seeded draws on a small vocabulary), never leaves the filter, and a seed reproduces its
  token sequence;
- a distribution that is not one (NaN, zero total) is a ValueError, not a token."""

from __future__ import annotations

import math

import pytest
import torch

from engine.sampling import SamplingParams, draw_index, sample


def _loop_draw(probs: list[float], u: float) -> int:
    total = math.fsum(probs)
    acc = 0.0
    for i, p in enumerate(probs):
        acc += p
        if acc > u * total:
            return i
    raise AssertionError("threshold not below the total")


def test_draw_index_is_the_inverse_cdf() -> None:
    g = torch.Generator().manual_seed(0)
    cases = [torch.tensor([0.0, 0.5, 0.0, 0.25, 0.25, 0.0]), torch.softmax(torch.randn(50, generator=g), 0),
             torch.tensor([0.0, 0.0, 1.0, 0.0])]
    for probs in cases:
        for u in [0.0, 1e-12, 0.25, 0.5, 0.5 + 1e-12, 0.75, 0.999999, 1 - 2**-53, *torch.rand(200, generator=g).tolist()]:
            got = draw_index(probs, u)
            assert 0 <= got < probs.numel() and probs[got] > 0, (probs, u, got)
            # float64 cumsum in the same order as the loop: the same index except exactly on a boundary
            if all(abs(float(c) - u * float(probs.double().sum())) > 1e-12 for c in torch.cumsum(probs.double(), 0)):
                assert got == _loop_draw(probs.double().tolist(), u), (probs, u)


def test_sample_follows_the_filtered_distribution() -> None:
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    params = SamplingParams(temperature=0.7, top_k=6, top_p=0.9, seed=1)
    # the filtered distribution, computed directly: top-6, then the smallest prefix reaching 0.9
    scores = logits / 0.7
    keep = torch.argsort(scores, descending=True)[:6]
    p = torch.softmax(scores[keep], 0)
    n_keep = int((torch.cumsum(p, 0) - p < 0.9).sum())
    allowed = keep[:n_keep]
    want = torch.zeros(8)
    want[allowed] = torch.softmax(scores[allowed], 0)
    g = torch.Generator().manual_seed(1)
    draws = 20000
    counts = torch.zeros(8)
    for _ in range(draws):
        counts[sample(logits, params, g)] += 1
    assert counts[want == 0].sum() == 0  # never outside top-k / top-p
    expected = want[want > 0] * draws
    chi2 = float(((counts[want > 0] - expected) ** 2 / expected).sum())
    assert chi2 < 25.0, (chi2, counts, expected)  # dof <= 5: p < 1e-4 for a correct sampler
    # a seed reproduces the sequence; another seed gives another
    seqs = []
    for seed in (7, 7, 8):
        g = torch.Generator().manual_seed(seed)
        seqs.append([sample(logits, params, g) for _ in range(40)])
    assert seqs[0] == seqs[1] and seqs[0] != seqs[2]


def test_a_broken_distribution_is_an_error_not_a_token() -> None:
    """NaN logits (or a distribution summing to zero) raise, as torch.multinomial did, instead of
    returning token 0 or an index past the vocabulary; the scheduler turns that into the request's
    error (engine/scheduler.py `_sample`)."""
    for probs in (torch.tensor([float("nan"), 0.5, 0.5]), torch.zeros(4), torch.tensor([float("inf"), 1.0])):
        with pytest.raises(ValueError, match="cannot sample"):
            draw_index(probs, 0.3)
    logits = torch.tensor([1.0, float("nan"), 0.0])
    with pytest.raises(ValueError, match="cannot sample"):
        sample(logits, SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))
