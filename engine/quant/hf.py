"""Hugging Face quantized checkpoints' weight layouts -> the packed blocks of engine/quant/formats.py.

Contract (lossless byte rearrangements, no value is recomputed except fp8's scale, copied as f32):
- `fp8_rows(weight, scale_inv, block)`: block-scaled FP8 (`quant_method: fp8`: weight e4m3 [N, K],
  `weight_scale_inv` [ceil(N/b0), ceil(K/b1)], block [b0, b1] with b1 = 128) -> fp8 rows [N, K/128*132]
  (row r, block j carries scale_inv[r // b0, j]);
- `mxfp4_rows(blocks, scales)`: gpt-oss MXFP4 (`*_blocks` [..., N, K/32, 16], element 2i in the low
  nibble of byte i; `*_scales` [..., N, K/32] e8m0) -> mxfp4 rows [..., N, K/32*17] (ggml's nibble order,
  the exponent byte kept: e2m1 * 2^(s-127) == 2*e2m1 * 2^(s-128));
- `nvfp4_rows(weight, weight_scale)`: ModelOpt NVFP4 (weight uint8 [N, K/2], weight_scale e4m3
  [N, K/16]) -> nvfp4 rows [N, K/16*9]; the per-tensor `weight_scale_2` is the bank's global scale.
A shape that does not fit raises `ConfigError` naming `what` (the tensor).
"""

from __future__ import annotations

import torch

from engine.errors import ConfigError


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.element_size() == 1 else t


def fp8_rows(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128),
             what: str = "fp8 weight") -> torch.Tensor:
    n, k = weight.shape
    b0, b1 = block
    if b1 != 128 or k % 128 or weight.element_size() != 1:
        raise ConfigError(f"{what}: fp8 weight [{n}, {k}] {weight.dtype} with block {list(block)} "
                          "(supported: 1-byte e4m3, column block 128, columns a multiple of 128)")
    if tuple(scale_inv.shape) != (-(-n // b0), k // 128):
        raise ConfigError(f"{what}: weight_scale_inv is {list(scale_inv.shape)}, expected {[-(-n // b0), k // 128]}")
    scales = scale_inv.float().repeat_interleave(b0, dim=0)[:n].contiguous()  # [N, K/128]
    out = torch.empty(n, k // 128, 132, dtype=torch.uint8)
    out[:, :, :4] = scales.view(torch.uint8).reshape(n, k // 128, 4)
    out[:, :, 4:] = _bytes(weight).reshape(n, k // 128, 128)
    return out.reshape(n, -1)


def mxfp4_rows(blocks: torch.Tensor, scales: torch.Tensor, what: str = "mxfp4 weight") -> torch.Tensor:
    if blocks.dtype != torch.uint8 or blocks.shape[-1] != 16 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ConfigError(f"{what}: _blocks {list(blocks.shape)} {blocks.dtype} and _scales {list(scales.shape)} "
                          "do not form MXFP4 blocks ([..., G, 16] uint8 and [..., G])")
    nib = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).reshape(*blocks.shape[:-1], 32)  # element order
    qs = nib[..., :16] | (nib[..., 16:] << 4)
    out = torch.cat([_bytes(scales).unsqueeze(-1), qs], dim=-1)  # [..., G, 17]
    return out.reshape(*blocks.shape[:-2], -1)


def nvfp4_rows(weight: torch.Tensor, weight_scale: torch.Tensor, what: str = "nvfp4 weight") -> torch.Tensor:
    n, half = weight.shape
    if weight.dtype != torch.uint8 or half % 8 or tuple(weight_scale.shape) != (n, half // 8):
        raise ConfigError(f"{what}: weight {list(weight.shape)} {weight.dtype} and weight_scale "
                          f"{list(weight_scale.shape)} are not ModelOpt NVFP4 ([N, K/2] uint8, [N, K/16])")
    g = half // 8
    out = torch.empty(n, g, 9, dtype=torch.uint8)
    out[:, :, 0] = _bytes(weight_scale)
    out[:, :, 1:] = weight.reshape(n, g, 8)
    return out.reshape(n, -1)
