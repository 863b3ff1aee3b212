"""The GPU expert cache's slot pool for packed (quantized) experts: `ExpertSlots`' interface over
`PackedSlots`, so the cache table, plans, decode steps and streamed prefill serve PackedExpertBanks
with the packed bytes as the host banks hold them (a 4-bit miss moves a quarter of a bf16 one).

Contract: `PackedPool(banks, slots, device)`: a pool of `slots` packed slots, each the size of the
largest layer's expert (layers may differ in format: Q4_K_M mixes q4_k and q6_k downs).
- `.slots`, `.device`, `.scratch` (always None: no expert split over packed banks), `.nbytes`,
  `.packed` (the PackedSlots), `.formats[l]` (MoE layer l's ExpertFormat), `.kernels[l]` (its
  PackedLayerKernels, engine/gpu/quant/entry.py: the calls a decode step and the grouped prefill
  make; built on first use, so a CPU pool never imports Triton);
- `copy_expert(slot, flat)`: bank expert `flat` (layer * E + expert) into `slot`, packed rows and
  (`.gscales`: where some layer's format has them) global scales, on the current stream (page-locked banks: asynchronous DMAs);
- `apply_copies(copy_src, copy_dst, banks)`: ExpertSlots.apply_copies' contract (-1 padding skipped);
- `forward(slot, layer, x)`: the slot's expert on rows x [n, H] -> [n, H] float32 (before
  the routing weight): dequantized with engine/quant/formats.py's reference decoders, biases and the
  activation as engine/moe/packed.py's; the torch path where no Triton runs (a CPU pool);
- experts with biases (gpt-oss: banks.b13 / b2) carry them in the slots' bias block, copied with
  each expert from `bias_rows` (page-locked on CUDA: [L * E, 2I + H], b13's row then b2's);
- `PackedPool.from_budget(banks, budget_bytes, device)`: as many slots as the budget holds
  (`slots_for_budget`: the largest expert's bytes plus its 12 bytes of scales each), never more
  than the experts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.gpu.quant.slots import ExpertFormat, PackedSlots, slots_for_budget
from engine.moe.packed import activate
from engine.quant.formats import FORMATS
from engine.weights.layout import PackedExpertBanks


class PackedPool:
    scratch: int | None = None

    def __init__(self, banks: PackedExpertBanks, slots: int, device: torch.device | str = "cpu") -> None:
        if slots < 0:
            raise ValueError(f"slot count must be >= 0, got {slots}")
        self.banks = banks
        self.formats = [ExpertFormat(gu, d, banks.hidden, banks.inter)
                        for gu, d in zip(banks.fmt_gu, banks.fmt_d, strict=True)]
        self.device = torch.device(device)
        self.bias_rows: torch.Tensor | None = None
        if banks.b13 is not None and banks.b2 is not None:
            rows = torch.cat([banks.b13.float(), banks.b2.float()], dim=1)
            self.bias_rows = rows.pin_memory() if self.device.type == "cuda" else rows.contiguous()
        self.packed = PackedSlots.allocate(self.formats, slots, self.device, bias=self.bias_rows is not None)
        self.slots = slots
        self.activation, self.alpha, self.limit = banks.activation, banks.alpha, banks.limit  # the experts' own
        # global scales travel with each expert only where a format has one (the slots start at 1.0)
        self.gscales = any(FORMATS[f].has_gscale for f in (*banks.fmt_gu, *banks.fmt_d))
        self._kernels: list | None = None  # type: ignore[type-arg]

    @classmethod
    def from_budget(cls, banks: PackedExpertBanks, budget_bytes: int,
                    device: torch.device | str = "cpu") -> PackedPool:
        formats = [ExpertFormat(gu, d, banks.hidden, banks.inter)
                   for gu, d in zip(banks.fmt_gu, banks.fmt_d, strict=True)]
        return cls(banks, slots_for_budget(budget_bytes, formats, banks.rows, bias=banks.b13 is not None), device)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes

    @property
    def kernels(self) -> list:  # type: ignore[type-arg]
        if self._kernels is None:
            from engine.gpu.quant.entry import packed_layer_kernels  # Triton: where a kernel runs

            self._kernels = packed_layer_kernels(self.packed, self.formats, self.activation, self.alpha, self.limit)
        return self._kernels

    def copy_expert(self, slot: int, flat: int) -> None:
        b = self.banks
        layer, expert = divmod(flat, b.num_experts)
        if not 0 <= slot < self.slots:
            raise ValueError(f"copy destination {slot} is not a slot of a pool of {self.slots}")
        if not 0 <= layer < len(b.gate_up):
            raise ValueError(f"expert {flat} is outside the banks ({b.rows} experts)")
        self.packed.copy_in(slot, self.formats[layer], b.gate_up[layer][expert], b.down[layer][expert],
                            b.gscale[layer][expert] if self.gscales else None,
                            None if self.bias_rows is None else self.bias_rows[flat])

    def apply_copies(self, copy_src: torch.Tensor, copy_dst: torch.Tensor, banks: PackedExpertBanks) -> int:
        """Copies the valid (src, dst) pairs; returns how many experts were copied."""
        assert banks is self.banks
        pairs = [(s, d) for s, d in zip(copy_src.tolist(), copy_dst.tolist(), strict=True) if s >= 0]
        for src, dst in pairs:
            self.copy_expert(dst, src)
        return len(pairs)

    def forward(self, slot: int, layer: int, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        fmt = self.formats[layer]
        gu = self.packed.gate_up(fmt)[slot].cpu()
        d = self.packed.down(fmt)[slot].cpu()
        s = self.packed.gscale[slot].cpu()
        inter, hidden = fmt.inter, fmt.hidden
        fgu, fd = FORMATS[fmt.fmt_gu], FORMATS[fmt.fmt_d]
        gate_w = fgu.dequantize(gu[:inter], hidden, s[0]).to(self.device)
        up_w = fgu.dequantize(gu[inter:], hidden, s[1]).to(self.device)
        down_w = fd.dequantize(d, inter, s[2]).to(self.device)
        bias = self.packed.bias[slot] if self.packed.bias is not None else None
        gate, up = F.linear(x, gate_w), F.linear(x, up_w)
        if bias is not None:
            gate, up = gate + bias[:inter], up + bias[inter:2 * inter]
        b = self.banks
        y = F.linear(activate(gate, up, b.activation, b.alpha, b.limit), down_w)
        return y + bias[2 * inter:2 * inter + hidden] if bias is not None else y
