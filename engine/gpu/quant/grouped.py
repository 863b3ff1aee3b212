"""Grouped routed experts over packed slots for a streamed prefill chunk: the packed counterpart of
engine/gpu/grouped.py's `grouped_experts`, on the same expert-sorted layout (`group_entries`,
shared), with the CPU kernel's arithmetic (f32 accumulation, h kept f32).

Contract: `packed_grouped_experts(x [N, H] bf16/f16/f32, ids [N, k], weights [N, k], slot_of [E],
slots: PackedSlots, fmt: ExpertFormat (the layer's), layout=None, *, activation="silu", alpha=1.702,
limit=7.0) -> [N, H] float32`: for each token the sum over its k entries of weight * (down h +
b_down), h = act(gate x + b_gate, up x + b_up), expert e's packed rows read from slot `slot_of[e]`
and dequantised in registers (times the slot's gscale), its biases from the slot's `slots.bias` row
(none without a bias block), act engine/gpu/quant/gemv.py's `activate` ("silu" or gpt-oss's
"swiglu_clamped"; ValueError for another). Every routed expert must have a slot; a token's k ids
are distinct. `layout`: `group_entries(ids, slot_of)` when the caller queued it already.
`grouped_launch(...)` -> GroupedLaunch | None: that function's checks and buffers (None for a call
without entries), for a caller that launches other kernels on the same layout
(engine/gpu/quant/grouped_bf16.py, which the layer entry runs instead of this kernel for some formats).

How: the bf16 kernels' tiling (one program per (block of BLOCK_M entries of one expert, N-tile),
BLOCK_M from `block_m`), with the weight tile [BLOCK_K, BLOCK_N] dequantised from the slot's bytes
before each dot (whole blocks: a block's scale fields read once per row and step). x is widened to
float32 and the dots take float32 operands: "tf32x3" on a GPU (three TF32 tensor-core products:
about float32's accuracy at tensor-core speed), IEEE under the interpreter. The k contributions of
a token are summed in float32 by a torch reduction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from engine.gpu.grouped import GroupedLayout, group_entries
from engine.gpu.quant.dequant import dequant_at
from engine.gpu.quant.dot import activate, activation_code
from engine.gpu.quant.formats import PackedFormat, packed_format
from engine.gpu.quant.slots import ExpertFormat, PackedSlots
from engine.options import triton_interpreted

_PRECISION = "ieee" if triton_interpreted() else "tf32x3"
# I-tile (each of gate and up) and H step; H-tile and I step; 8 warps. The dequantised weight tile
# lives in registers: with 64-value steps or 4 warps, ptxas spills (sm_90, every format); with
# these, none (255 registers at most). Untuned for speed.
_GATE_UP_N, _GATE_UP_K = 64, 32
_DOWN_N, _DOWN_K = 128, 32
_WARPS, _STAGES = 8, 3


@triton.jit
def _weight_tile(row_p, k0, m, g, FMT: tl.constexpr, QB: tl.constexpr, QBB: tl.constexpr, K: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """[BLOCK_K, BLOCK_N] values k0.. of the rows starting at row_p [1, BLOCK_N] (mask m [1, BLOCK_N]):
    one block per step when blocks are at least BLOCK_K values (k0 is a multiple of BLOCK_K), else
    BLOCK_K / QB whole blocks as a [blocks, QB, BLOCK_N] tile; either way a block's scale fields
    are read once per row."""
    if QB >= BLOCK_K:
        v = dequant_at(row_p + (k0 // QB) * QBB, k0 % QB + tl.arange(0, BLOCK_K)[:, None], m, g, FMT)
    else:
        blk = k0 // QB + tl.arange(0, BLOCK_K // QB)[:, None, None]
        v = dequant_at(row_p[None, :, :] + blk * QBB, tl.arange(0, QB)[None, :, None],
                       m[None, :, :] & (blk < K // QB), g, FMT)
        v = tl.reshape(v, (BLOCK_K, v.shape[2]))
    return v


@triton.jit
def block_tile(row_entry_ptr, blk, col_tile, N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A program's tile: its block's padded rows, their entries (-1: padding) and mask, and its
    columns of N and their mask."""
    rows = blk * BLOCK_M + tl.arange(0, BLOCK_M)
    entry = tl.load(row_entry_ptr + rows)
    cols = col_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    return rows, entry, entry >= 0, cols, cols < N


