"""Sampling parameters and the sampler.

Contract: `SamplingParams` is validated at construction (a bad value raises `RequestError` naming
the field). `sample(logits, params, generator, constraint)` returns one token id: greedy when
temperature is 0, else temperature, top-k, then top-p (nucleus) filtering and a draw: one uniform
number from `generator` (on the host), placed in the filtered distribution's cumulative sum on the
logits' device (`draw_index`), so a fixed seed reproduces the same tokens and only one number
crosses to the host. A `TokenConstraint` restricts the choice
to the tokens it allows: the draw is then exactly a draw from the distribution renormalised over
the allowed tokens (Gumbel-max: perturb once, take the best allowed score), found by testing
candidates in score order, so a constraint costs a few checks per token, not a pass over the
vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from engine.errors import EngineError, RequestError


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not self.temperature >= 0.0:
            raise RequestError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k < 0:
            raise RequestError(f"top_k must be >= 0, got {self.top_k!r}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise RequestError(f"seed must be in [-2**63, 2**64), got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


class TokenConstraint(Protocol):
    """Decides which token ids may come next; told which one was chosen. Any allowed token must
    exist whenever the constraint is consulted (else the request fails)."""

    def allowed(self, token_id: int) -> bool: ...

    def advance(self, token_id: int) -> None: ...


_CANDIDATE_BLOCK = 64


def _best_allowed(scores: torch.Tensor, constraint: TokenConstraint) -> int:
    order: torch.Tensor | None = None
    finite = int(torch.isfinite(scores).sum())
    for start in range(0, finite, _CANDIDATE_BLOCK):
        if start == 0:
            top = torch.topk(scores, min(_CANDIDATE_BLOCK, finite)).indices
        else:
            if order is None:
                order = torch.argsort(scores, descending=True)
            top = order[start:start + _CANDIDATE_BLOCK]
        for token in top.tolist():
            if constraint.allowed(token):
                return token
    raise RuntimeError("constraint allows no token")


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
           constraint: TokenConstraint | None = None) -> int:
    """logits: [V] float32."""
    if constraint is not None:
        return _constrained(logits, params, generator, constraint)
    if params.greedy:
        return int(torch.argmax(logits))
    return read_draw(queue_draw(logits, params, generator))


def queue_draw(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """`sample`'s draw for a request without a constraint at temperature > 0, queued on logits'
    device and not read: [index, valid] in float64 (valid 0: the filtered distribution's total is not
    a positive finite number). The generator's uniform number is taken now, as `sample` takes it, so
    a seeded request draws the same tokens either way (engine/decode_pipeline.py reads it later)."""
    probs = torch.softmax(_filtered_scores(logits, params), dim=-1)
    return _draw(probs, float(torch.rand((), generator=generator, dtype=torch.float64)))


def sampling_failed(exc: Exception) -> EngineError:
    """A request's sampler failure as the error it ends with (the serial and the overlapped step)."""
    return EngineError(f"sampling failed: {type(exc).__name__}: {exc}")


def read_draw(draw: torch.Tensor | list[float]) -> int:
    """The token of a `queue_draw` result (read here, or already read into a list); ValueError for
    a distribution without a positive finite total (NaN logits)."""
    index, valid = draw.tolist() if isinstance(draw, torch.Tensor) else draw
    if not valid:
        raise ValueError("cannot sample from a distribution whose total is not a positive finite number")
    return int(index)


def draw_index(probs: torch.Tensor, u: float) -> int:
    """The token at which the cumulative distribution (float64, on probs' device) first exceeds
    u * total, for a uniform u in [0, 1): inverse-CDF sampling, where `torch.multinomial` on the host
    took ~4.7 ms per token over a 152k vocabulary (copy, then one exponential draw per entry) and
    this is a scan, a compare and one read. Zero-probability tokens are never returned: for u < 1
    the rounded product u * total stays below the total (total * 2**-53 is at least half an ulp of
    it), so the first entry above the threshold exists and has a probability of its own. A
    distribution whose total is not a positive finite number (NaN logits) raises ValueError, read
    in the same transfer as the index."""
    return read_draw(_draw(probs, u))


def _draw(probs: torch.Tensor, u: float) -> torch.Tensor:
    cdf = torch.cumsum(probs, dim=0, dtype=torch.float64)
    total = cdf[-1]
    return torch.stack([(cdf <= total * u).sum().double(), (torch.isfinite(total) & (total > 0)).double()])


def _filtered_scores(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    scores = logits / params.temperature
    if params.top_k and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        probs = torch.softmax(sorted_scores, dim=-1)
        drop = probs.cumsum(-1) - probs >= params.top_p
        sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
        scores = torch.full_like(scores, float("-inf")).scatter(0, order, sorted_scores)
    return scores


def _constrained(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
                 constraint: TokenConstraint) -> int:
    logits = logits.float().cpu()
    if params.greedy:
        token = _best_allowed(logits, constraint)
    else:
        scores = _filtered_scores(logits, params)
        uniform = torch.rand(scores.shape, generator=generator).clamp_(1e-20, 1.0)
        perturbed = scores - torch.log(-torch.log(uniform))
        try:
            token = _best_allowed(perturbed, constraint)
        except RuntimeError:
            # top-k / top-p removed every allowed token: fall back to the unfiltered distribution.
            token = _best_allowed(logits / params.temperature - torch.log(-torch.log(uniform)), constraint)
    constraint.advance(token)
    return token
