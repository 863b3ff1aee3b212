"""`ZeroExperts`: an expert executor that skips the routed experts (their sum is zero), for the
dense time per token that `bench decode` reports beside the full one.

Contract: `ZeroExperts()(x, ids, weights, moe_index)` returns zeros like `x`; its decode passes
may be captured in CUDA graphs (no host reads).
"""

from __future__ import annotations

import torch

from engine.moe.base import ExpertExecutor


class ZeroExperts(ExpertExecutor):
    """An expert executor that skips the routed experts: their sum is zero."""

    def capturable(self, tokens: int) -> bool:
        return True  # no host reads: decode passes keep running through CUDA graphs

    def describe(self) -> str:
        return "zero (routed experts skipped)"

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, moe_index: int) -> torch.Tensor:
        return torch.zeros_like(x)
