"""The interface every routed-expert backend implements.

Contract: an `ExpertExecutor` computes, for tokens x [N, H] routed to experts `ids` [N, k] with
weights `weights` [N, k] in MoE layer `moe_index`, the sum over k of
weight * down(silu(gate(x)) * up(x)) -> [N, H] in x's dtype and device (`__call__`, the one method
a backend must implement). The others are the optional parts, each a no-op (or the plain call)
unless a backend has something to do there: `begin_forward(entries)` before every forward pass,
`capturable(tokens)` whether a whole decode pass of that many tokens may be captured in one CUDA
graph around `graph_step` / `with_side_work` (the calls such a pass makes: the same result as
`__call__`; `with_side_work` also returns `side()`, queued where the step would wait), `check`
after a pass (raises what the backend could not raise where it ran), `stats` (an expert cache's
`CacheStats`; `has_stats` says, without reading the device, whether there are any),
`describe()` for logs and `close()`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch


@dataclass
class CacheStats:
    """An expert cache's counters over all calls so far."""

    calls: int = 0
    hits: int = 0
    misses: int = 0
    fetched: int = 0
    split: int = 0  # misses split between a partial fetch and the CPU (counted in misses, not in fetched)

    @property
    def hit_rate(self) -> float:
        seen = self.hits + self.misses
        return self.hits / seen if seen else 0.0


class ExpertExecutor:
    has_stats: ClassVar[bool] = False  # `stats` has counters to read

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, moe_index: int) -> torch.Tensor:
        raise NotImplementedError

    def begin_forward(self, entries: int) -> None:
        """Before a forward pass, outside any capture: `entries` routed entries (tokens x k) per MoE
        layer go through `__call__` (0: the pass runs its experts as graph steps)."""

    def capturable(self, tokens: int) -> bool:
        """A whole decode pass of `tokens` tokens may be captured in one CUDA graph around this
        executor's `graph_step` / `with_side_work` (they read nothing on the host)."""
        return False

    def graph_step(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, moe_index: int) -> torch.Tensor:
        """The call as a captured pass makes it (queued work only); the result may live in a buffer
        the same layer's next step overwrites."""
        return self(x, ids, weights, moe_index)

    def with_side_work(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, moe_index: int,
                       side: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(`graph_step(...)`, `side()`): `side` (GPU work on other inputs) queued where the step
        would otherwise wait; here simply after it."""
        return self.graph_step(x, ids, weights, moe_index), side()

    def check(self, tokens: int | None = None, wait: bool = True) -> None:
        """After a forward pass of `tokens` tokens: raises what failed where nothing could raise."""

    @property
    def stats(self) -> CacheStats | None:
        """Cache counters (None: the executor keeps none); reading them may wait for the device."""
        return None

    def describe(self) -> str:
        """One line for logs and banners: which executor runs the experts, and how."""
        return type(self).__name__

    def close(self) -> None:
        """Stops what the executor runs beside the engine (worker threads)."""
