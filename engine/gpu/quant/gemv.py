"""Decode-step routed experts over packed slots (1..8 tokens): the packed counterpart of
engine/gpu/kernels.py's `expert_rows` / `slot_experts`, same plan contract, the CPU kernel's
arithmetic (native/packed.py: f32 accumulation, h = silu(g) * u kept f32, no activation quantisation).

Contract:
- `packed_expert_rows(x [N, H] bf16/f16/f32, slot_ids [N, k], weights [N, k], slots: PackedSlots,
  fmt: ExpertFormat (the layer's), copy_dst=None, between=None) -> [N * k, H] float32`: entry e's
  weight * down(silu(gate x) * up x), gate / up / down the slot's packed rows dequantised in registers (times the slot's gscale), zeros
  for entries without a slot (slot id < 0). With `copy_dst` (the slots a fetch is filling, -1
  padded) and `between` (what waits for it), the entries in other slots run first, then
  `between()`, then the fetched ones (engine/gpu/kernels.py's `_phase_slot`, shared): hits compute
  while the copies fly. The rows do not depend on which slot holds an expert.
- `packed_slot_experts(x, ids, slot_ids, weights, slots, fmt, cpu=None) -> [N, H] float32`: those rows
  summed per token in ascending expert id (`combine_experts`, shared), plus the CPU branch's part.

How: one program per (entry, tile of 16 output rows; 128 under the interpreter); gate_up walks H in
tiles of 128 columns, accumulating [16, 128] f32 products and reducing them once after the loop (the bf16 kernel's
measured choice); down walks I in tiles of 256. A slot's gate_up rows start at its first byte, its down rows
`fmt.gate_up_bytes` later (slots are `slots.stride` bytes apart). The expert split (scratch slot) is not supported:
the executor enables it for bf16 / f32 banks only.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from engine.gpu.kernels import _phase_slot, combine_experts
from engine.gpu.quant.dequant import dequant, silu
from engine.gpu.quant.formats import packed_format
from engine.gpu.quant.slots import ExpertFormat, PackedSlots
from engine.options import triton_interpreted

# gate_up: rows of I per program, H step; down: rows of H per program, I step. Triton's interpreter
# (the CPU tests) runs a program's tile as one numpy array: there, wider tiles, fewer programs
_BLOCK_I, _BLOCK_H = (128, 256) if triton_interpreted() else (16, 128)
_BLOCK_O, _BLOCK_K = (128, 256) if triton_interpreted() else (16, 256)


@triton.jit
def _gate_up_kernel(x_ptr, slot_ptr, w_ptr, gs_ptr, h_ptr, dst_ptr, H: tl.constexpr, INTER: tl.constexpr,
                    K: tl.constexpr, FMT: tl.constexpr, QB: tl.constexpr, QBB: tl.constexpr,
                    RB: tl.constexpr, STRIDE: tl.constexpr, GU_OFF: tl.constexpr,
                    BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr, PHASE: tl.constexpr, COPIES: tl.constexpr,
                    COPIES_P: tl.constexpr):
    e = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    rmask = rows < INTER
    s, go = _phase_slot(slot_ptr, dst_ptr, e, PHASE, COPIES, COPIES_P)
    if go:
        if s < 0:
            tl.store(h_ptr + e * INTER + rows, tl.zeros((BLOCK_I,), dtype=tl.float32), mask=rmask)
        else:
            t = e // K
            base = w_ptr + s.to(tl.int64) * STRIDE
            gg = tl.load(gs_ptr + s * 3)
            gu = tl.load(gs_ptr + s * 3 + 1)
            tile_g = tl.zeros((BLOCK_I, BLOCK_H), dtype=tl.float32)
            tile_u = tl.zeros((BLOCK_I, BLOCK_H), dtype=tl.float32)
            for h0 in range(0, H, BLOCK_H):
                cols = h0 + tl.arange(0, BLOCK_H)
                cmask = cols < H
                xv = tl.load(x_ptr + t * H + cols, mask=cmask, other=0.0).to(tl.float32)
                m = rmask[:, None] & cmask[None, :]
                wg = dequant(base, rows[:, None], cols[None, :], m, gg, FMT, QB, QBB, RB)
                wu = dequant(base, rows[:, None] + INTER, cols[None, :], m, gu, FMT, QB, QBB, RB)
                tile_g += wg * xv[None, :]
                tile_u += wu * xv[None, :]
            g = tl.sum(tile_g, axis=1)
            u = tl.sum(tile_u, axis=1)
            tl.store(h_ptr + e * INTER + rows, silu(g) * u, mask=rmask)


@triton.jit
def _down_kernel(h_ptr, slot_ptr, w_ptr, gs_ptr, wt_ptr, y_ptr, dst_ptr, H: tl.constexpr, INTER: tl.constexpr,
                 FMT: tl.constexpr, QB: tl.constexpr, QBB: tl.constexpr,
                 RB: tl.constexpr, STRIDE: tl.constexpr, GU_OFF: tl.constexpr, BLOCK_O: tl.constexpr,
                 BLOCK_K: tl.constexpr, PHASE: tl.constexpr, COPIES: tl.constexpr, COPIES_P: tl.constexpr):
    e = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
    rmask = rows < H
    s, go = _phase_slot(slot_ptr, dst_ptr, e, PHASE, COPIES, COPIES_P)
    if go:
        if s < 0:
            tl.store(y_ptr + e * H + rows, tl.zeros((BLOCK_O,), dtype=tl.float32), mask=rmask)
        else:
            base = w_ptr + s.to(tl.int64) * STRIDE + GU_OFF
            gd = tl.load(gs_ptr + s * 3 + 2)
            tile = tl.zeros((BLOCK_O, BLOCK_K), dtype=tl.float32)
            for k0 in range(0, INTER, BLOCK_K):
                cols = k0 + tl.arange(0, BLOCK_K)
                cmask = cols < INTER
                hv = tl.load(h_ptr + e * INTER + cols, mask=cmask, other=0.0)
                w = dequant(base, rows[:, None], cols[None, :], rmask[:, None] & cmask[None, :], gd, FMT, QB, QBB, RB)
                tile += w * hv[None, :]
            y = tl.sum(tile, axis=1) * tl.load(wt_ptr + e)
            tl.store(y_ptr + e * H + rows, y, mask=rmask)


def _check(x: torch.Tensor, slots: PackedSlots, fmt: ExpertFormat) -> None:
    slots.check(fmt)
    if x.shape[1] != fmt.hidden:
        raise ValueError(f"x: hidden size {x.shape[1]}, the experts have {fmt.hidden}")


def packed_expert_rows(x: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor, slots: PackedSlots,
                       fmt: ExpertFormat, copy_dst: torch.Tensor | None = None,
                       between: Callable[[], None] | None = None) -> torch.Tensor:
    """See the module docstring."""
    _check(x, slots, fmt)
    n, hidden = x.shape
    k = slot_ids.shape[1]
    inter = fmt.inter
    entries = n * k
    y = torch.empty(entries, hidden, dtype=torch.float32, device=x.device)
    if slots.slots == 0 or entries == 0:
        if between is not None:
            between()
        return y.zero_()
    fg, fd = packed_format(fmt.fmt_gu), packed_format(fmt.fmt_d)
    x = x.contiguous()
    slot_flat = slot_ids.reshape(-1).contiguous()
    w = weights.reshape(-1).to(torch.float32).contiguous()
    h = torch.empty(entries, inter, dtype=torch.float32, device=x.device)
    phased = copy_dst is not None and between is not None
    dst = copy_dst.contiguous() if copy_dst is not None and phased else slot_flat  # unused in phase 0
    copies = dst.numel() if phased else 1
    common = {"STRIDE": slots.stride, "GU_OFF": fmt.gate_up_bytes, "COPIES": copies,
              "COPIES_P": triton.next_power_of_2(copies), "num_warps": 4}
    for phase in ((1, 2) if phased else (0,)):
        if phase == 2:
            assert between is not None
            between()
        _gate_up_kernel[(entries, triton.cdiv(inter, _BLOCK_I))](
            x, slot_flat, slots.data, slots.gscale, h, dst, hidden, inter, K=k, FMT=fg.code, QB=fg.block,
            QBB=fg.block_bytes, RB=fmt.gu_row_bytes, BLOCK_I=_BLOCK_I, BLOCK_H=_BLOCK_H, PHASE=phase, **common)
        _down_kernel[(entries, triton.cdiv(hidden, _BLOCK_O))](
            h, slot_flat, slots.data, slots.gscale, w, y, dst, hidden, inter, FMT=fd.code, QB=fd.block,
            QBB=fd.block_bytes, RB=fmt.d_row_bytes, BLOCK_O=_BLOCK_O, BLOCK_K=_BLOCK_K, PHASE=phase, **common)
    return y


def packed_slot_experts(x: torch.Tensor, ids: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor,
                        slots: PackedSlots, fmt: ExpertFormat, cpu: torch.Tensor | None = None) -> torch.Tensor:
    """See the module docstring."""
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    combine_experts(packed_expert_rows(x, slot_ids, weights, slots, fmt), ids, out, cpu)
    return out