@triton.jit
def slot_rows(w_ptr, s, cols, STRIDE: tl.constexpr, OFF: tl.constexpr, RB: tl.constexpr):
    """Byte pointers [1, BLOCK_N] to rows `cols` of the matrix at OFF in slot s (rows of RB bytes)."""
    return (w_ptr + s.to(tl.int64) * STRIDE + OFF + cols.to(tl.int64) * RB)[None, :]


@triton.jit
def store_h(h_ptr, b_ptr, s, rows, rmask, cols, cmask, acc_g, acc_u, alpha, limit, INTER: tl.constexpr,
            BSTRIDE: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr):
    """A gate/up tile's epilogue: the slot's gate and up biases, the activation, h's rows stored."""
    if HAS_BIAS:  # the slot's bias row: gate [I], up [I], down [H]
        b_row = b_ptr + s.to(tl.int64) * BSTRIDE
        acc_g += tl.load(b_row + cols, mask=cmask, other=0.0)[None, :]
        acc_u += tl.load(b_row + INTER + cols, mask=cmask, other=0.0)[None, :]
    tl.store(h_ptr + rows.to(tl.int64)[:, None] * INTER + cols[None, :], activate(acc_g, acc_u, ACT, alpha, limit),
             mask=rmask[:, None] & cmask[None, :])


@triton.jit
def store_y(y_ptr, b_ptr, weight_ptr, s, entry, rmask, cols, cmask, acc, H: tl.constexpr, INTER: tl.constexpr,
            BSTRIDE: tl.constexpr, HAS_BIAS: tl.constexpr):
    """A down tile's epilogue: the slot's down bias, each entry's routing weight, its rows of y stored."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + s.to(tl.int64) * BSTRIDE + 2 * INTER + cols, mask=cmask, other=0.0)[None, :]
    e = tl.where(rmask, entry, 0)
    wgt = tl.load(weight_ptr + e, mask=rmask, other=0.0)
    tl.store(y_ptr + e.to(tl.int64)[:, None] * H + cols[None, :], acc * wgt[:, None],
             mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, gs_ptr, b_ptr, row_entry_ptr, block_slot_ptr, h_ptr, K, alpha, limit,
                    H: tl.constexpr, INTER: tl.constexpr, FMT: tl.constexpr, QB: tl.constexpr, QBB: tl.constexpr,
                    RB: tl.constexpr, STRIDE: tl.constexpr, GU_OFF: tl.constexpr, BSTRIDE: tl.constexpr,
                    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(INTER, BLOCK_N)
    blk = pid // n_tiles
    s = tl.load(block_slot_ptr + blk)
    if s >= 0:
        rows, entry, rmask, cols, cmask = block_tile(row_entry_ptr, blk, pid % n_tiles, INTER, BLOCK_M, BLOCK_N)
        token = tl.where(rmask, entry // K, 0)
        row_g = slot_rows(w_ptr, s, cols, STRIDE, 0, RB)
        row_u = row_g + INTER * RB
        gg = tl.load(gs_ptr + s * 3)
        gu = tl.load(gs_ptr + s * 3 + 1)
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            kmask = kk < H
            xt = tl.load(x_ptr + token.to(tl.int64)[:, None] * H + kk[None, :],
                         mask=rmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
            wg = _weight_tile(row_g, k0, cmask[None, :], gg, FMT, QB, QBB, H, BLOCK_K)  # [BLOCK_K, BLOCK_N]
            wu = _weight_tile(row_u, k0, cmask[None, :], gu, FMT, QB, QBB, H, BLOCK_K)
            acc_g = tl.dot(xt, wg, acc_g, input_precision=PRECISION)
            acc_u = tl.dot(xt, wu, acc_u, input_precision=PRECISION)
        store_h(h_ptr, b_ptr, s, rows, rmask, cols, cmask, acc_g, acc_u, alpha, limit, INTER, BSTRIDE, HAS_BIAS, ACT)


@triton.jit
def _down_kernel(h_ptr, w_ptr, gs_ptr, b_ptr, weight_ptr, row_entry_ptr, block_slot_ptr, y_ptr,
                 H: tl.constexpr, INTER: tl.constexpr, FMT: tl.constexpr, QB: tl.constexpr, QBB: tl.constexpr,
                 RB: tl.constexpr, STRIDE: tl.constexpr, GU_OFF: tl.constexpr, BSTRIDE: tl.constexpr,
                 HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(H, BLOCK_N)
    blk = pid // n_tiles
    s = tl.load(block_slot_ptr + blk)
    if s >= 0:
        rows, entry, rmask, cols, cmask = block_tile(row_entry_ptr, blk, pid % n_tiles, H, BLOCK_M, BLOCK_N)
        row_d = slot_rows(w_ptr, s, cols, STRIDE, GU_OFF, RB)
        gd = tl.load(gs_ptr + s * 3 + 2)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, INTER, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            kmask = kk < INTER
            ht = tl.load(h_ptr + rows.to(tl.int64)[:, None] * INTER + kk[None, :],
                         mask=rmask[:, None] & kmask[None, :], other=0.0)
            wt = _weight_tile(row_d, k0, cmask[None, :], gd, FMT, QB, QBB, INTER, BLOCK_K)
            acc = tl.dot(ht, wt, acc, input_precision=PRECISION)
        store_y(y_ptr, b_ptr, weight_ptr, s, entry, rmask, cols, cmask, acc, H, INTER, BSTRIDE, HAS_BIAS)


@dataclass(frozen=True)
class GroupedLaunch:
    """What a packed grouped call's two kernels take, checked and allocated once: the rows sorted by
    expert (`group_entries`), h [entries, I] and y [entries, H] float32, and the slot-layout
    constexprs both kernels share (`common`). engine/gpu/quant/grouped_bf16.py launches its kernels
    kernels from the same."""

    x: torch.Tensor
    flat_w: torch.Tensor
    row_entry: torch.Tensor
    block_slot: torch.Tensor
    h: torch.Tensor
    y: torch.Tensor
    bias: torch.Tensor
    fg: PackedFormat
    fd: PackedFormat
    k: int
    act: int
    common: dict[str, Any]

    @property
    def blocks(self) -> int:
        return int(self.block_slot.shape[0])

    def result(self) -> torch.Tensor:
        """Each token's sum over its k entries."""
        return self.y.view(-1, self.k, self.y.shape[1]).sum(dim=1)


