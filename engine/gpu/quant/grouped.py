"""Grouped routed experts over packed slots for a streamed prefill chunk: the packed counterpart of
engine/gpu/grouped.py's `grouped_experts`, on the same expert-sorted layout (`group_entries`,
shared), with the CPU kernel's arithmetic (float32 accumulation of exact products, h kept float32).

Contract: `packed_grouped_experts(x [N, H] bf16/f16/f32, ids [N, k], weights [N, k], slot_of [E],
slots: PackedSlots, fmt: ExpertFormat (the layer's), layout=None, *, activation="silu", alpha=1.702,
limit=7.0) -> [N, H] float32`: for each token the sum over its k entries of weight * (down h +
b_down), h = act(gate x + b_gate, up x + b_up) in float32, expert e's packed rows read from slot
`slot_of[e]` (values times the slot's gscale where the format has one), its biases from the slot's
`slots.bias` row (none without a bias block), act engine/gpu/quant/gemv.py's `activate` ("silu" or
gpt-oss's "swiglu_clamped"; ValueError for another). Every routed expert must have a slot; a
token's k ids are distinct. `layout`: `group_entries(ids, slot_of)` when the caller queued it
already. The result is the float32 dot products of x (h) with the dequantised rows to float32
rounding, in another order of additions than a plain dot (below).

How: the bf16 kernels' tiling (one program per (block of BLOCK_M entries of one expert, N-tile),
BLOCK_M from `block_m`), with each weight value in its factored form (engine/gpu/quant/dequant.py:
value = d * code + o within a group of GROUP values along K, the code exact in bf16, d and o float32
per row and group), the same arithmetic as the CPU kernels of
native/src/kernels_packed_avx512bf16.cpp. Per group: the codes tile [G, BLOCK_N] is made from the
slot's bytes in registers and multiplied on tensor cores in bf16 with float32 accumulation,
partial = x_group @ codes (every product exact), then acc += partial * d, and for the formats with
an offset acc += (sum of the group's x per row) * o. The activations enter the dots as exact bf16
pieces whose float32 sum is the value: x as is when bf16; an f16 x in 2 pieces, an f32 x and the
float32 h in 3 (p1 = bf16(v), p2 = bf16(v - p1), p3 = bf16(v - p1 - p2)), one dot per piece into
the same partial. Under Triton's interpreter (whose dot takes bf16 operands as raw integers) the
operands are rounded through bf16 all the same and enter the dots as float32 with IEEE products, so
the interpreter checks the same arithmetic (its bf16 rounding truncates: other pieces than a GPU's
round-to-nearest ones, as exact). The k contributions of a token are summed in float32 by a torch
reduction.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.gpu.grouped import GroupedLayout, group_entries
from engine.gpu.quant.dequant import GROUP, OFFSET, code_at, group_scale_at
from engine.gpu.quant.dot import activate, activation_code
from engine.gpu.quant.formats import packed_format
from engine.gpu.quant.slots import ExpertFormat, PackedSlots
from engine.options import triton_interpreted

_GPU = tl.constexpr(not triton_interpreted())
# I-tile (each of gate and up) and H step; H-tile and I step; warps and pipeline stages. The steps
# are 32 values: one group, or two 16-value groups (each its own K=16 dot). Untuned: chosen so the
# registers stay modest (gate/up: 4 float32 [BLOCK_M, 64] tiles, down: 2 [BLOCK_M, 128]; BLOCK_M is
# 64 at most) and ptxas should not spill; neither spills nor speed measured on a GPU yet.
_GATE_UP_N, _GATE_UP_K = 64, 32
_DOWN_N, _DOWN_K = 128, 32
_WARPS, _STAGES = 8, 3
_PIECES = {torch.bfloat16: 1, torch.float16: 2}  # bf16 pieces of x per dtype; 3 for float32
_H_PIECES = 3  # h is float32


@triton.jit
def _operand(v):
    """Exact bf16 values (a float32 or bf16 tensor) as the dots' operand: bf16 on a GPU; under the
    interpreter (module docstring) rounded through bf16 all the same, then float32, so a value that
    is not exact in bf16 loses its low bits there too."""
    if _GPU:
        return v.to(tl.bfloat16)
    else:
        return v.to(tl.bfloat16).to(tl.float32)


@triton.jit
def _mma(a, b, acc):
    """acc + a @ b, float32 accumulation of the exact products of _operand values."""
    if _GPU:
        return tl.dot(a, b, acc, out_dtype=tl.float32)
    else:
        return tl.dot(a, b, acc, input_precision="ieee", out_dtype=tl.float32)


@triton.jit
def _group(row_p, kg, m, g, FMT: tl.constexpr, QB: tl.constexpr, QBB: tl.constexpr, G: tl.constexpr):
    """The codes [G, BLOCK_N] (dot operands) and (d, o) [1, BLOCK_N] of the group of G values kg..
    of the rows starting at row_p [1, BLOCK_N] (mask m [1, BLOCK_N])."""
    p = row_p + (kg // QB) * QBB
    c = _operand(code_at(p, kg % QB + tl.arange(0, G)[:, None], m, FMT))
    d, o = group_scale_at(p, (kg % QB) // G, m, g, FMT)
    return c, d, o


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, gs_ptr, b_ptr, row_entry_ptr, block_slot_ptr, h_ptr, K, alpha, limit,
                    H: tl.constexpr, INTER: tl.constexpr, FMT: tl.constexpr, QB: tl.constexpr, QBB: tl.constexpr,
                    G: tl.constexpr, OFF: tl.constexpr, NP: tl.constexpr,
                    RB: tl.constexpr, STRIDE: tl.constexpr, GU_OFF: tl.constexpr, BSTRIDE: tl.constexpr,
                    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(INTER, BLOCK_N)
    blk = pid // n_tiles
    s = tl.load(block_slot_ptr + blk)
    if s >= 0:
        rows = blk * BLOCK_M + tl.arange(0, BLOCK_M)
        entry = tl.load(row_entry_ptr + rows)
        rmask = entry >= 0
        x_row = x_ptr + tl.where(rmask, entry // K, 0).to(tl.int64)[:, None] * H
        cols = (pid % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < INTER
        row_g = (w_ptr + s.to(tl.int64) * STRIDE + cols.to(tl.int64) * RB)[None, :]
        row_u = row_g + INTER * RB
        gg = tl.load(gs_ptr + s * 3)
        gu = tl.load(gs_ptr + s * 3 + 1)
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            for i in tl.static_range(BLOCK_K // G):  # the step's groups
                kg = k0 + i * G
                kk = kg + tl.arange(0, G)
                xt = tl.load(x_row + kk[None, :], mask=rmask[:, None] & (kk < H)[None, :], other=0.0)
                wm = cmask[None, :] & (kg < H)
                cg, dg, og = _group(row_g, kg, wm, gg, FMT, QB, QBB, G)
                cu, du, ou = _group(row_u, kg, wm, gu, FMT, QB, QBB, G)
                part_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                part_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                r = xt.to(tl.float32)
                for q in tl.static_range(NP):  # x's exact bf16 pieces
                    if NP == 1:
                        piece = xt
                    else:
                        piece = r.to(tl.bfloat16)
                        if q + 1 < NP:
                            r = r - piece.to(tl.float32)
                    part_g = _mma(_operand(piece), cg, part_g)
                    part_u = _mma(_operand(piece), cu, part_u)
                acc_g += part_g * dg
                acc_u += part_u * du
                if OFF:
                    xs = tl.sum(xt.to(tl.float32), axis=1)[:, None]
                    acc_g += xs * og
                    acc_u += xs * ou
        if HAS_BIAS:  # the slot's bias row: gate [I], up [I], down [H]
            b_row = b_ptr + s.to(tl.int64) * BSTRIDE
            acc_g += tl.load(b_row + cols, mask=cmask, other=0.0)[None, :]
            acc_u += tl.load(b_row + INTER + cols, mask=cmask, other=0.0)[None, :]
        tl.store(h_ptr + rows.to(tl.int64)[:, None] * INTER + cols[None, :], activate(acc_g, acc_u, ACT, alpha, limit),
                 mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _down_kernel(h_ptr, w_ptr, gs_ptr, b_ptr, weight_ptr, row_entry_ptr, block_slot_ptr, y_ptr,
                 H: tl.constexpr, INTER: tl.constexpr, FMT: tl.constexpr, QB: tl.constexpr, QBB: tl.constexpr,
                 G: tl.constexpr, OFF: tl.constexpr, NP: tl.constexpr,
                 RB: tl.constexpr, STRIDE: tl.constexpr, GU_OFF: tl.constexpr, BSTRIDE: tl.constexpr,
                 HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(H, BLOCK_N)
    blk = pid // n_tiles
    s = tl.load(block_slot_ptr + blk)
    if s >= 0:
        rows = blk * BLOCK_M + tl.arange(0, BLOCK_M)
        entry = tl.load(row_entry_ptr + rows)
        rmask = entry >= 0
        h_row = h_ptr + rows.to(tl.int64)[:, None] * INTER
        cols = (pid % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < H
        row_d = (w_ptr + s.to(tl.int64) * STRIDE + GU_OFF + cols.to(tl.int64) * RB)[None, :]
        gd = tl.load(gs_ptr + s * 3 + 2)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, INTER, BLOCK_K):
            for i in tl.static_range(BLOCK_K // G):
                kg = k0 + i * G
                kk = kg + tl.arange(0, G)
                ht = tl.load(h_row + kk[None, :], mask=rmask[:, None] & (kk < INTER)[None, :], other=0.0)
                c, d, o = _group(row_d, kg, cmask[None, :] & (kg < INTER), gd, FMT, QB, QBB, G)
                part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                r = ht
                for q in tl.static_range(NP):  # h's exact bf16 pieces
                    piece = r.to(tl.bfloat16)
                    if q + 1 < NP:
                        r = r - piece.to(tl.float32)
                    part = _mma(_operand(piece), c, part)
                acc += part * d
                if OFF:
                    acc += tl.sum(ht, axis=1)[:, None] * o
        if HAS_BIAS:
            acc += tl.load(b_ptr + s.to(tl.int64) * BSTRIDE + 2 * INTER + cols, mask=cmask, other=0.0)[None, :]
        e = tl.where(rmask, entry, 0)
        wgt = tl.load(weight_ptr + e, mask=rmask, other=0.0)
        tl.store(y_ptr + e.to(tl.int64)[:, None] * H + cols[None, :], acc * wgt[:, None],
                 mask=rmask[:, None] & cmask[None, :])


def packed_grouped_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, slot_of: torch.Tensor,
                           slots: PackedSlots, fmt: ExpertFormat, layout: GroupedLayout | None = None, *,
                           activation: str = "silu", alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """See the module docstring."""
    slots.check(fmt)
    act = activation_code(activation)
    n, hidden = x.shape
    k = ids.shape[1]
    inter = fmt.inter
    if hidden != fmt.hidden:
        raise ValueError(f"x: hidden size {hidden}, the experts have {fmt.hidden}")
    if n == 0 or k == 0:
        return torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    row_entry, block_slot, block = layout if layout is not None else group_entries(ids, slot_of)
    blocks = block_slot.shape[0]
    fg, fd = packed_format(fmt.fmt_gu), packed_format(fmt.fmt_d)
    x = x.contiguous()
    flat_w = weights.reshape(-1).to(torch.float32).contiguous()
    h = torch.empty(row_entry.shape[0], inter, dtype=torch.float32, device=x.device)
    bias = slots.bias if slots.bias is not None else slots.gscale  # not read without a bias block
    common = {"STRIDE": slots.stride, "GU_OFF": fmt.gate_up_bytes, "BLOCK_M": block,
              "BSTRIDE": bias.stride(0), "HAS_BIAS": slots.bias is not None, "num_warps": _WARPS,
              "num_stages": _STAGES}
    _gate_up_kernel[(blocks * triton.cdiv(inter, _GATE_UP_N),)](
        x, slots.data, slots.gscale, bias, row_entry, block_slot, h, k, float(alpha), float(limit), H=hidden,
        INTER=inter, ACT=act, FMT=fg.code, QB=fg.block, QBB=fg.block_bytes, G=GROUP[fg.code],
        OFF=fg.code in OFFSET, NP=_PIECES.get(x.dtype, 3), RB=fmt.gu_row_bytes, BLOCK_N=_GATE_UP_N,
        BLOCK_K=_GATE_UP_K, **common)
    y = torch.empty(n * k, hidden, dtype=torch.float32, device=x.device)
    _down_kernel[(blocks * triton.cdiv(hidden, _DOWN_N),)](
        h, slots.data, slots.gscale, bias, flat_w, row_entry, block_slot, y, H=hidden, INTER=inter, FMT=fd.code,
        QB=fd.block, QBB=fd.block_bytes, G=GROUP[fd.code], OFF=fd.code in OFFSET, NP=_H_PIECES,
        RB=fmt.d_row_bytes, BLOCK_N=_DOWN_N, BLOCK_K=_DOWN_K, **common)
    return y.view(n, k, hidden).sum(dim=1)
