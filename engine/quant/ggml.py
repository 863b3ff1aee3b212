"""Torch dequantisation of ggml's block formats (llama.cpp's GGUF quant types) to float32.

Contract: each `dq_<type>(blocks)` takes a uint8 tensor [n, block_bytes] of whole ggml blocks and
returns float32 [n, block_values], bit-identical to `gguf.quants.dequantize` for that type: every
value is formed by the same float32 operations in the same order (scale products first, then the
quant times the scale, then the minimum subtracted or added), so no rounding differs.
Layouts are ggml's (ggml-common.h); /work/wt/QUANT_LAYOUT.md lists the block sizes.
"""

from __future__ import annotations

import torch

QK_K = 256
_NIB = torch.tensor([0, 4], dtype=torch.uint8)
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)  # e2m1, doubled


def f16(b: torch.Tensor) -> torch.Tensor:
    """Two bytes per row (little-endian half) -> float32 [n, 1]."""
    return b.contiguous().view(torch.float16).float()


def _shr(b: torch.Tensor, shifts: tuple[int, ...], dim_shape: tuple[int, ...]) -> torch.Tensor:
    return b >> torch.tensor(shifts, dtype=torch.uint8).reshape(dim_shape)


def _nibbles32(qs: torch.Tensor) -> torch.Tensor:
    """[n, 16] bytes -> [n, 32] nibbles: low nibbles are elements 0..15, high ones 16..31."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def dq_q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].contiguous().view(torch.int8).float() * f16(b[:, :2])


def dq_q4_0(b: torch.Tensor) -> torch.Tensor:
    q = (_nibbles32(b[:, 2:]).to(torch.int8) - 8).float()
    return f16(b[:, :2]) * q


def dq_q4_1(b: torch.Tensor) -> torch.Tensor:
    return f16(b[:, :2]) * _nibbles32(b[:, 4:]).float() + f16(b[:, 2:4])


def _q5(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    bits = torch.arange(8, dtype=torch.uint8)
    high = ((qh[:, :, None] >> bits) & 1).reshape(-1, 32)  # bit j of the little-endian word: element j
    return _nibbles32(qs) | (high << 4)


def dq_q5_0(b: torch.Tensor) -> torch.Tensor:
    q = (_q5(b[:, 2:6], b[:, 6:]).to(torch.int8) - 16).float()
    return f16(b[:, :2]) * q


def dq_q5_1(b: torch.Tensor) -> torch.Tensor:
    return f16(b[:, :2]) * _q5(b[:, 4:8], b[:, 8:]).float() + f16(b[:, 2:4])


def dq_q2_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scales, qs, d, dmin = b[:, :16], b[:, 16:80], f16(b[:, 80:82]), f16(b[:, 82:84])
    dl = (d * (scales & 0xF).float()).reshape(n, 16, 1)
    ml = (dmin * (scales >> 4).float()).reshape(n, 16, 1)
    q = (_shr(qs.reshape(n, 2, 1, 32), (0, 2, 4, 6), (1, 1, 4, 1)) & 3).reshape(n, 16, 16).float()
    return (dl * q - ml).reshape(n, QK_K)


def dq_q3_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    hmask, qs, sc, d = b[:, :32], b[:, 32:96], b[:, 96:108], f16(b[:, 108:110])
    low = _shr(sc[:, :8].reshape(n, 1, 8), (0, 4), (1, 2, 1)).reshape(n, 16) & 0x0F
    high = _shr(sc[:, 8:].reshape(n, 1, 4), (0, 2, 4, 6), (1, 4, 1)).reshape(n, 16) & 0x03
    scales = ((low | (high << 4)).to(torch.int8) - 32).float()
    dl = (d * scales).reshape(n, 16, 1)
    ql = _shr(qs.reshape(n, 2, 1, 32), (0, 2, 4, 6), (1, 1, 4, 1)).reshape(n, 16, 16) & 3
    qh = (_shr(hmask.reshape(n, 1, 1, 32), tuple(range(8)), (1, 1, 8, 1)).reshape(n, 16, 16) & 1) ^ 1
    q = (ql.to(torch.int8) - (qh << 2).to(torch.int8)).float()
    return (dl * q).reshape(n, QK_K)


def _scale_min_k4(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 packed bytes of Q4_K / Q5_K -> eight 6-bit scales and eight 6-bit minimums."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _dk(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n = b.shape[0]
    sc, mn = _scale_min_k4(b[:, 4:16])
    d = (f16(b[:, 0:2]) * sc.float()).reshape(n, 8, 1)
    dm = (f16(b[:, 2:4]) * mn.float()).reshape(n, 8, 1)
    return d, dm


def dq_q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, dm = _dk(b)
    q = (b[:, 16:].reshape(n, 4, 1, 32) >> _NIB.reshape(1, 1, 2, 1) & 0x0F).reshape(n, 8, 32).float()
    return (d * q - dm).reshape(n, QK_K)


def dq_q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, dm = _dk(b)
    ql = (b[:, 48:].reshape(n, 4, 1, 32) >> _NIB.reshape(1, 1, 2, 1) & 0x0F).reshape(n, 8, 32)
    qh = (_shr(b[:, 16:48].reshape(n, 1, 1, 32), tuple(range(8)), (1, 1, 8, 1)) & 1).reshape(n, 8, 32)
    q = (ql | (qh << 4)).float()
    return (d * q - dm).reshape(n, QK_K)


def dq_q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql, qh, sc, d = b[:, :128], b[:, 128:192], b[:, 192:208], f16(b[:, 208:210])
    dl = (d * sc.contiguous().view(torch.int8).float()).reshape(n, 16, 1)
    lo = (ql.reshape(n, 2, 1, 64) >> _NIB.reshape(1, 1, 2, 1) & 0x0F).reshape(n, 8, 32)
    hi = (_shr(qh.reshape(n, 2, 1, 32), (0, 2, 4, 6), (1, 1, 4, 1)) & 3).reshape(n, 8, 32)
    q = ((lo | (hi << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()
    return (dl * q).reshape(n, QK_K)


def _lookup(table: tuple[int, ...], idx: torch.Tensor) -> torch.Tensor:
    return torch.tensor(table, dtype=torch.float32)[idx.long()]


def dq_iq4_nl(b: torch.Tensor) -> torch.Tensor:
    return f16(b[:, :2]) * _lookup(IQ4_VALUES, _nibbles32(b[:, 2:]))


def dq_iq4_xs(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = f16(b[:, :2])
    sh = b[:, 2:4].to(torch.int32)
    sh = sh[:, 0] | (sh[:, 1] << 8)
    high = (sh[:, None] >> torch.arange(0, 16, 2, dtype=torch.int32)) & 3
    low = (b[:, 4:8].reshape(n, 4, 1) >> _NIB.reshape(1, 1, 2)).reshape(n, 8) & 0x0F
    scales = ((low.to(torch.int32) | (high << 4)).to(torch.int8) - 32).float()
    dl = (d * scales).reshape(n, 8, 1)
    q = (b[:, 8:].reshape(n, 8, 1, 16) >> _NIB.reshape(1, 1, 2, 1) & 0x0F).reshape(n, 8, 32)
    return (dl * _lookup(IQ4_VALUES, q)).reshape(n, QK_K)


def e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """ggml's e8m0 -> float32 halved: 2^(e - 128), exact for every byte (e < 2 as subnormals)."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    return bits.view(torch.float32)


def dq_mxfp4(b: torch.Tensor) -> torch.Tensor:
    return e8m0_half(b[:, :1]) * _lookup(MXFP4_VALUES, _nibbles32(b[:, 1:]))
