"""The expert slot pool: resident copies of (layer, expert) weights on the compute device.

Contract: `ExpertSlots(w13_shape, w2_shape, dtype, slots, device, scratch=False)` allocates w13
[S, 2I, H] and w2 [S, H, I], with `scratch` one more row at index S (`.scratch`, else None): the
split expert's partial rows (engine/gpu/plan.py), outside the cache table, which knows S slots;
`ExpertSlots.from_budget(banks, budget_bytes, device, scratch)` sizes S from a byte budget (one
slot holds one expert's w13 and w2 in the banks' dtype, the scratch row counts against the budget
like a slot; never more slots than experts; no scratch row when the budget holds fewer than two,
nor when it holds every expert: then nothing misses).
`apply_copies(copy_src, copy_dst, banks)` copies bank rows `copy_src` (flat expert ids) into slots
`copy_dst`, skipping -1 padding (engine/gpu/plan.py's copy list).

How: the valid pairs are read on the host (one device->host read of the small copy list: the
only host synchronisation of the GPU tier, to be removed by a device-side copy kernel that reads
pinned host memory directly), then one `copy_(non_blocking=True)` per (tensor, row). Each bank row
is one contiguous block of pinned host memory, so a row copy is a single DMA at full PCIe speed
(BENCHMARKS.md: 54 GB/s in 9 MiB chunks) and needs no staging buffer; an `index_select` on the
host first would add a pageable (or freshly pinned) temporary and a second pass over DRAM. Copies
are queued on the current stream, so later kernels on it see the new slot contents. On the CPU
it is a plain copy.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F

from engine.weights.layout import ExpertBanks


class SlotPool(Protocol):
    """What the cache table, plans and executor need of a slot pool: this module's ExpertSlots or
    engine/gpu/quant/pool.py's PackedPool (packed experts)."""

    slots: int
    scratch: int | None
    device: torch.device

    @property
    def nbytes(self) -> int: ...

    def apply_copies(self, copy_src: torch.Tensor, copy_dst: torch.Tensor, banks: Any) -> int: ...

    def forward(self, slot: int, layer: int, x: torch.Tensor) -> torch.Tensor: ...


class ExpertSlots:
    def __init__(self, w13_shape: tuple[int, int], w2_shape: tuple[int, int], dtype: torch.dtype, slots: int,
                 device: torch.device | str = "cpu", scratch: bool = False) -> None:
        if slots < 0:
            raise ValueError(f"slot count must be >= 0, got {slots}")
        self.slots = slots
        self.scratch: int | None = slots if scratch else None
        self.device = torch.device(device)
        rows = slots + (1 if scratch else 0)
        self.w13 = torch.empty((rows, *w13_shape), dtype=dtype, device=self.device)
        self.w2 = torch.empty((rows, *w2_shape), dtype=dtype, device=self.device)
        if scratch:  # never uninitialised memory (a NaN pattern) in rows a masked kernel might touch
            self.w13[slots].zero_()
            self.w2[slots].zero_()

    @staticmethod
    def slots_for_budget(banks: ExpertBanks, budget_bytes: int) -> int:
        return max(0, min(budget_bytes // banks.expert_bytes, banks.w13.shape[0]))

    @classmethod
    def from_budget(cls, banks: ExpertBanks, budget_bytes: int, device: torch.device | str = "cpu",
                    scratch: bool = False) -> ExpertSlots:
        n = cls.slots_for_budget(banks, budget_bytes)
        if n >= banks.w13.shape[0]:
            scratch = False  # every expert resident: nothing misses, nothing to split
        elif scratch:  # the scratch takes a slot's room
            scratch = n >= 2
            n -= scratch
        return cls(tuple(banks.w13.shape[1:]), tuple(banks.w2.shape[1:]), banks.w13.dtype, n, device,  # type: ignore[arg-type]
                   scratch)

    @property
    def nbytes(self) -> int:
        return self.w13.numel() * self.w13.element_size() + self.w2.numel() * self.w2.element_size()

    def forward(self, slot: int, layer: int, x: torch.Tensor) -> torch.Tensor:
        """The slot's expert on rows x [n, H] (before the routing weight), in x's dtype, as
        TorchExpertExecutor computes it: the torch loops over slots (a CPU pool, the reference)."""
        gate, up = F.linear(x, self.w13[slot]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.w2[slot])

    def apply_copies(self, copy_src: torch.Tensor, copy_dst: torch.Tensor, banks: ExpertBanks) -> int:
        """Copies the valid (src, dst) pairs; returns how many experts were copied."""
        pairs = [(s, d) for s, d in zip(copy_src.tolist(), copy_dst.tolist(), strict=True) if s >= 0]
        for src, dst in pairs:
            if not 0 <= dst < self.slots:
                raise ValueError(f"copy destination {dst} is not a slot of a pool of {self.slots}")
            self.w13[dst].copy_(banks.w13[src], non_blocking=True)
            self.w2[dst].copy_(banks.w2[src], non_blocking=True)
        return len(pairs)
