"""Native executor kernels against a float64 reference: every SIMD path this CPU has, every weight
format, random shapes (mostly not multiples of the vector width), batch 1..64, strided banks."""

from __future__ import annotations

import pytest
import torch

from native.formats import dequantize, quantize
from tests.native.conftest import ALL_ISAS, CPU_ISAS, check_close, reference, tolerance

FORMATS = ["bf16", "f32", "fp8", "mxfp4"]


def _problem(gen: torch.Generator, T: int, H: int, inter: int, R: int, k: int, x_dtype: torch.dtype):
    w13 = torch.randn(R, 2 * inter, H, generator=gen) / H**0.5
    w2 = torch.randn(R, H, inter, generator=gen) / inter**0.5
    x = torch.randn(T, H, generator=gen).to(x_dtype)
    ids = torch.stack([torch.randperm(R, generator=gen)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=gen)
    return x, ids, weights, w13, w2


@pytest.mark.parametrize("isa", ALL_ISAS, indirect=True)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("seed", range(6))
def test_random_shapes_match_reference(ft, isa, fmt, seed):
    gen = torch.Generator().manual_seed(1000 + seed + 97 * FORMATS.index(fmt))
    ri = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=gen))  # noqa: E731
    T = [1, 64, ri(2, 63)][seed % 3]
    if fmt == "mxfp4":  # the format needs multiples of 32; odd multiples are not multiples of the 64-byte line
        H, inter = 32 * ri(1, 9), 32 * ri(1, 6)
    else:
        H, inter = (ri(1, 300), ri(1, 200)) if seed % 4 else (16 * ri(1, 12), 16 * ri(1, 8))
    k = ri(1, 8)
    R = k + ri(0, 6)
    block = [(128, 128), (16, 32), (4, 16), (8, 48)][seed % 4]
    x_dtype = torch.bfloat16 if seed % 2 else torch.float32
    out_dtype = torch.float32 if seed % 5 == 0 else x_dtype
    x, ids, weights, w13, w2 = _problem(gen, T, H, inter, R, k, x_dtype)
    ew = quantize(w13, w2, fmt, block)
    out = torch.full((T, H), float("nan"), dtype=out_dtype)
    got = ft.moe_layer(x, ids, weights, ew, out=out)
    assert got is out and got.dtype == out_dtype
    check_close(got, reference(x, ids, weights, *dequantize(ew)), tolerance(isa, fmt, x_dtype, out_dtype))


@pytest.mark.parametrize("isa", ALL_ISAS, indirect=True)
@pytest.mark.parametrize("fmt", FORMATS)
def test_repeated_experts_and_strided_banks(ft, isa, fmt):
    from native.formats import ExpertWeights

    gen = torch.Generator().manual_seed(7)
    T, H, inter, R, k = 9, 96, 64, 5, 4
    x, _, weights, w13, w2 = _problem(gen, T, H, inter, R, k, torch.float32)
    ids = torch.randint(0, R, (T, k), generator=gen)  # duplicates within a token too
    ids[:, 0] = 2  # one expert shared by every token
    wide = torch.randn(T, H + 13, generator=gen)
    wide[:, 5:5 + H] = x
    xs = wide[:, 5:5 + H]  # row stride H + 13
    ew = quantize(w13, w2, fmt, (16, 32))

    def spread(t: torch.Tensor | None, pad: int) -> torch.Tensor | None:
        """The same tensor as a strided view: every other expert of a bank with padded rows."""
        if t is None:
            return None
        big = torch.zeros(2 * t.shape[0], t.shape[1], t.shape[2] + pad, dtype=t.dtype)
        big[::2, :, :t.shape[2]] = t
        return big[::2, :, :t.shape[2]]

    strided = ExpertWeights(fmt, spread(ew.w13, 3), spread(ew.w2, 5), spread(ew.s13, 1), spread(ew.s2, 2), ew.block)
    out_wide = torch.zeros(T, H + 7)
    got = ft.moe_layer(xs, ids, weights, strided, out=out_wide[:, :H])
    check_close(got, reference(x, ids, weights, *dequantize(ew)), tolerance(isa, fmt, torch.float32, torch.float32))
    assert (out_wide[:, H:] == 0).all()