def grouped_launch(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, slot_of: torch.Tensor,
                   slots: PackedSlots, fmt: ExpertFormat, layout: GroupedLayout | None,
                   activation: str) -> GroupedLaunch | None:
    """The checks (ValueError) and buffers of a call (module docstring); None when it has no entries."""
    slots.check(fmt)
    act = activation_code(activation)
    n, hidden = x.shape
    k = ids.shape[1]
    if hidden != fmt.hidden:
        raise ValueError(f"x: hidden size {hidden}, the experts have {fmt.hidden}")
    if n == 0 or k == 0:
        return None
    row_entry, block_slot, block = layout if layout is not None else group_entries(ids, slot_of)
    bias = slots.bias if slots.bias is not None else slots.gscale  # not read without a bias block
    common = {"STRIDE": slots.stride, "GU_OFF": fmt.gate_up_bytes, "BLOCK_M": block, "BSTRIDE": bias.stride(0),
              "HAS_BIAS": slots.bias is not None, "H": hidden, "INTER": fmt.inter}
    return GroupedLaunch(x.contiguous(), weights.reshape(-1).to(torch.float32).contiguous(), row_entry, block_slot,
                         torch.empty(row_entry.shape[0], fmt.inter, dtype=torch.float32, device=x.device),
                         torch.empty(n * k, hidden, dtype=torch.float32, device=x.device), bias,
                         packed_format(fmt.fmt_gu), packed_format(fmt.fmt_d), k, act, common)


def packed_grouped_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, slot_of: torch.Tensor,
                           slots: PackedSlots, fmt: ExpertFormat, layout: GroupedLayout | None = None, *,
                           activation: str = "silu", alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """See the module docstring."""
    g = grouped_launch(x, ids, weights, slot_of, slots, fmt, layout, activation)
    if g is None:
        return torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    fg, fd = g.fg, g.fd
    common = {**g.common, "PRECISION": _PRECISION, "num_warps": _WARPS, "num_stages": _STAGES}
    _gate_up_kernel[(g.blocks * triton.cdiv(fmt.inter, _GATE_UP_N),)](
        g.x, slots.data, slots.gscale, g.bias, g.row_entry, g.block_slot, g.h, g.k, float(alpha), float(limit),
        ACT=g.act, FMT=fg.code, QB=fg.block, QBB=fg.block_bytes, RB=fmt.gu_row_bytes, BLOCK_N=_GATE_UP_N,
        BLOCK_K=_GATE_UP_K, **common)
    _down_kernel[(g.blocks * triton.cdiv(fmt.hidden, _DOWN_N),)](
        g.h, slots.data, slots.gscale, g.bias, g.flat_w, g.row_entry, g.block_slot, g.y, FMT=fd.code, QB=fd.block,
        QBB=fd.block_bytes, RB=fmt.d_row_bytes, BLOCK_N=_DOWN_N, BLOCK_K=_DOWN_K, **common)
    return g.result()
