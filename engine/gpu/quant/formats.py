"""Packed expert formats as the GPU kernels see them (the table of /work/wt/QUANT_LAYOUT.md, binding):
a matrix W [N, K] is N rows of K / B blocks of `block_bytes` bytes each.

Contract:
- `FORMATS[name] -> PackedFormat(code, block, block_bytes, has_global)`: `code` is the constexpr the
  Triton kernels branch on, `block` the values per block (B), `block_bytes` its size, `has_global`
  whether values carry the matrix's global f32 scale (nvfp4's ModelOpt weight_scale_2).
- `packed_format(name)` the entry, or ValueError naming the format and the known ones.
- `row_bytes(fmt, k)`: bytes of one row of K values; ValueError when K is not a multiple of B.
- `slot_bytes(fmt_gu, fmt_d, hidden, inter)`: bytes of one expert's GPU slot (gate_up [2I, H] rows
  in fmt_gu, then down [H, I] rows in fmt_d): what a miss copies and what the cache budget divides
  by, so a 4-bit slot costs about a quarter of a bf16 one. "bf16" is the unpacked path (2 bytes a value).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PackedFormat:
    code: int  # the kernels' constexpr FMT
    block: int  # values per block (B)
    block_bytes: int
    has_global: bool = False  # value also times the matrix's global f32 scale (gscale)


FORMATS: dict[str, PackedFormat] = {
    "q8_0": PackedFormat(0, 32, 34),
    "q4_0": PackedFormat(1, 32, 18),
    "q4_1": PackedFormat(2, 32, 20),
    "q5_0": PackedFormat(3, 32, 22),
    "q5_1": PackedFormat(4, 32, 24),
    "q2_k": PackedFormat(5, 256, 84),
    "q3_k": PackedFormat(6, 256, 110),
    "q4_k": PackedFormat(7, 256, 144),
    "q5_k": PackedFormat(8, 256, 176),
    "q6_k": PackedFormat(9, 256, 210),
    "iq4_nl": PackedFormat(10, 32, 18),
    "iq4_xs": PackedFormat(11, 256, 136),
    "mxfp4": PackedFormat(12, 32, 17),
    "fp8": PackedFormat(13, 128, 132),
    "nvfp4": PackedFormat(14, 16, 9, has_global=True),
    "bf16": PackedFormat(-1, 1, 2),
}


def packed_format(name: str) -> PackedFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown packed format {name!r}; known: {', '.join(FORMATS)}") from None


def row_bytes(fmt: str, k: int, tensor: str = "matrix") -> int:
    f = packed_format(fmt)
    if k % f.block:
        raise ValueError(f"{tensor}: {k} columns are not a multiple of {fmt}'s block of {f.block}")
    return k // f.block * f.block_bytes


def slot_bytes(fmt_gu: str, fmt_d: str, hidden: int, inter: int) -> int:
    return 2 * inter * row_bytes(fmt_gu, hidden, "gate_up") + hidden * row_bytes(fmt_d, inter, "down")
