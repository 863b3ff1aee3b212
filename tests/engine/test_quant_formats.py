"""Each packed format's reference dequantisation (engine/quant/) is bit-exact against an independent one:
- every GGUF type against gguf.quants.dequantize, on data quantized by gguf.quants.quantize where the
  package can quantize that type and on random valid blocks (random bytes, finite half scales) for all;
- HF block-scaled FP8 against transformers' own fp8 dequantisation, gpt-oss MXFP4 against
  transformers' `convert_moe_packed_tensors`, both after the lossless conversion to our blocks;
- NVFP4 against the ModelOpt definition written out in float64 (e2m1 x e4m3 block scale x global scale);
- block sizes agree with gguf's table; a wrong row size, an unknown format and a bad HF shape are errors.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.errors import ConfigError
from engine.quant.formats import FORMATS, GGML_FORMATS, format_of
from engine.quant.hf import fp8_rows, mxfp4_rows, nvfp4_rows

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType
# byte offsets of the half-precision scale fields in each ggml block
HALVES = {"q8_0": (0,), "q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2), "q2_k": (80, 82),
          "q3_k": (108,), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,), "iq4_nl": (0,), "iq4_xs": (0,),
          "mxfp4": ()}
QUANTIZABLE = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "mxfp4")


def _same_bits(got: torch.Tensor, want: np.ndarray) -> None:
    assert got.dtype == torch.float32 and tuple(got.shape) == want.shape
    np.testing.assert_array_equal(got.numpy().view(np.uint32), want.astype(np.float32).view(np.uint32))


def _random_blocks(name: str, rows: int, blocks: int, rng: np.random.Generator) -> np.ndarray:
    f = FORMATS[name]
    raw = rng.integers(0, 256, size=(rows, blocks, f.block_bytes), dtype=np.uint8)
    for off in HALVES[name]:
        halves = rng.uniform(-0.05, 0.05, size=(rows, blocks)).astype(np.float16)
        raw[:, :, off:off + 2] = halves.view(np.uint8).reshape(rows, blocks, 2)
    return raw.reshape(rows, blocks * f.block_bytes)


def test_every_ggml_type_is_registered_with_gguf_sizes() -> None:
    assert set(GGML_FORMATS) == {n.upper() for n in HALVES}
    for gname, name in GGML_FORMATS.items():
        f = FORMATS[name]
        assert gguf.GGML_QUANT_SIZES[T[gname]] == (f.block, f.block_bytes), name


@pytest.mark.parametrize("name", sorted(HALVES))
def test_ggml_random_blocks_bit_exact(name: str) -> None:
    f = FORMATS[name]
    rng = np.random.default_rng(hash(name) % 2**32)
    raw = _random_blocks(name, 6, 3, rng)
    want = gguf.quants.dequantize(raw, T[name.upper()])
    _same_bits(f.dequantize(torch.from_numpy(raw), 3 * f.block), want)


@pytest.mark.parametrize("name", QUANTIZABLE)
def test_ggml_quantized_data_bit_exact(name: str) -> None:
    f = FORMATS[name]
    data = np.random.default_rng(7).standard_normal((5, 4 * f.block)).astype(np.float32) * 0.1
    raw = gguf.quants.quantize(data, T[name.upper()])
    want = gguf.quants.dequantize(raw, T[name.upper()])
    got = f.dequantize(torch.from_numpy(raw), 4 * f.block)
    _same_bits(got, want)
    assert np.abs(got.numpy() - data).max() < 0.1  # the data survives the round trip roughly


def test_mxfp4_small_exponents_as_ggml() -> None:
    raw = np.zeros((4, 17), dtype=np.uint8)
    raw[:, 0] = [0, 1, 2, 254]
    raw[:, 1:] = np.random.default_rng(1).integers(0, 256, size=(4, 16), dtype=np.uint8)
    _same_bits(FORMATS["mxfp4"].dequantize(torch.from_numpy(raw.reshape(1, -1)), 128),
               gguf.quants.dequantize(raw.reshape(1, -1), T.MXFP4))


def _random_e4m3(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    b = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
    b[(b & 0x7F) == 0x7F] = 0x38  # no NaN encodings (1.0 instead)
    return b.view(torch.float8_e4m3fn)


def test_hf_fp8_against_transformers() -> None:
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    gen = torch.Generator().manual_seed(3)
    n, k = 200, 384  # rows not a multiple of the 128-row scale block
    w = _random_e4m3((n, k), gen)
    scale_inv = torch.rand(2, 3, generator=gen) * 0.01
    want = _dequantize_fp8_weight(w, scale_inv, [128, 128], torch.float32)
    got = FORMATS["fp8"].dequantize(fp8_rows(w, scale_inv), k)
    _same_bits(got, want.numpy())


def test_gpt_oss_mxfp4_against_transformers() -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(5)
    e, n, g = 2, 6, 3
    blocks = torch.randint(0, 256, (e, n, g, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(110, 140, (e, n, g), dtype=torch.uint8, generator=gen)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, K, N]
    got = FORMATS["mxfp4"].dequantize(mxfp4_rows(blocks, scales), g * 32)  # [E, N, K]
    # equal values; the one difference in bits is ggml's +0 where transformers' table has -0 (nibble 8)
    np.testing.assert_array_equal(got.numpy(), want.transpose(1, 2).contiguous().numpy())
    assert int((got == 0).sum()) > 0


def test_nvfp4_against_float64_definition() -> None:
    gen = torch.Generator().manual_seed(9)
    n, k = 5, 64
    weight = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    scale = (_random_e4m3((n, k // 16), gen).view(torch.uint8) & 0x7F).view(torch.float8_e4m3fn)  # positive, as ModelOpt
    g2 = 0.0123
    e2m1 = [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    want = np.zeros((n, k))
    w = weight.numpy()
    s = scale.to(torch.float64).numpy()
    for r in range(n):
        for c in range(k):
            nib = (int(w[r, c // 2]) >> (4 * (c % 2))) & 0xF
            v = e2m1[nib & 7] * (-1 if nib & 8 else 1)
            want[r, c] = v * s[r, c // 16] * np.float64(np.float32(g2))
    got = FORMATS["nvfp4"].dequantize(nvfp4_rows(weight, scale), k, gscale=torch.tensor(g2))
    np.testing.assert_array_equal(got.numpy(), want.astype(np.float32))  # exact values (zeros of either sign)


def test_bad_input_is_named() -> None:
    f = format_of("q4_k")
    with pytest.raises(ConfigError, match="q4_k"):
        f.dequantize(torch.zeros(1, 143, dtype=torch.uint8), 256)
    with pytest.raises(ConfigError, match=r"blk\.0\.ffn_up_exps\.weight.*multiple"):
        f.row_bytes(300, "blk.0.ffn_up_exps.weight")
    with pytest.raises(ConfigError, match="unknown expert format 'q9_9'"):
        format_of("q9_9")
    with pytest.raises(ConfigError, match=r"experts\.down"):
        nvfp4_rows(torch.zeros(2, 8, dtype=torch.uint8), torch.zeros(2, 3, dtype=torch.uint8), what="experts.down")
    with pytest.raises(ConfigError, match="weight_scale_inv"):
        fp8_rows(torch.zeros(4, 128, dtype=torch.uint8), torch.ones(2, 1))


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_random_rows_are_valid_and_finite(name: str) -> None:
    f = FORMATS[name]
    k = 2 * max(f.block, 32)
    rows = f.random_rows((3, 2), k, torch.Generator().manual_seed(0))
    assert rows.shape == (3, 2, f.row_bytes(k)) and rows.dtype == torch.uint8
    vals = f.dequantize(rows, k)
    assert bool(torch.isfinite(vals).all()) and float(vals.abs().max()) > 0
    if name.upper() in GGML_FORMATS:  # gguf reads the same values from them
        want = gguf.quants.dequantize(rows.reshape(6, -1).numpy(), T[name.upper()])
        _same_bits(vals.reshape(6, -1), want)
