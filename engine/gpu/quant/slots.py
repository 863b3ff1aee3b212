"""A pool of packed expert slots on the compute device: each slot the bytes of one expert as the
host banks hold them (engine/gpu/quant/formats.py): gate_up rows [2I, row_bytes(fmt_gu, H)], then
down rows [H, row_bytes(fmt_d, I)], so a miss copies the packed bytes as they are.

Contract:
- `ExpertFormat(fmt_gu, fmt_d, hidden, inter)`: one MoE layer's expert (formats may differ from
  layer to layer: Q4_K_M mixes q4_k and q6_k downs); `.gate_up_bytes`, `.nbytes` (= slot_bytes);
  ValueError naming the matrix when a row length is not a multiple of its format's block.
- `PackedSlots(data [S, stride] uint8, gscale [S, 3] float32, bias=None)`: S slots of `stride` bytes
  (at least the largest layer's expert; slots are shared by the layers), gscale the slot's expert's
  (gate, up, down) global scales, ones for formats without one; `bias`, only for experts with
  biases (gpt-oss), float32 [S, width]: the slot's expert's gate bias [I], up bias [I], then down
  bias [H] (width at least the largest layer's 2I + H). Checked on construction (ValueError).
- `PackedSlots.allocate(formats, slots, device, bias=False)`: an empty pool whose stride (and bias
  width, zeros, with `bias`) fits every format given (gscale ones). `.gate_up(fmt)` / `.down(fmt)`:
  [S, rows, row_bytes] uint8 views of the slots as fmt's matrices; `.copy_in(dst, fmt, gate_up,
  down, gscale=None, bias=None)` copies one expert's packed rows (its host bank rows, e.g.
  PackedExpertBanks' gate_up[l][e] and down[l][e], pinned for an asynchronous copy) into slot dst on
  the current stream: two copies, gscale a third, bias (float32 [2I + H]: the bank's b13 row then
  its b2 row, kept concatenated on the host so a miss copies it at once) a fourth; ValueError for a
  bias without a bias block or of the wrong length.
- `slots_for_budget(budget_bytes, formats, experts, bias=False)`: how many slots a byte budget holds
  (a slot costs the stride plus its 12 gscale bytes, plus 4 (2I + H) bias bytes with `bias`), never
  more than the experts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.gpu.quant.formats import row_bytes


@dataclass(frozen=True)
class ExpertFormat:
    fmt_gu: str
    fmt_d: str
    hidden: int
    inter: int

    def __post_init__(self) -> None:
        row_bytes(self.fmt_gu, self.hidden, "gate_up")
        row_bytes(self.fmt_d, self.inter, "down")

    @property
    def gu_row_bytes(self) -> int:
        return row_bytes(self.fmt_gu, self.hidden)

    @property
    def d_row_bytes(self) -> int:
        return row_bytes(self.fmt_d, self.inter)

    @property
    def gate_up_bytes(self) -> int:
        return 2 * self.inter * self.gu_row_bytes

    @property
    def nbytes(self) -> int:
        return self.gate_up_bytes + self.hidden * self.d_row_bytes

    @property
    def bias_width(self) -> int:
        """float32 values of one expert's biases: gate and up [2I], then down [H]."""
        return 2 * self.inter + self.hidden


@dataclass(frozen=True)
class PackedSlots:
    data: torch.Tensor
    gscale: torch.Tensor
    bias: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.data.dtype != torch.uint8 or self.data.dim() != 2 or self.data.stride(1) != 1:
            raise ValueError(f"data: expected a row-contiguous uint8 [S, stride], got {self.data.dtype} "
                             f"{tuple(self.data.shape)}")
        s = self.data.shape[0]
        if self.gscale.shape != (s, 3) or self.gscale.dtype != torch.float32 or not self.gscale.is_contiguous():
            raise ValueError(f"gscale: expected contiguous float32 [{s}, 3], got {self.gscale.dtype} "
                             f"{tuple(self.gscale.shape)}")
        b = self.bias
        if b is not None and (b.dtype != torch.float32 or b.dim() != 2 or b.shape[0] != s or b.stride(1) != 1):
            raise ValueError(f"bias: expected a row-contiguous float32 [{s}, width], got {b.dtype} {tuple(b.shape)}")

    @property
    def slots(self) -> int:
        return self.data.shape[0]

    @property
    def stride(self) -> int:
        return self.data.stride(0)

    def check(self, fmt: ExpertFormat) -> None:
        if fmt.nbytes > self.data.shape[1]:
            raise ValueError(f"slots of {self.data.shape[1]} bytes cannot hold a {fmt.fmt_gu}/{fmt.fmt_d} expert "
                             f"of {fmt.nbytes}")
        if self.bias is not None and fmt.bias_width > self.bias.shape[1]:
            raise ValueError(f"bias rows of {self.bias.shape[1]} values cannot hold an expert's {fmt.bias_width} "
                             f"(2 x {fmt.inter} + {fmt.hidden})")

    @classmethod
    def allocate(cls, formats: Sequence[ExpertFormat], slots: int, device: torch.device | str = "cpu",
                 bias: bool = False) -> PackedSlots:
        stride = max(f.nbytes for f in formats)
        width = max(f.bias_width for f in formats)
        return cls(torch.empty(slots, stride, dtype=torch.uint8, device=device),
                   torch.ones(slots, 3, dtype=torch.float32, device=device),
                   torch.zeros(slots, width, dtype=torch.float32, device=device) if bias else None)

    def gate_up(self, fmt: ExpertFormat) -> torch.Tensor:
        self.check(fmt)
        return self.data.as_strided((self.slots, 2 * fmt.inter, fmt.gu_row_bytes), (self.stride, fmt.gu_row_bytes, 1))

    def down(self, fmt: ExpertFormat) -> torch.Tensor:
        self.check(fmt)
        return self.data.as_strided((self.slots, fmt.hidden, fmt.d_row_bytes), (self.stride, fmt.d_row_bytes, 1),
                                    self.data.storage_offset() + fmt.gate_up_bytes)

    def copy_in(self, dst: int, fmt: ExpertFormat, gate_up: torch.Tensor, down: torch.Tensor,
                gscale: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> None:
        self.check(fmt)
        if bias is not None:
            if self.bias is None:
                raise ValueError("bias given but the slots have no bias block (allocate(..., bias=True))")
            if bias.numel() != fmt.bias_width:
                raise ValueError(f"bias: {bias.numel()} values, an expert's are {fmt.bias_width} "
                                 f"(2 x {fmt.inter} + {fmt.hidden})")
        self.data[dst, :fmt.gate_up_bytes].copy_(gate_up.reshape(-1), non_blocking=True)
        self.data[dst, fmt.gate_up_bytes:fmt.nbytes].copy_(down.reshape(-1), non_blocking=True)
        if gscale is not None:
            self.gscale[dst].copy_(gscale, non_blocking=True)
        if bias is not None and self.bias is not None:
            self.bias[dst, :fmt.bias_width].copy_(bias.reshape(-1), non_blocking=True)

    @property
    def nbytes(self) -> int:
        return self.data.numel() + self.gscale.numel() * 4 + (0 if self.bias is None else self.bias.numel() * 4)


def slots_for_budget(budget_bytes: int, formats: Sequence[ExpertFormat], experts: int, bias: bool = False) -> int:
    per_slot = max(f.nbytes for f in formats) + 12 + (4 * max(f.bias_width for f in formats) if bias else 0)
    return max(0, min(budget_bytes // per_slot, experts))
