"""The executor's entry point to the packed kernels: per MoE layer, an object with the calls the GPU
tier makes on engine/gpu/kernels.py (decode step) and engine/gpu/grouped.py (streamed prefill), so
a packed model swaps the module for `layer_kernels[moe_index]` and keeps its plan, copy list and
hand-off as they are.

Contract: `packed_layer_kernels(slots: PackedSlots, formats: Sequence[ExpertFormat], activation="silu",
alpha=1.702, limit=7.0)` -> one `PackedLayerKernels` per MoE layer (the experts' activation, and the
biases in the slots' bias block when it has one: gpt-oss) (formats[i]: layer i's; the pool's stride must fit each), with
- `expert_rows(x, slot_ids, weights, slots_w13=None, slots_w2=None, copy_dst=None, between=None,
  split=None, scratch=-2) -> [N * k, H] float32`: `packed_expert_rows` on the layer's format
  (slots_w13 / slots_w2 are not read: the pool is the object's); `split` must be None (the expert
  split is for bf16 / f32 banks: ValueError);
- `combine_experts`, `hand_off`, `group_entries`: engine/gpu/kernels.py's and grouped.py's, as they are
  (combine_experts takes the float32 rows and writes out's dtype);
- `grouped_experts(x, ids, weights, slot_of, slots_w13=None, slots_w2=None, layout=None) -> [N, H]`
  in x's dtype: `packed_grouped_experts` (tf32x3), or `bf16_packed_grouped_experts` where `bf16_wins`
  for the layer's formats and x's dtype (engine/gpu/quant/grouped_bf16.py), rounded once to x's dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from engine.gpu.grouped import GroupedLayout, group_entries
from engine.gpu.kernels import combine_experts, hand_off
from engine.gpu.quant.gemv import packed_expert_rows
from engine.gpu.quant.grouped import packed_grouped_experts
from engine.gpu.quant.grouped_bf16 import bf16_packed_grouped_experts, bf16_wins
from engine.gpu.quant.slots import ExpertFormat, PackedSlots


class PackedLayerKernels:
    combine_experts = staticmethod(combine_experts)
    hand_off = staticmethod(hand_off)
    group_entries = staticmethod(group_entries)

    def __init__(self, slots: PackedSlots, fmt: ExpertFormat, activation: str = "silu", alpha: float = 1.702,
                 limit: float = 7.0) -> None:
        slots.check(fmt)
        self.slots = slots
        self.fmt = fmt
        self.activation, self.alpha, self.limit = activation, alpha, limit

    def expert_rows(self, x: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor,
                    slots_w13: torch.Tensor | None = None, slots_w2: torch.Tensor | None = None,
                    copy_dst: torch.Tensor | None = None, between: Callable[[], None] | None = None,
                    split: torch.Tensor | None = None, scratch: int = -2) -> torch.Tensor:
        if split is not None:
            raise ValueError("the expert split runs on bf16 / f32 banks only, these are "
                             f"{self.fmt.fmt_gu}/{self.fmt.fmt_d}")
        return packed_expert_rows(x, slot_ids, weights, self.slots, self.fmt, copy_dst, between,
                                  activation=self.activation, alpha=self.alpha, limit=self.limit)

    def grouped_experts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, slot_of: torch.Tensor,
                        slots_w13: torch.Tensor | None = None, slots_w2: torch.Tensor | None = None,
                        layout: GroupedLayout | None = None) -> torch.Tensor:
        grouped = bf16_packed_grouped_experts if bf16_wins(self.fmt, x.dtype) else packed_grouped_experts
        return grouped(x, ids, weights, slot_of, self.slots, self.fmt, layout, activation=self.activation,
                       alpha=self.alpha, limit=self.limit).to(x.dtype)


def packed_layer_kernels(slots: PackedSlots, formats: Sequence[ExpertFormat], activation: str = "silu",
                         alpha: float = 1.702, limit: float = 7.0) -> list[PackedLayerKernels]:
    return [PackedLayerKernels(slots, f, activation, alpha, limit) for f in formats]
