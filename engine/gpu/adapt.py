"""The fetch ratio corrected online from which branch of each MoE layer finishes last (opt-in,
gpu.adapt_ratio): the calibrated ratio balances the PCIe fetch against the CPU experts by
rates measured apart from decode, and the in-situ rates move with the host (the sixth GPU
session: Qwen3's CPU branch at 52-58 GB/s in situ against 56-64 calibrated, on different calls).

Contract: `RatioController(ratio)`; `observe(cpu_late, gpu_late)` takes the doorbell poller's
running counts (native `poll_lateness`: requests whose CPU branch finished after the GPU's own
branch, and before) and, once a window holds `window` new observations, returns a new ratio (or
None): up by `step` when more than `high` of the window had the CPU last (fetch more), down when
fewer than `low` had, within [`floor`, `ceil`]. Ratio 0 (fetching off) and 1 stay as they are:
they are choices, not estimates. A pure function of the counts it is given.

Why a dead band around a half: each layer runs max(fetch, CPU); with whole experts per branch the
ratio only moves q at thresholds, so the counts swing between neighbouring q and the band keeps the
ratio from chasing that swing.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RatioController:
    ratio: float
    window: int = 256
    step: float = 0.01
    low: float = 0.4
    high: float = 0.6
    floor: float = 0.02
    ceil: float = 0.98
    _base: tuple[int, int] | None = field(default=None, repr=False)

    @property
    def fixed(self) -> bool:
        return self.ratio <= 0.0 or self.ratio >= 1.0

    def observe(self, cpu_late: int, gpu_late: int) -> float | None:
        if self.fixed:
            return None
        if self._base is None:
            self._base = (cpu_late, gpu_late)
            return None
        c, g = cpu_late - self._base[0], gpu_late - self._base[1]
        if c + g < self.window:
            return None
        self._base = (cpu_late, gpu_late)
        share = c / (c + g)
        if share > self.high:
            new = min(self.ceil, self.ratio + self.step)
        elif share < self.low:
            new = max(self.floor, self.ratio - self.step)
        else:
            return None
        if new == self.ratio:
            return None
        self.ratio = new
        return new
