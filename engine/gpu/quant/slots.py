"""A pool of packed expert slots on the compute device: the bytes of the host banks' layout
(engine/gpu/quant/formats.py), one expert per slot, so a miss copies packed bytes as they are.

Contract: `PackedSlots(gate_up [S, 2I, row_bytes(fmt_gu, H)] uint8, down [S, H, row_bytes(fmt_d, I)]
uint8, gscale [S, 3] float32 (gate, up, down global scales; ones for formats without one),
fmt_gu, fmt_d)`, checked on construction (ValueError naming the tensor);
`PackedSlots.allocate(fmt_gu, fmt_d, hidden, inter, slots, device)` an empty pool (gscale ones);
`slots_for_budget(budget_bytes, fmt_gu, fmt_d, hidden, inter, experts)` how many slots a byte
budget holds (each costs slot_bytes plus its 12 gscale bytes), never more than the experts;
`copy_in(dst, gate_up, down, gscale)` one expert's packed rows (host bank rows, pinned for an
asynchronous copy) into slot dst on the current stream.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.gpu.quant.formats import row_bytes, slot_bytes


@dataclass(frozen=True)
class PackedSlots:
    gate_up: torch.Tensor
    down: torch.Tensor
    gscale: torch.Tensor
    fmt_gu: str
    fmt_d: str

    def __post_init__(self) -> None:
        s, two_i, rb_gu = self.gate_up.shape
        hidden, rb_d = self.down.shape[1:]
        inter = two_i // 2
        if self.gate_up.dtype != torch.uint8 or self.down.dtype != torch.uint8:
            raise ValueError(f"gate_up / down must be uint8, got {self.gate_up.dtype} / {self.down.dtype}")
        if rb_gu != row_bytes(self.fmt_gu, hidden, "gate_up"):
            raise ValueError(f"gate_up: rows of {rb_gu} bytes, {self.fmt_gu} x {hidden} needs "
                             f"{row_bytes(self.fmt_gu, hidden)}")
        if self.down.shape[0] != s or rb_d != row_bytes(self.fmt_d, inter, "down"):
            raise ValueError(f"down: shape {tuple(self.down.shape)} does not match {s} slots of {self.fmt_d} x {inter}")
        if self.gscale.shape != (s, 3) or self.gscale.dtype != torch.float32:
            raise ValueError(f"gscale: expected float32 [{s}, 3], got {self.gscale.dtype} {tuple(self.gscale.shape)}")

    @property
    def slots(self) -> int:
        return self.gate_up.shape[0]

    @property
    def hidden(self) -> int:
        return self.down.shape[1]

    @property
    def inter(self) -> int:
        return self.gate_up.shape[1] // 2

    @classmethod
    def allocate(cls, fmt_gu: str, fmt_d: str, hidden: int, inter: int, slots: int,
                 device: torch.device | str = "cpu") -> PackedSlots:
        gu = torch.empty(slots, 2 * inter, row_bytes(fmt_gu, hidden, "gate_up"), dtype=torch.uint8, device=device)
        d = torch.empty(slots, hidden, row_bytes(fmt_d, inter, "down"), dtype=torch.uint8, device=device)
        return cls(gu, d, torch.ones(slots, 3, dtype=torch.float32, device=device), fmt_gu, fmt_d)

    def copy_in(self, dst: int, gate_up: torch.Tensor, down: torch.Tensor, gscale: torch.Tensor | None = None) -> None:
        self.gate_up[dst].copy_(gate_up, non_blocking=True)
        self.down[dst].copy_(down, non_blocking=True)
        if gscale is not None:
            self.gscale[dst].copy_(gscale, non_blocking=True)

    @property
    def nbytes(self) -> int:
        return self.gate_up.numel() + self.down.numel() + self.gscale.numel() * 4


def slots_for_budget(budget_bytes: int, fmt_gu: str, fmt_d: str, hidden: int, inter: int, experts: int) -> int:
    return max(0, min(budget_bytes // (slot_bytes(fmt_gu, fmt_d, hidden, inter) + 12), experts))