def test_quantizers_are_close_to_the_dense_weights():
    gen = torch.Generator().manual_seed(2)
    w13, w2 = torch.randn(3, 64, 96, generator=gen), torch.randn(3, 96, 32, generator=gen)
    for fmt, tol in (("bf16", 0.005), ("fp8", 0.06), ("mxfp4", 0.2)):
        d13, d2 = dequantize(quantize(w13, w2, fmt, (16, 32)))
        assert ((d13 - w13.double()).norm() / w13.norm()).item() < tol, fmt
        assert ((d2 - w2.double()).norm() / w2.norm()).item() < tol, fmt


def test_fp8_decode_covers_every_code(ft):
    """All 254 finite e4m3 codes (subnormals and both zeros included) through each path."""
    from native.formats import ExpertWeights

    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # NaN codes
    H = codes.numel()  # 254: also a non-multiple of 16
    w13 = codes.repeat(1, 2, 1)  # gate row and up row
    w2 = torch.full((1, H, 1), 0x38, dtype=torch.uint8)  # 1.0
    ew = ExpertWeights("fp8", w13, w2, torch.ones(1, 2, 16), torch.ones(1, 16, 1), (16, 16))
    x = torch.zeros(1, H)
    for isa in CPU_ISAS:
        ft.set_isa(isa)
        got = []
        for j in range(H):  # one-hot x reads one code's value through the gate and up rows
            x.zero_()
            x[0, j] = 1.0
            got.append(ft.moe_layer(x, torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, 1), ew)[0, 0].item())
        v = codes.view(torch.float8_e4m3fn).double()
        want = torch.nn.functional.silu(v) * v
        assert torch.allclose(torch.tensor(got, dtype=torch.float64), want, rtol=1e-6, atol=1e-12), isa
    ft.set_isa("auto")


@pytest.mark.parametrize("isa", ALL_ISAS, indirect=True)
@pytest.mark.parametrize("fmt", ["bf16", "f32"])
def test_split_expert_computes_its_rows_after_first(ft, isa, fmt):
    """`split=(row, first)`: that expert contributes only its intermediate rows [first, I) (the GPU
    runs the rows before); the other experts, shared by the same tokens, are whole."""
    gen = torch.Generator().manual_seed(11)
    T, H, inter, R, k = 3, 80, 64, 6, 3
    x, ids, weights, w13, w2 = _problem(gen, T, H, inter, R, k, torch.float32)
    ids[:, 0] = 4  # every token routes to the split expert
    ew = quantize(w13, w2, fmt, (16, 32))
    d13, d2 = dequantize(ew)
    chunk_before = ft.chunk_rows()
    try:  # work chunks that start before `first` and end after it, or hold all the rows
        for first, chunk in ((16, 16), (48, 16), (16, 64), (48, 40), (16, 8)):
            ft.set_chunk_rows(chunk)
            ft.moe_layer(-3 * x, ids, weights, ew)  # other values in the reused scratch, so rows skipped show
            got = ft.moe_layer(x, ids, weights, ew, split=(4, first))
            cpu_rows = d13.clone(), d2.clone()
            cpu_rows[0][4, :first] = 0  # gate rows before `first`: their h is 0, down ignores them
            cpu_rows[1][4, :, :first] = 0
            check_close(got, reference(x, ids, weights, *cpu_rows), tolerance(isa, fmt, torch.float32, torch.float32))
            whole = reference(x, ids, weights, d13, d2)
            assert (got.double() - whole).abs().max() > 1e-3  # the GPU's rows are missing
    finally:
        ft.set_chunk_rows(chunk_before)
    for bad in (0, 8, inter):  # not inside (0, I), or not a multiple of 16
        with pytest.raises(Exception, match="split expert row"):
            ft.moe_layer(x, ids, weights, ew, split=(4, bad))
    with pytest.raises(Exception, match="bf16 or f32"):
        ft.moe_layer(x, ids, weights, quantize(w13, w2, "fp8", (16, 32)), split=(4, 16))
