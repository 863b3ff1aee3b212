"""Per-step block dot products of the packed decode GEMV (engine/gpu/quant/gemv.py): a tile of f32
products of packed weight rows and an input vector, laid out per format so each program reads its
blocks' bytes contiguously and decodes each byte once.

Contract (@triton.jit functions):
- `dot_zeros(ROWS, NB, QB, FMT)`: the accumulator tile a format uses, zeros.
- `dot_step(tile, row_p [ROWS] uint8 pointers, v_ptr, b0, rmask [ROWS], g, FMT, QB, QBB, NB, NBLK,
  DOWN, INTER, ACT, alpha, limit) -> tile`: tile plus the products W[row, j] * v[j] for the values
  j of blocks b0 .. b0 + NB - 1 (those below NBLK) of each row, W[row, j] computed exactly as
  engine/gpu/quant/dequant.py's `dequant_at` computes it (bit for bit: the same f32 operations in the
  same order). v is the input at v_ptr: x widened to f32, or with DOWN the activation
  `activate(g, u)` of a gate_up row [g (INTER values) | u (INTER values)] at v_ptr.
- `dot_total(tile, FMT) -> [ROWS]`: the tile summed per row.
- `activate(g, u, ACT, ALPHA, LIMIT)`, `ACTIVATIONS`, `activation_code(name)`: the experts' gated
  activation (ACT 0 silu(g) * u; ACT 1 gpt-oss's clamped SwiGLU), shared with grouped.py.

Layouts: q4_k as [rows, blocks, 4 byte groups, 32 bytes] (a byte holds the values j and j + 32 of
its 64-value group; a group's two sub-block scales are decoded once per group); q6_k as [rows,
blocks, 2 halves, 32] (one low-bits byte pair and one high-bits byte give four values); the
32-value nibble formats (q4_0, iq4_nl, mxfp4) as [rows, blocks, 16 bytes], two values per byte;
every other format value by value, [rows, blocks, QB], through `dequant_at`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from engine.gpu.quant.dequant import _e2m1x2, _f16, _iq4, _k4_scale_min, _mul, _u8, dequant_at, silu

ACTIVATIONS = {"silu": 0, "swiglu_clamped": 1}


def activation_code(activation: str) -> int:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}, got {activation!r}")
    return ACTIVATIONS[activation]


@triton.jit
def activate(g, u, ACT: tl.constexpr, ALPHA, LIMIT):
    """h from f32 g and u: silu(g) * u (ACT 0), or the clamped SwiGLU (ACT 1): g <= LIMIT,
    -LIMIT <= u <= LIMIT, (u + 1) * g * sigmoid(ALPHA g) (= silu(ALPHA g) / ALPHA)."""
    if ACT == 0:
        h = silu(g) * u
    else:
        gc = tl.minimum(g, LIMIT)
        uc = tl.minimum(tl.maximum(u, -LIMIT), LIMIT)
        h = (uc + 1.0) * (silu(gc * ALPHA) / ALPHA)
    return h


@triton.jit
def _vec(v_ptr, idx, m, DOWN: tl.constexpr, INTER: tl.constexpr, ACT: tl.constexpr, alpha, limit):
    if DOWN:
        g = tl.load(v_ptr + idx, mask=m, other=0.0)
        u = tl.load(v_ptr + INTER + idx, mask=m, other=0.0)
        v = activate(g, u, ACT, alpha, limit)
    else:
        v = tl.load(v_ptr + idx, mask=m, other=0.0).to(tl.float32)
    return v


@triton.jit
def dot_zeros(ROWS: tl.constexpr, NB: tl.constexpr, QB: tl.constexpr, FMT: tl.constexpr):
    if FMT == 7:
        t = tl.zeros((ROWS, NB, 4, 32), dtype=tl.float32)
    elif FMT == 9:
        t = tl.zeros((ROWS, NB, 2, 32), dtype=tl.float32)
    elif FMT == 1 or FMT == 10 or FMT == 12:  # q4_0, iq4_nl, mxfp4
        t = tl.zeros((ROWS, NB, 16), dtype=tl.float32)
    else:
        t = tl.zeros((ROWS, NB, QB), dtype=tl.float32)
    return t


@triton.jit
def dot_total(tile, FMT: tl.constexpr):
    if FMT == 7 or FMT == 9:
        s = tl.sum(tl.sum(tl.sum(tile, axis=3), axis=2), axis=1)
    else:
        s = tl.sum(tl.sum(tile, axis=2), axis=1)
    return s


@triton.jit
def _nibble_value(p, n, m, FMT: tl.constexpr):
    """Value of nibble n in a 32-value block at p (f16 scale, or mxfp4's e8m0 exponent), as dequant_at."""
    if FMT == 1:
        v = _f16(p, m) * (n - 8).to(tl.float32)
    elif FMT == 10:
        v = _f16(p, m) * _iq4(n)
    else:
        e = _u8(p, m)
        d = tl.where(e < 2, 0x00200000 << e, (e - 1) << 23).to(tl.float32, bitcast=True)
        v = d * _e2m1x2(n).to(tl.float32)
    return v


@triton.jit
def dot_step(tile, row_p, v_ptr, b0, rmask, g, FMT: tl.constexpr, QB: tl.constexpr, QBB: tl.constexpr,
             NB: tl.constexpr, NBLK: tl.constexpr, DOWN: tl.constexpr, INTER: tl.constexpr, ACT: tl.constexpr,
             alpha, limit):
    blk = b0 + tl.arange(0, NB)
    if FMT == 7:  # q4_k: d, dmin, scales[12], qs[128]; byte 32q + l: values 64q + l (low), + 32 (high)
        bm = (blk < NBLK)[None, :, None, None]
        p = row_p[:, None, None, None] + (blk * QBB)[None, :, None, None]
        mb = rmask[:, None, None, None] & bm
        q = tl.arange(0, 4)[None, None, :, None]
        lane = tl.arange(0, 32)[None, None, None, :]
        byte = _u8(p + 16 + q * 32 + lane, mb)
        sc0, mn0 = _k4_scale_min(p + 4, 2 * q, mb)
        sc1, mn1 = _k4_scale_min(p + 4, 2 * q + 1, mb)
        d = _f16(p, mb)
        dmin = _f16(p + 2, mb)
        v0 = _mul(d * sc0, (byte & 15).to(tl.float32)) - _mul(dmin, mn0)
        v1 = _mul(d * sc1, (byte >> 4).to(tl.float32)) - _mul(dmin, mn1)
        j = (blk * QB)[None, :, None, None] + q * 64 + lane
        tile += v0 * _vec(v_ptr, j, bm, DOWN, INTER, ACT, alpha, limit)
        tile += v1 * _vec(v_ptr, j + 32, bm, DOWN, INTER, ACT, alpha, limit)
    elif FMT == 9:  # q6_k: ql[128], qh[64], scales[16] int8, d; values 128h + l + 32r, r = 0..3
        bm = (blk < NBLK)[None, :, None, None]
        p = row_p[:, None, None, None] + (blk * QBB)[None, :, None, None]
        mb = rmask[:, None, None, None] & bm
        h = tl.arange(0, 2)[None, None, :, None]
        lane = tl.arange(0, 32)[None, None, None, :]
        a = _u8(p + h * 64 + lane, mb)
        b = _u8(p + h * 64 + 32 + lane, mb)
        c = _u8(p + 128 + h * 32 + lane, mb)
        d = _f16(p + 208, mb)
        sp = p + 192 + h * 8 + lane // 16
        j = (blk * QB)[None, :, None, None] + h * 128 + lane
        q0 = (a & 15) | ((c & 3) << 4)
        q1 = (b & 15) | (((c >> 2) & 3) << 4)
        q2 = (a >> 4) | (((c >> 4) & 3) << 4)
        q3 = (b >> 4) | (((c >> 6) & 3) << 4)
        s0 = tl.load(sp, mask=mb, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        s1 = tl.load(sp + 2, mask=mb, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        s2 = tl.load(sp + 4, mask=mb, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        s3 = tl.load(sp + 6, mask=mb, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        tile += (d * s0) * (q0 - 32).to(tl.float32) * _vec(v_ptr, j, bm, DOWN, INTER, ACT, alpha, limit)
        tile += (d * s1) * (q1 - 32).to(tl.float32) * _vec(v_ptr, j + 32, bm, DOWN, INTER, ACT, alpha, limit)
        tile += (d * s2) * (q2 - 32).to(tl.float32) * _vec(v_ptr, j + 64, bm, DOWN, INTER, ACT, alpha, limit)
        tile += (d * s3) * (q3 - 32).to(tl.float32) * _vec(v_ptr, j + 96, bm, DOWN, INTER, ACT, alpha, limit)
    elif FMT == 1 or FMT == 10 or FMT == 12:  # scale field, qs[16]: byte i holds values i (low) and i + 16 (high)
        bm = (blk < NBLK)[None, :, None]
        p = row_p[:, None, None] + (blk * QBB)[None, :, None]
        mb = rmask[:, None, None] & bm
        i = tl.arange(0, 16)[None, None, :]
        byte = _u8(p + QBB - 16 + i, mb)
        j = (blk * QB)[None, :, None] + i
        tile += _nibble_value(p, byte & 15, mb, FMT) * _vec(v_ptr, j, bm, DOWN, INTER, ACT, alpha, limit)
        tile += _nibble_value(p, byte >> 4, mb, FMT) * _vec(v_ptr, j + 16, bm, DOWN, INTER, ACT, alpha, limit)
    else:
        bm = (blk < NBLK)[None, :, None]
        p = row_p[:, None, None] + (blk * QBB)[None, :, None]
        jj = tl.arange(0, QB)[None, None, :]
        v = _vec(v_ptr, (blk * QB)[None, :, None] + jj, bm, DOWN, INTER, ACT, alpha, limit)
        tile += dequant_at(p, jj, rmask[:, None, None] & bm, g[:, None, None], FMT) * v
    return tile
