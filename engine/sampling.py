"""Sampling parameters and the sampler.

Contract: `SamplingParams` is validated at construction (a bad value raises `RequestError` naming
the field). `sample(logits, params, generator)` returns one token id: greedy when temperature is
0, else temperature, top-k, then top-p (nucleus) filtering and a draw from `generator`, so a fixed
seed reproduces the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.errors import RequestError


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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """logits: [V] float32."""
    if params.greedy:
        return int(torch.argmax(logits))
    scores = logits / params.temperature
    if params.top_k and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        probs = torch.softmax(sorted_scores, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = probs.cumsum(-1) - probs >= params.top_p
        sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
        scores = torch.full_like(scores, float("-inf")).scatter(0, order, sorted_scores)
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))
