"""Per-format in-register dequantisation of packed rows (engine/gpu/quant/dequant.py) is bit-exact in
float32 against an independent reference: gguf.quants.dequantize for every GGUF type, the layout's
float64 definition for fp8 (e4m3 * f32 scale) and nvfp4 (e2m1 * e4m3 * global scale), on random
valid blocks (every exponent byte for mxfp4, every e4m3 byte, NaN included, for fp8 and nvfp4), in
tiles that cut through blocks and rows. On a CPU through Triton's interpreter; on CUDA directly."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from quant_reference import ALL, random_rows, reference_dequant
from triton_interpreter import run_in_interpreter

from engine.gpu.quant.formats import packed_format


def _same_bits(got: np.ndarray, want: np.ndarray) -> bool:
    nan = np.isnan(want)
    return bool(np.array_equal(np.isnan(got), nan) and np.array_equal(got.view(np.uint32)[~nan],
                                                                       want.view(np.uint32)[~nan]))


def check(device: str, rows: int = 3, blocks: int = 3) -> int:
    from engine.gpu.quant.dequant import dequantize

    rng = np.random.default_rng(5)
    for fmt in ALL:
        b = packed_format(fmt).block
        k = b * (blocks if b <= 32 else max(1, blocks - 1))
        packed = random_rows(fmt, rows, k, rng)
        flat = packed.reshape(-1, packed_format(fmt).block_bytes)
        if fmt == "mxfp4":
            flat[:, 0] = rng.integers(0, 256, len(flat))
        if fmt in ("fp8", "nvfp4"):  # every e4m3 byte, the two NaNs and both zeros among them
            col = slice(4, None) if fmt == "fp8" else slice(0, 1)
            flat[: min(len(flat), 2), col] = rng.permutation(256).astype(np.uint8)[: flat[:2, col].size].reshape(-1, flat[:2, col].shape[1])
            flat[-1, col] = np.array([0x7F, 0xFF, 0x00, 0x80] * 64, dtype=np.uint8)[: flat[-1, col].size]
        g = 0.7431 if fmt == "nvfp4" else 1.0
        got = dequantize(torch.from_numpy(packed).to(device), fmt, k, g).cpu().numpy()
        want = reference_dequant(packed, fmt, k, g)
        assert _same_bits(got, want), (fmt, np.argwhere(got.view(np.uint32) != want.view(np.uint32))[:5])
    return len(ALL)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_dequant_bit_exact_cuda() -> None:
    assert check("cuda", rows=64, blocks=9) == 15


def test_dequant_bit_exact_in_triton_interpreter() -> None:
    run_in_interpreter(__file__)


def test_bad_input() -> None:
    from engine.gpu.quant.formats import row_bytes, slot_bytes

    with pytest.raises(ValueError, match="q4_k"):
        row_bytes("q4_k", 100)
    with pytest.raises(ValueError, match="unknown packed format 'q9'"):
        row_bytes("q9", 256)
    # a 4-bit slot is about a quarter of a bf16 one (Qwen3-30B-A3B's expert: H 2048, I 768)
    bf16 = slot_bytes("bf16", "bf16", 2048, 768)
    assert bf16 == 3 * 2048 * 768 * 2
    assert slot_bytes("q4_k", "q6_k", 2048, 768) == 2 * 768 * 8 * 144 + 2048 * 3 * 210
    assert slot_bytes("mxfp4", "mxfp4", 2048, 768) * 4 <= bf16 * 17 / 16


if __name__ == "__main__":  # the interpreter test's child
    assert check("cpu") == 15
    print("ok")
