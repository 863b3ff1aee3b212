"""The miss split (q*) as small pure functions.

Contract:
- `fetch_ratio(b_pcie, b_cpu, contended=True)` -> the fraction of a layer's misses to fetch over
  PCIe into cache slots (the rest run on the CPU), in [0, 1]:
  * contended=True (default): ratio = B_P' / (B_P' + B_C'), with B_P' and B_C' the PCIe copy and
    CPU expert throughputs measured *while both run at once*. Balancing q*S/B_P' against
    (m-q)*S/B_C' gives q* = m * B_P' / (B_P' + B_C').
  * contended=False: the paper's form (section 3.2, eq. 4): ratio = B_P / B_H (clamped to 1), with
    B_H the host-side expert throughput alone. It assumes the CPU alone saturates host memory, so
    the CPU keeps B_H - B_P while PCIe runs; when that holds B_P' = B_P and B_C' = B_H - B_P and
    both forms agree. Where the CPU alone does not saturate DRAM (BENCHMARKS.md: 8 threads, CPU 50,
    PCIe 55, ~100 together) the paper's form sends every miss over PCIe; the contended form does not.
- `fetch_count(misses, ratio)` -> q for a tensor of miss counts m (any shape, integer dtype; the
  ratio a float or a float64 0-d tensor on m's device, which gives the same q without a host read):
  q = clamp(round(m * ratio), 1, m) when m > 0, else 0. round is half-to-even on the float64
  product (as Python's `round`). At least one fetch per layer keeps the cache warming even when
  the CPU takes most misses (paper 3.2). ratio == 0 is the one exception: fetching is off, q = 0
  (a pure CPU tier, e.g. a slot pool of size 0 or a machine where the copy path is unusable).
  The caller further caps q by the free victim slots (engine/gpu/plan.py).
- `split_share(misses, ratio, units)` -> (q, rem): the same balance with one expert split between
  the two sides (gpu.split_expert): whole experts move in steps of one expert's time, so a
  layer with m = 4 misses and ratio 0.47 fetches 2 (the fetch side then ends last by a third of an
  expert) where the balance is 1.88. Here the GPU's share m * ratio is rounded (half to even) to
  1/units of an expert instead: q = floor of it whole experts are fetched, and the next miss is
  split, its first rem/units of intermediate rows fetched and run on the GPU, the others run on
  the CPU (rem = 0: no split). No "at least one" rule (the fraction warms nothing but costs no
  fetch either); q = m leaves nothing to split.
"""

from __future__ import annotations

import torch


def fetch_ratio(b_pcie: float, b_cpu: float, contended: bool = True) -> float:
    if b_pcie < 0 or b_cpu < 0:
        raise ValueError(f"bandwidths must be >= 0 (got B_P={b_pcie}, B_C={b_cpu})")
    if contended:
        total = b_pcie + b_cpu
        return b_pcie / total if total > 0 else 0.0
    if b_cpu == 0:
        return 1.0 if b_pcie > 0 else 0.0
    return min(b_pcie / b_cpu, 1.0)


def check_ratio(ratio: float) -> float:
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"fetch ratio must be in [0, 1], got {ratio}")
    return float(ratio)


Ratio = float | torch.Tensor  # a float, or a float64 0-d device scalar (the executor's online ratio)


def _checked(ratio: Ratio) -> Ratio:
    """A float is checked here; a device scalar is checked where it is written (reading it here
    would synchronise, and the plan may run inside a CUDA graph capture)."""
    return ratio if isinstance(ratio, torch.Tensor) else check_ratio(ratio)


def fetch_count(misses: torch.Tensor, ratio: Ratio) -> torch.Tensor:
    ratio = _checked(ratio)
    m = misses.to(torch.int64)
    if not isinstance(ratio, torch.Tensor) and ratio == 0.0:
        return torch.zeros_like(m)
    q = torch.round(m.to(torch.float64) * ratio).to(torch.int64)
    # clamp(q, 1, m) is 0 for m == 0 because the upper bound wins
    q = torch.minimum(torch.clamp(q, min=1), m)
    return torch.where(ratio == 0, 0, q) if isinstance(ratio, torch.Tensor) else q


def split_share(misses: torch.Tensor, ratio: Ratio, units: int) -> tuple[torch.Tensor, torch.Tensor]:
    ratio = _checked(ratio)
    if units < 1:
        raise ValueError(f"units must be >= 1, got {units}")
    m = misses.to(torch.int64)
    # (m * ratio) * units in float64, in that order: the plan kernel computes the same product
    n = torch.round(m.to(torch.float64) * ratio * units).to(torch.int64)
    q = torch.minimum(n // units, m)
    rem = torch.where(q < m, n % units, torch.zeros_like(n))
    return q, rem
