"""gpt-oss's routed experts into the host expert banks, from bf16 or MXFP4 checkpoints.

Contract: `gpt_oss_experts(fetch, cfg, prefix, banks, moe_index)` fills layer `moe_index`'s rows of
`banks.w13` / `w2` / `b13` / `b2` from `{prefix}gate_up_proj` [E, H, 2I] (gate and up interleaved by
column: gate = [..., 0::2], up = [..., 1::2]), `{prefix}down_proj` [E, I, H] and their `_bias`
tensors; or, for MXFP4 checkpoints, from `{prefix}gate_up_proj_blocks` [E, 2I, H/32, 16] uint8 and
`_scales` [E, 2I, H/32] uint8 (and the same for down_proj, [E, H, I/32, ...]), dequantized at load
to the banks' dtype (`dequantize_mxfp4`). The banks hold gate rows then up rows, [out, in].

`dequantize_mxfp4(blocks, scales)`: each byte holds two E2M1 values (low nibble first), each block
of 32 values shares the scale 2^(scale - 127); returns float32 [..., rows, blocks * 32]. Every
value is exact in float32 and bfloat16 (at most two significant bits times a power of two).
"""

from __future__ import annotations

from typing import Any

import torch

from engine.config import ModelConfig
from engine.weights.layout import ExpertBanks

# E2M1: sign bit, two exponent bits, one mantissa bit.
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} do not match scales {list(scales.shape)}")
    table = torch.tensor(FP4_E2M1, dtype=torch.float32)
    b = blocks.to(torch.uint8)
    values = torch.stack([table[(b & 0x0F).long()], table[(b >> 4).long()]], dim=-1)  # [..., G, 16, 2]
    exponent = (scales.to(torch.int32) - 127)[..., None]
    return torch.ldexp(values.flatten(-2), exponent).flatten(-2)  # [..., G * 32]


def _out_in(fetch: Any, name: str, e: int, out: int, inp: int) -> torch.Tensor:
    """[E, out, in] float32 of a projection stored as bf16 [E, in, out] or MXFP4 blocks/scales."""
    if fetch.reader.has(name + "_blocks"):
        blocks = fetch.raw(name + "_blocks", (e, out, inp // 32, 16))
        scales = fetch.raw(name + "_scales", (e, out, inp // 32))
        return dequantize_mxfp4(blocks, scales)
    return fetch.raw(name, (e, inp, out)).float().transpose(1, 2)


def gpt_oss_experts(fetch: Any, cfg: ModelConfig, prefix: str, banks: ExpertBanks, moe_index: int) -> None:
    h, e, i = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    rows = slice(moe_index * e, (moe_index + 1) * e)
    dtype = banks.w13.dtype
    gate_up = _out_in(fetch, prefix + "gate_up_proj", e, 2 * i, h)  # [E, 2I, H], rows interleaved
    banks.w13[rows, :i] = gate_up[:, 0::2].to(dtype)
    banks.w13[rows, i:] = gate_up[:, 1::2].to(dtype)
    banks.w2[rows] = _out_in(fetch, prefix + "down_proj", e, h, i).to(dtype)
    assert banks.b13 is not None and banks.b2 is not None
    bias = fetch.raw(prefix + "gate_up_proj_bias", (e, 2 * i))
    banks.b13[rows, :i] = bias[:, 0::2].to(dtype)
    banks.b13[rows, i:] = bias[:, 1::2].to(dtype)
    banks.b2[rows] = fetch.raw(prefix + "down_proj_bias", (e, h)).to(dtype)
