"""In-register dequantisation of packed expert rows (the layout of engine/gpu/quant/formats.py).

Contract:
- `dequant(ptr, row, col, mask, g, FMT, QB, QBB, ROW_BYTES)` (a @triton.jit function the GEMV and
  GEMM kernels call): the float32 values W[row, col] of the packed matrix at `ptr` (uint8, rows of
  ROW_BYTES bytes), for broadcastable int tensors `row` and `col` (a [R, 1] x [1, C] tile or its
  transpose); masked-off elements read zero bytes. `g` is the matrix's global scale (nvfp4 only;
  other formats ignore it). Each value is computed with the float32 operations, in the order, of
  the reference (gguf.quants' dequantize_blocks for the GGUF types; value = e4m3 * scale for fp8;
  e2m1 * e4m3 * g for nvfp4), so it is bit-exact; on a GPU the products that feed an add are
  rounded on their own (mul_rn), never contracted into an fma.
- `dequant_at(p, j, mask, g, FMT)`: the same from block pointers p and in-block indices j (any
  broadcastable shapes: a caller that tiles whole blocks passes p [R, NB, 1] and j [1, 1, B], so a
  block's scale fields are read once per block).
- `dequantize(packed [N, row_bytes] uint8, fmt, k, gscale=1.0) -> [N, k] float32`: the same
  through a small kernel (tests, and a caller that needs a dense copy).

How: every element computes its block's byte address (row * ROW_BYTES + col // QB * QBB) and
gathers its quant bits and its block's scale bytes (cached loads: the scale bytes are shared by a
block's elements); f16 / f32 fields are assembled from bytes and bitcast; lookup tables (iq4's
non-linear values) are packed into two 64-bit constants (eight 8-bit entries each).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from engine.gpu.quant.formats import packed_format, row_bytes
from engine.options import triton_interpreted

_GPU = tl.constexpr(not triton_interpreted())  # the interpreter has no libdevice (and never fuses)
# iq4_nl's values (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113): the
# first eight negated, each table byte i at bits 8i
_IQ4_LO = tl.constexpr(sum(v << (8 * i) for i, v in enumerate((127, 104, 83, 65, 49, 35, 22, 10))))
_IQ4_HI = tl.constexpr(sum(v << (8 * i) for i, v in enumerate((1, 13, 25, 38, 53, 69, 89, 113))))


@triton.jit
def _mul(a, b):
    """a * b rounded on its own (the references round each product before the add that follows).
    libdevice's mul_rn flushes subnormals (mul.rn.ftz): harmless here, its products (f16 scales
    times small integers) are never subnormal in float32."""
    if _GPU:
        return libdevice.mul_rn(a, b)
    else:
        return a * b


@triton.jit
def silu(g):
    """g * sigmoid(g) in float32 (libdevice's exp on a GPU: expf's accuracy, not the fast exp2)."""
    if _GPU:
        return g / (1.0 + libdevice.exp(-g))
    else:
        return g / (1.0 + tl.exp(-g))


@triton.jit
def _u8(p, m):
    return tl.load(p, mask=m, other=0).to(tl.int32)


@triton.jit
def _f16(p, m):
    lo = tl.load(p, mask=m, other=0).to(tl.uint16)
    hi = tl.load(p + 1, mask=m, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _f32(p, m):
    b0 = tl.load(p, mask=m, other=0).to(tl.uint32)
    b1 = tl.load(p + 1, mask=m, other=0).to(tl.uint32)
    b2 = tl.load(p + 2, mask=m, other=0).to(tl.uint32)
    b3 = tl.load(p + 3, mask=m, other=0).to(tl.uint32)
    return (b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)).to(tl.float32, bitcast=True)


@triton.jit
def _nib(p, j, m):
    """Element j of a 32-value half-byte run: the low nibble of byte j % 16, then the high ones."""
    return (_u8(p + j % 16, m) >> ((j // 16) * 4)) & 15


@triton.jit
def _e2m1x2(n):
    """e2m1 nibble n times 2, as an int: 0, 1, 2, 3, 4, 6, 8, 12, then the same negated."""
    k = n & 7
    mag = tl.where(k < 2, k, (2 + (k & 1)) << tl.maximum((k >> 1) - 1, 0))
    return tl.where(n >= 8, -mag, mag)


@triton.jit
def _iq4(n):
    sh = ((n & 7) * 8).to(tl.int64)
    lo = -((_IQ4_LO >> sh) & 255)
    hi = (_IQ4_HI >> sh) & 255
    return tl.where(n >= 8, hi, lo).to(tl.float32)


@triton.jit
def _e4m3(b):
    """float8_e4m3fn byte b (int32) as float32 (0x7f / 0xff: NaN)."""
    e = (b >> 3) & 15
    mant = b & 7
    normal = (((e + 120) << 23) | (mant << 20)).to(tl.float32, bitcast=True)
    mag = tl.where(e == 0, mant.to(tl.float32) * 0.001953125, normal)
    nan = tl.full(b.shape, 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)
    mag = tl.where((b & 127) == 127, nan, mag)
    return tl.where(b >= 128, mag * -1.0, mag)  # (-x is 0 - x in Triton: +0.0 for a zero)


@triton.jit
def _k4_scale_min(p, g, m):
    """q4_k / q5_k: the 6-bit scale and min of sub-block g (0..7) from the 12 bytes at p."""
    a = _u8(p + g, m)
    b = _u8(p + g + 4, m)
    c = _u8(p + tl.where(g < 4, g, g - 4), m)
    sc = tl.where(g < 4, a & 63, (b & 15) | ((c >> 2) & 48))
    mn = tl.where(g < 4, b & 63, (b >> 4) | ((a >> 2) & 48))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def dequant(ptr, row, col, m, g, FMT: tl.constexpr, QB: tl.constexpr, QBB: tl.constexpr, ROW_BYTES: tl.constexpr):
    p = ptr + row.to(tl.int64) * ROW_BYTES + (col // QB) * QBB
    return dequant_at(p, col % QB, m, g, FMT)


@triton.jit
def dequant_at(p, j, m, g, FMT: tl.constexpr):
    """Values j (index in the block) of the blocks at byte pointers p, m masking p. p and j broadcast:
    with p [R, NB, 1] and j [1, 1, QB] the block-wide fields (f16 scales, exponents) are loaded once
    per block, not once per value."""
    if FMT == 0:  # q8_0
        q = tl.load(p + 2 + j, mask=m, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        v = q * _f16(p, m)
    elif FMT == 1:  # q4_0
        v = _f16(p, m) * (_nib(p + 2, j, m) - 8).to(tl.float32)
    elif FMT == 2:  # q4_1
        v = _mul(_f16(p, m), _nib(p + 4, j, m).to(tl.float32)) + _f16(p + 2, m)
    elif FMT == 3:  # q5_0
        q = _nib(p + 6, j, m) | (((_u8(p + 2 + j // 8, m) >> (j % 8)) & 1) << 4)
        v = _f16(p, m) * (q - 16).to(tl.float32)
    elif FMT == 4:  # q5_1
        q = _nib(p + 8, j, m) | (((_u8(p + 4 + j // 8, m) >> (j % 8)) & 1) << 4)
        v = _mul(_f16(p, m), q.to(tl.float32)) + _f16(p + 2, m)
    elif FMT == 5:  # q2_k: scales[16], qs[64], d, dmin
        sc = _u8(p + j // 16, m)
        dl = _f16(p + 80, m) * (sc & 15).to(tl.float32)
        ml = _mul(_f16(p + 82, m), (sc >> 4).to(tl.float32))
        q = (_u8(p + 16 + (j // 128) * 32 + j % 32, m) >> (((j % 128) // 32) * 2)) & 3
        v = _mul(dl, q.to(tl.float32)) - ml
    elif FMT == 6:  # q3_k: hmask[32], qs[64], scales[12], d
        s = j // 16
        lo = (_u8(p + 96 + s % 8, m) >> ((s // 8) * 4)) & 15
        hi = (_u8(p + 104 + s % 4, m) >> ((s // 4) * 2)) & 3
        dl = _f16(p + 108, m) * ((lo | (hi << 4)) - 32).to(tl.float32)
        ql = (_u8(p + 32 + (j // 128) * 32 + j % 32, m) >> (((j % 128) // 32) * 2)) & 3
        qh = (_u8(p + j % 32, m) >> (j // 32)) & 1
        v = dl * (ql - ((qh ^ 1) << 2)).to(tl.float32)
    elif FMT == 7:  # q4_k: d, dmin, scales[12], qs[128]
        sc, mn = _k4_scale_min(p + 4, j // 32, m)
        q = (_u8(p + 16 + (j // 64) * 32 + j % 32, m) >> (((j % 64) // 32) * 4)) & 15
        v = _mul(_f16(p, m) * sc, q.to(tl.float32)) - _mul(_f16(p + 2, m), mn)
    elif FMT == 8:  # q5_k: d, dmin, scales[12], qh[32], qs[128]
        sc, mn = _k4_scale_min(p + 4, j // 32, m)
        ql = (_u8(p + 48 + (j // 64) * 32 + j % 32, m) >> (((j % 64) // 32) * 4)) & 15
        qh = (_u8(p + 16 + j % 32, m) >> (j // 32)) & 1
        v = _mul(_f16(p, m) * sc, (ql | (qh << 4)).to(tl.float32)) - _mul(_f16(p + 2, m), mn)
    elif FMT == 9:  # q6_k: ql[128], qh[64], scales[16] int8, d
        ql = (_u8(p + (j // 128) * 64 + j % 64, m) >> (((j % 128) // 64) * 4)) & 15
        qh = (_u8(p + 128 + (j // 128) * 32 + j % 32, m) >> (((j % 128) // 32) * 2)) & 3
        sc = tl.load(p + 192 + j // 16, mask=m, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        v = (_f16(p + 208, m) * sc) * ((ql | (qh << 4)) - 32).to(tl.float32)
    elif FMT == 10:  # iq4_nl
        v = _f16(p, m) * _iq4(_nib(p + 2, j, m))
    elif FMT == 11:  # iq4_xs: d, scales_h (u16), scales_l[4], qs[128]
        s = j // 32
        hi = ((_u8(p + 2, m) | (_u8(p + 3, m) << 8)) >> (2 * s)) & 3
        lo = (_u8(p + 4 + s // 2, m) >> ((s % 2) * 4)) & 15
        dl = _f16(p, m) * ((lo | (hi << 4)) - 32).to(tl.float32)
        n = (_u8(p + 8 + s * 16 + j % 16, m) >> (((j % 32) // 16) * 4)) & 15
        v = dl * _iq4(n)
    elif FMT == 12:  # mxfp4: e8m0 exponent, qs[16]; 2^(e-128) as gguf's e8m0_to_fp32_half
        e = _u8(p, m)
        d = tl.where(e < 2, 0x00200000 << e, (e - 1) << 23).to(tl.float32, bitcast=True)
        v = d * _e2m1x2(_nib(p + 1, j, m)).to(tl.float32)
    elif FMT == 13:  # fp8: f32 scale, 128 x e4m3
        v = _e4m3(_u8(p + 4 + j, m)) * _f32(p, m)
    else:  # nvfp4: e4m3 scale, 8 bytes of two e2m1 each (element 2i low nibble of byte i)
        n = (_u8(p + 1 + j // 2, m) >> ((j % 2) * 4)) & 15
        e2m1 = _e2m1x2(n & 7).to(tl.float32) * 0.5
        e2m1 = tl.where(n >= 8, e2m1 * -1.0, e2m1)  # nibble 8 is -0.0
        v = (e2m1 * _e4m3(_u8(p, m))) * g
    return v


@triton.jit
def _dequant_kernel(src, dst, g, N, K: tl.constexpr, FMT: tl.constexpr, QB: tl.constexpr, QBB: tl.constexpr,
                    ROW_BYTES: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BK + tl.arange(0, BK)
    m = (rows < N)[:, None] & (cols < K)[None, :]
    v = dequant(src, rows[:, None], cols[None, :], m, g, FMT, QB, QBB, ROW_BYTES)
    tl.store(dst + rows.to(tl.int64)[:, None] * K + cols[None, :], v, mask=m)


def dequantize(packed: torch.Tensor, fmt: str, k: int, gscale: float = 1.0) -> torch.Tensor:
    """[N, k] float32 values of packed rows [N, row_bytes(fmt, k)] uint8 (module docstring)."""
    f = packed_format(fmt)
    if f.code < 0:
        raise ValueError(f"{fmt} is not a packed format")
    rb = row_bytes(fmt, k, "packed")
    if packed.dtype != torch.uint8 or packed.dim() != 2 or packed.shape[1] != rb:
        raise ValueError(f"packed: expected uint8 [N, {rb}] for {fmt} x {k}, got {packed.dtype} {tuple(packed.shape)}")
    n = packed.shape[0]
    out = torch.empty(n, k, dtype=torch.float32, device=packed.device)
    br, bk = 16, 64
    _dequant_kernel[(triton.cdiv(n, br), triton.cdiv(k, bk))](packed.contiguous(), out, float(gscale), n, K=k,
                                                              FMT=f.code, QB=f.block, QBB=f.block_bytes,
                                                              ROW_BYTES=rb, BR=br, BK=bk)
    return out
