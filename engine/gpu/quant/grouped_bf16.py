"""The streamed prefill's grouped experts over packed slots with bf16 tensor-core products of exact
codes and the group scale factored out: the layer entry (engine/gpu/quant/entry.py) runs it in place of
engine/gpu/quant/grouped.py's float32 "tf32x3" tiles where it was measured faster (`bf16_wins`;
evals/gpu/packed_grouped_probe.py times the two side by side).

Contract: `bf16_packed_grouped_experts(...)`: `packed_grouped_experts`'s contract (same arguments and
result, float32 to float32 rounding; another order of additions). `bf16_wins(fmt, x_dtype)`: whether this
kernel is the one for this format pair and x dtype.

How: each weight value in a factored form, value = d * code + o within a group of GROUP values of a
row (32, or 16 for q2_k / q3_k / q6_k / nvfp4; fp8's scale is constant over its 128-value block):
`code_at` gives codes that are exact in bf16 (integers of at most 8 significant bits, e2m1 times 2,
e4m3 values), `group_scale_at` (d, o) float32 (o: +m for q4_1 / q5_1, -dmin * min for q2_k / q4_k /
q5_k, else zero; d the reference's own products, e2m1's 1/2 folded into nvfp4's d). Per group the
codes tile [G, BLOCK_N] is made in registers and multiplied on tensor cores in bf16 with float32
accumulation, partial = x_group @ codes (every product exact), then acc += partial * d, plus (sum of
the group's x per row) * o. The activations enter the dots as exact bf16 pieces whose float32 sum is
the value: x as is when bf16, 2 pieces for f16, 3 for an f32 x and for the float32 h (p1 = bf16(v),
p2 = bf16(v - p1), p3 = bf16(v - p1 - p2)). Under Triton's interpreter (whose dot takes bf16
operands as raw integers) the operands are rounded through bf16 and enter the dots as float32.

Measured (H100, Qwen3-30B-A3B's experts, 8192 tokens, bf16 x; docs/benchmarks.md): 1.58x the tf32x3
kernel for q8_0 and 1.65x for mxfp4, 0.89x for q4_k / q6_k (there both are bound by decoding the
weight bytes: per 32-value step of gate/up this kernel issues 4 HGMMA against 40, but as many other
instructions, 136 of them byte-wise global loads), so only those two formats, with a bf16 x, come here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.gpu.grouped import GroupedLayout
from engine.gpu.quant.dequant import _e2m1x2, _e4m3, _f16, _f32, _iq4, _k4_scale_min, _nib, _u8
from engine.gpu.quant.grouped import block_tile, grouped_launch, slot_rows, store_h, store_y
from engine.gpu.quant.slots import ExpertFormat, PackedSlots
from engine.options import triton_interpreted

# format pairs (gate_up, down) and x dtypes where this kernel was measured faster than tf32x3 (the docstring)
BF16_WINS: frozenset[str] = frozenset({"q8_0", "mxfp4"})


def bf16_wins(fmt: ExpertFormat, x_dtype: torch.dtype) -> bool:
    return x_dtype == torch.bfloat16 and fmt.fmt_gu in BF16_WINS and fmt.fmt_d in BF16_WINS


# the factored form's group size per format code, and the codes whose values carry an offset
GROUP: dict[int, int] = {0: 32, 1: 32, 2: 32, 3: 32, 4: 32, 5: 16, 6: 16, 7: 32, 8: 32, 9: 16, 10: 32, 11: 32,
                         12: 32, 13: 32, 14: 16}
OFFSET: frozenset[int] = frozenset({2, 4, 5, 7, 8})


@triton.jit
def code_at(p, j, m, FMT: tl.constexpr):
    """The codes (module docstring) of values j (index in the block) of the blocks at byte pointers
    p, m masking p: float32, each exact in bf16. p and j broadcast as in dequant_at."""
    if FMT == 0:  # q8_0
        c = tl.load(p + 2 + j, mask=m, other=0).to(tl.int8, bitcast=True).to(tl.float32)
    elif FMT == 1:  # q4_0
        c = (_nib(p + 2, j, m) - 8).to(tl.float32)
    elif FMT == 2:  # q4_1
        c = _nib(p + 4, j, m).to(tl.float32)
    elif FMT == 3:  # q5_0
        c = ((_nib(p + 6, j, m) | (((_u8(p + 2 + j // 8, m) >> (j % 8)) & 1) << 4)) - 16).to(tl.float32)
    elif FMT == 4:  # q5_1
        c = (_nib(p + 8, j, m) | (((_u8(p + 4 + j // 8, m) >> (j % 8)) & 1) << 4)).to(tl.float32)
    elif FMT == 5:  # q2_k
        c = ((_u8(p + 16 + (j // 128) * 32 + j % 32, m) >> (((j % 128) // 32) * 2)) & 3).to(tl.float32)
    elif FMT == 6:  # q3_k
        ql = (_u8(p + 32 + (j // 128) * 32 + j % 32, m) >> (((j % 128) // 32) * 2)) & 3
        qh = (_u8(p + j % 32, m) >> (j // 32)) & 1
        c = (ql - ((qh ^ 1) << 2)).to(tl.float32)
    elif FMT == 7:  # q4_k
        c = ((_u8(p + 16 + (j // 64) * 32 + j % 32, m) >> (((j % 64) // 32) * 4)) & 15).to(tl.float32)
    elif FMT == 8:  # q5_k
        ql = (_u8(p + 48 + (j // 64) * 32 + j % 32, m) >> (((j % 64) // 32) * 4)) & 15
        qh = (_u8(p + 16 + j % 32, m) >> (j // 32)) & 1
        c = (ql | (qh << 4)).to(tl.float32)
    elif FMT == 9:  # q6_k
        ql = (_u8(p + (j // 128) * 64 + j % 64, m) >> (((j % 128) // 64) * 4)) & 15
        qh = (_u8(p + 128 + (j // 128) * 32 + j % 32, m) >> (((j % 128) // 32) * 2)) & 3
        c = ((ql | (qh << 4)) - 32).to(tl.float32)
    elif FMT == 10:  # iq4_nl
        c = _iq4(_nib(p + 2, j, m))
    elif FMT == 11:  # iq4_xs
        c = _iq4((_u8(p + 8 + (j // 32) * 16 + j % 16, m) >> (((j % 32) // 16) * 4)) & 15)
    elif FMT == 12:  # mxfp4: e2m1 times 2 (the 1/2 is in dequant_at's e8m0 "half" scale already)
        c = _e2m1x2(_nib(p + 1, j, m)).to(tl.float32)
    elif FMT == 13:  # fp8: e4m3 (3 mantissa bits, exponents within bf16's)
        c = _e4m3(_u8(p + 4 + j, m))
    else:  # nvfp4: e2m1 times 2 (the 1/2 is in d; nibble 8, -0.0, is a zero)
        c = _e2m1x2((_u8(p + 1 + j // 2, m) >> ((j % 2) * 4)) & 15).to(tl.float32)
    return c


@triton.jit
def group_scale_at(p, s, m, g, FMT: tl.constexpr):
    """(d, o) float32 of group s (index in the block, in GROUP[FMT] values) of the blocks at byte
    pointers p, m masking p: value = d * code + o (module docstring); o is zeros outside OFFSET."""
    if FMT == 0 or FMT == 1 or FMT == 3 or FMT == 10:  # q8_0, q4_0, q5_0, iq4_nl
        d = _f16(p, m)
        o = tl.zeros_like(d)
    elif FMT == 2 or FMT == 4:  # q4_1, q5_1
        d = _f16(p, m)
        o = _f16(p + 2, m)
    elif FMT == 5:  # q2_k
        sc = _u8(p + s, m)
        d = _f16(p + 80, m) * (sc & 15).to(tl.float32)
        o = -(_f16(p + 82, m) * (sc >> 4).to(tl.float32))
    elif FMT == 6:  # q3_k
        lo = (_u8(p + 96 + s % 8, m) >> ((s // 8) * 4)) & 15
        hi = (_u8(p + 104 + s % 4, m) >> ((s // 4) * 2)) & 3
        d = _f16(p + 108, m) * ((lo | (hi << 4)) - 32).to(tl.float32)
        o = tl.zeros_like(d)
    elif FMT == 7 or FMT == 8:  # q4_k, q5_k
        sc, mn = _k4_scale_min(p + 4, s, m)
        d = _f16(p, m) * sc
        o = -(_f16(p + 2, m) * mn)
    elif FMT == 9:  # q6_k
        d = _f16(p + 208, m) * tl.load(p + 192 + s, mask=m, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        o = tl.zeros_like(d)
    elif FMT == 11:  # iq4_xs
        hi = ((_u8(p + 2, m) | (_u8(p + 3, m) << 8)) >> (2 * s)) & 3
        lo = (_u8(p + 4 + s // 2, m) >> ((s % 2) * 4)) & 15
        d = _f16(p, m) * ((lo | (hi << 4)) - 32).to(tl.float32)
        o = tl.zeros_like(d)
    elif FMT == 12:  # mxfp4
        e = _u8(p, m)
        d = tl.where(e < 2, 0x00200000 << e, (e - 1) << 23).to(tl.float32, bitcast=True)
        o = tl.zeros_like(d)
    elif FMT == 13:  # fp8
        d = _f32(p, m)
        o = tl.zeros_like(d)
    else:  # nvfp4: e4m3 scale / 2 (exact) times the global scale
        d = (_e4m3(_u8(p, m)) * 0.5) * g
        o = tl.zeros_like(d)
    return d, o


_GPU = tl.constexpr(not triton_interpreted())
# I-tile (each of gate and up; half of it for an f16 / f32 x) and H step; H-tile and I step; warps and
# pipeline stages. The steps are 32 values: one group, or two 16-value groups (each its own K=16 dot).
# Chosen so that ptxas does not spill at BLOCK_M 64 on sm_90 for any format pair (checked by compiling
# for sm_90 without a GPU: triton.compile with GPUTarget("cuda", 90, 32), cuobjdump --dump-resource-usage;
# an H-tile of 128 spilled up to 152 bytes, a 64-wide I-tile with three x pieces up to 296); speed
# measured on a GPU at these tiles only (the docstring).
_GATE_UP_N, _GATE_UP_K = 64, 32
_DOWN_N, _DOWN_K = 64, 32
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
        rows, entry, rmask, cols, cmask = block_tile(row_entry_ptr, blk, pid % n_tiles, INTER, BLOCK_M, BLOCK_N)
        x_row = x_ptr + tl.where(rmask, entry // K, 0).to(tl.int64)[:, None] * H
        row_g = slot_rows(w_ptr, s, cols, STRIDE, 0, RB)
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
        store_h(h_ptr, b_ptr, s, rows, rmask, cols, cmask, acc_g, acc_u, alpha, limit, INTER, BSTRIDE, HAS_BIAS, ACT)


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
        rows, entry, rmask, cols, cmask = block_tile(row_entry_ptr, blk, pid % n_tiles, H, BLOCK_M, BLOCK_N)
        h_row = h_ptr + rows.to(tl.int64)[:, None] * INTER
        row_d = slot_rows(w_ptr, s, cols, STRIDE, GU_OFF, RB)
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
        store_y(y_ptr, b_ptr, weight_ptr, s, entry, rmask, cols, cmask, acc, H, INTER, BSTRIDE, HAS_BIAS)


def bf16_packed_grouped_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, slot_of: torch.Tensor,
                                slots: PackedSlots, fmt: ExpertFormat, layout: GroupedLayout | None = None, *,
                                activation: str = "silu", alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """See the module docstring."""
    g = grouped_launch(x, ids, weights, slot_of, slots, fmt, layout, activation)
    if g is None:
        return torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    fg, fd = g.fg, g.fd
    common = {**g.common, "num_warps": _WARPS, "num_stages": _STAGES}
    pieces = _PIECES.get(g.x.dtype, 3)
    gu_n = _GATE_UP_N if pieces == 1 else _GATE_UP_N // 2  # more pieces, more live registers
    _gate_up_kernel[(g.blocks * triton.cdiv(fmt.inter, gu_n),)](
        g.x, slots.data, slots.gscale, g.bias, g.row_entry, g.block_slot, g.h, g.k, float(alpha), float(limit),
        ACT=g.act, FMT=fg.code, QB=fg.block, QBB=fg.block_bytes, G=GROUP[fg.code], OFF=fg.code in OFFSET,
        NP=pieces, RB=fmt.gu_row_bytes, BLOCK_N=gu_n, BLOCK_K=_GATE_UP_K, **common)
    _down_kernel[(g.blocks * triton.cdiv(fmt.hidden, _DOWN_N),)](
        g.h, slots.data, slots.gscale, g.bias, g.flat_w, g.row_entry, g.block_slot, g.y, FMT=fd.code,
        QB=fd.block, QBB=fd.block_bytes, G=GROUP[fd.code], OFF=fd.code in OFFSET, NP=_H_PIECES,
        RB=fmt.d_row_bytes, BLOCK_N=_DOWN_N, BLOCK_K=_DOWN_K, **common)
    return g.result()
