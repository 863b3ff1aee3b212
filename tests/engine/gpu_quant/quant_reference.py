"""Independent references for the packed GPU kernels' tests: random valid packed rows per format,
their values through gguf.quants (GGUF types) or a float64 definition written out here (fp8, nvfp4),
and a float64 MoE over dequantized experts."""

from __future__ import annotations

import numpy as np
import torch

from engine.gpu.quant.formats import packed_format, row_bytes

GGUF = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_nl", "iq4_xs", "mxfp4")
ALL = (*GGUF, "fp8", "nvfp4")
# byte offsets of each block's f16 scale fields (random bytes elsewhere are valid)
_F16_FIELDS = {"q8_0": (0,), "q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2), "q2_k": (80, 82),
               "q3_k": (108,), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,), "iq4_nl": (0,), "iq4_xs": (0,)}
_E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float64)


def random_rows(fmt: str, n: int, k: int, rng: np.random.Generator, spread: float = 1 / 16) -> np.ndarray:
    """[n, row_bytes] uint8 of random valid blocks: random bytes, finite f16 / f32 scales."""
    f = packed_format(fmt)
    blocks = rng.integers(0, 256, size=(n * (k // f.block), f.block_bytes), dtype=np.uint8)
    for off in _F16_FIELDS.get(fmt, ()):
        blocks[:, off:off + 2] = (rng.uniform(-1, 1, len(blocks)) * spread).astype(np.float16).view(np.uint8).reshape(-1, 2)
    if fmt == "fp8":
        q = blocks[:, 4:]
        q[(q & 127) == 127] ^= 1  # no NaN (the dequant test adds them on purpose)
        blocks[:, :4] = (rng.uniform(0.5, 2, len(blocks)) * spread / 8).astype(np.float32).view(np.uint8).reshape(-1, 4)
    if fmt == "mxfp4":  # exponents near 2^0 here (the dequant test widens them to every byte)
        blocks[:, 0] = rng.integers(118, 128, len(blocks))
    if fmt == "nvfp4":  # e4m3 scales of about 1/64 .. 1
        blocks[:, 0] = rng.integers(0x18, 0x38, len(blocks))
    return blocks.reshape(n, row_bytes(fmt, k))


def _e4m3(b: np.ndarray) -> np.ndarray:
    return torch.from_numpy(b.astype(np.uint8)).view(torch.float8_e4m3fn).to(torch.float64).numpy()


def reference_dequant(rows: np.ndarray, fmt: str, k: int, gscale: float = 1.0) -> np.ndarray:
    """[n, k] float32: gguf.quants for the GGUF types, the layout's float64 definition otherwise."""
    from gguf import GGMLQuantizationType, quants

    n = rows.shape[0]
    f = packed_format(fmt)
    if fmt in GGUF:
        return quants.dequantize(rows, GGMLQuantizationType[fmt.upper()]).reshape(n, k).astype(np.float32)
    blocks = rows.reshape(-1, f.block_bytes)
    if fmt == "fp8":
        scale = blocks[:, :4].copy().view(np.float32).astype(np.float64)
        return (_e4m3(blocks[:, 4:]) * scale).astype(np.float32).reshape(n, k)
    assert fmt == "nvfp4"
    q = blocks[:, 1:]
    nib = np.stack([q & 15, q >> 4], axis=-1).reshape(len(blocks), 16)
    return (_E2M1[nib] * _e4m3(blocks[:, :1]) * np.float64(np.float32(gscale))).astype(np.float32).reshape(n, k)


def reference_moe(x: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor, gu: list[np.ndarray],
                  d: list[np.ndarray]) -> torch.Tensor:
    """[n * k, H] float64: entry e's weight * down(silu(gate x) * up x) with slot s's dense float64
    weights gu[s] [2I, H] and d[s] [H, I], zeros for entries without a slot."""
    n, k = slot_ids.shape
    rows = torch.zeros(n * k, x.shape[1], dtype=torch.float64)
    dense: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for e in range(n * k):
        s = int(slot_ids.view(-1)[e])
        if s < 0:
            continue
        if s not in dense:
            dense[s] = torch.from_numpy(gu[s]).double(), torch.from_numpy(d[s]).double()
        w13, w2 = dense[s]
        inter = w2.shape[1]
        xt = x[e // k].double()
        g, u = w13[:inter] @ xt, w13[inter:] @ xt
        rows[e] = (w2 @ (torch.nn.functional.silu(g) * u)) * float(weights.view(-1)[e])
    return rows
