"""The expert slot pool: resident copies of (layer, expert) weights on the compute device.

Contract: `ExpertSlots(w13_shape, w2_shape, dtype, slots, device)` allocates w13 [S, 2I, H] and
w2 [S, H, I]; `ExpertSlots.from_budget(banks, budget_bytes, device)` sizes S from a byte budget
(one slot holds one expert's w13 and w2 in the banks' dtype; never more slots than experts).
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

import torch

from engine.weights.layout import ExpertBanks


class ExpertSlots:
    def __init__(self, w13_shape: tuple[int, int], w2_shape: tuple[int, int], dtype: torch.dtype, slots: int,
                 device: torch.device | str = "cpu") -> None:
        if slots < 0:
            raise ValueError(f"slot count must be >= 0, got {slots}")
        self.slots = slots
        self.device = torch.device(device)
        self.w13 = torch.empty((slots, *w13_shape), dtype=dtype, device=self.device)
        self.w2 = torch.empty((slots, *w2_shape), dtype=dtype, device=self.device)

    @staticmethod
    def slots_for_budget(banks: ExpertBanks, budget_bytes: int) -> int:
        return max(0, min(budget_bytes // banks.expert_bytes, banks.w13.shape[0]))

    @classmethod
    def from_budget(cls, banks: ExpertBanks, budget_bytes: int, device: torch.device | str = "cpu") -> ExpertSlots:
        n = cls.slots_for_budget(banks, budget_bytes)
        return cls(tuple(banks.w13.shape[1:]), tuple(banks.w2.shape[1:]), banks.w13.dtype, n, device)  # type: ignore[arg-type]

    @property
    def nbytes(self) -> int:
        return self.w13.numel() * self.w13.element_size() + self.w2.numel() * self.w2.element_size()

    def apply_copies(self, copy_src: torch.Tensor, copy_dst: torch.Tensor, banks: ExpertBanks) -> int:
        """Copies the valid (src, dst) pairs; returns how many experts were copied."""
        pairs = [(s, d) for s, d in zip(copy_src.tolist(), copy_dst.tolist(), strict=True) if s >= 0]
        for src, dst in pairs:
            if not 0 <= dst < self.slots:
                raise ValueError(f"copy destination {dst} is not a slot of a pool of {self.slots}")
            self.w13[dst].copy_(banks.w13[src], non_blocking=True)
            self.w2[dst].copy_(banks.w2[src], non_blocking=True)
        return len(pairs)
