"""Packed-bank MoE layer (native/packed.py) against float64 references, every format and every SIMD
path this CPU has. GGUF types are dequantized by gguf.quants (an independent implementation);
fp8 and nvfp4 by the float64 definitions written out here (QUANT_LAYOUT.md). The tolerance is
float32 rounding, so a wrong nibble order, high bit or scale cannot pass."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from tests.native.conftest import ALL_ISAS, CPU_ISAS

FORMATS = ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_nl", "iq4_xs",
           "mxfp4", "fp8", "nvfp4"]
GGUF_QUANTIZE = {"q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "mxfp4"}  # types gguf.quants can also quantize
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float64)
TOL = 4e-6  # of the reference's largest magnitude: float32 accumulation (seen: below 1e-6)


@pytest.fixture(scope="module")
def pk(ft):
    from native import packed as module

    return module


def e4m3(b: np.ndarray) -> np.ndarray:
    """float8_e4m3fn bytes -> float64 (0x7f / 0xff NaN)."""
    b = b.astype(np.int64)
    e, m = (b >> 3) & 15, (b & 7).astype(np.float64)
    v = np.where(e == 0, m / 8 * 2.0**-6, (1 + m / 8) * 2.0 ** (e - 7))
    v = np.where((b & 0x7F) == 0x7F, np.nan, v)
    return np.where(b & 0x80, -v, v)


def ref_dequant(fmt: str, rows: np.ndarray, k: int) -> np.ndarray:
    """Packed rows [n, row_bytes] -> float64 [n, k], independently of the kernel."""
    n = rows.shape[0]
    if fmt == "fp8":
        blk = rows.reshape(n, k // 128, 132)
        scale = blk[..., :4].copy().view(np.float32).astype(np.float64)
        return (e4m3(blk[..., 4:]) * scale).reshape(n, k)
    if fmt == "nvfp4":
        blk = rows.reshape(n, k // 16, 9)
        codes = np.stack([blk[..., 1:] & 15, blk[..., 1:] >> 4], axis=-1).reshape(n, k // 16, 16)
        return (E2M1[codes] * e4m3(blk[..., :1])).reshape(n, k)
    return gguf.quants.dequantize(rows, gguf.GGMLQuantizationType[fmt.upper()]).astype(np.float64).reshape(n, k)


def make_bank(pk, fmt: str, experts: int, rows: int, k: int, gen: torch.Generator) -> torch.Tensor:
    if fmt in GGUF_QUANTIZE:
        data = torch.randn(experts * rows, k, generator=gen).numpy() * 0.1
        q = gguf.quants.quantize(data, gguf.GGMLQuantizationType[fmt.upper()])
        return torch.from_numpy(np.ascontiguousarray(q)).view(experts, rows, -1)
    return pk.random_blocks(fmt, (experts, rows), k, gen)


def activate64(g: np.ndarray, u: np.ndarray, activation: str, alpha: float, limit: float) -> np.ndarray:
    """The experts' activation in float64: silu(g) * u, or gpt-oss's clamped SwiGLU."""
    if activation == "silu":
        return g / (1 + np.exp(-g)) * u
    g, u = np.minimum(g, limit), np.clip(u, -limit, limit)
    return (u + 1) * g / (1 + np.exp(-alpha * g))


def reference(x, ids, weights, gu, fmt_gu, dn, fmt_d, gscale, out0, bias_gu=None, bias_d=None, activation="silu",
              alpha=1.702, limit=7.0) -> np.ndarray:
    experts, inter2, _ = gu.shape
    hidden, inter = x.shape[1], inter2 // 2
    wgu = ref_dequant(fmt_gu, gu.reshape(experts * inter2, -1).numpy(), hidden).reshape(experts, inter2, hidden)
    wd = ref_dequant(fmt_d, dn.reshape(experts * hidden, -1).numpy(), inter).reshape(experts, hidden, inter)
    gs = np.ones((experts, 3)) if gscale is None else gscale.double().numpy()
    xd, y = x.double().numpy(), out0.double().numpy().copy()
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e < 0:
                continue
            g = gs[e, 0] * (wgu[e, :inter] @ xd[t])
            u = gs[e, 1] * (wgu[e, inter:] @ xd[t])
            if bias_gu is not None:
                g, u = g + bias_gu[e, :inter].double().numpy(), u + bias_gu[e, inter:].double().numpy()
            h = activate64(g, u, activation, alpha, limit)
            yd = gs[e, 2] * (wd[e] @ h) + (0 if bias_d is None else bias_d[e].double().numpy())
            y[t] += float(weights[t, j]) * yd
    return y


def run_case(pk, gen, fmt_gu, fmt_d, T, k, hidden=256, inter=256, experts=5, x_dtype=torch.float32, gscale=True,
             corrupt=None, clamped=False):
    gu = make_bank(pk, fmt_gu, experts, 2 * inter, hidden, gen)
    dn = make_bank(pk, fmt_d, experts, hidden, inter, gen)
    # gate and up values of order 1, so silu neither saturates nor hides the gate rows' errors
    w_rms = float(np.sqrt(np.mean(ref_dequant(fmt_gu, gu[0].numpy(), hidden) ** 2)))
    x = (torch.randn(T, hidden, generator=gen) / (w_rms * hidden**0.5)).to(x_dtype)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(T)]).to(torch.int32)
    ids[torch.rand(T, k, generator=gen) < 0.25] = -1  # skipped entries
    weights = torch.rand(T, k, generator=gen)
    gs = torch.rand(experts, 3, generator=gen) + 0.5 if gscale else None
    out0 = torch.randn(T, hidden, generator=gen)
    out = out0.clone()
    epilogue: dict[str, object] = {}
    if clamped:  # gpt-oss: biases, and gate / up of order 10 so that both clamps bite (limit 2.5 here)
        x = (x.float() * 10).to(x_dtype)
        epilogue = dict(bias_gu=torch.randn(experts, 2 * inter, generator=gen) * 2,
                        bias_d=torch.randn(experts, hidden, generator=gen), activation="swiglu_clamped", alpha=1.5,
                        limit=2.5)
    pk.moe_packed(x, ids, weights, corrupt(gu) if corrupt else gu, fmt_gu, dn, fmt_d, gs, out, **epilogue)
    ref = reference(x, ids, weights, gu, fmt_gu, dn, fmt_d, gs, out0, **epilogue)
    err = np.abs(out.double().numpy() - ref).max()
    scale = np.abs(ref - out0.double().numpy()).max() + 1e-30
    assert err <= TOL * scale, f"{fmt_gu}/{fmt_d} T={T} k={k}: max abs err {err:.3g} > {TOL:g} * {scale:.3g}"
    if clamped:  # the clamps bite: without them the result is another one
        free = reference(x, ids, weights, gu, fmt_gu, dn, fmt_d, gs, out0, **{**epilogue, "limit": 1e30})
        assert np.abs(free - ref).max() > 0.01 * scale


@pytest.mark.parametrize("isa", ALL_ISAS, indirect=True)
@pytest.mark.parametrize("fmt", FORMATS)
def test_format_matches_float64_reference(pk, isa, fmt):
    gen = torch.Generator().manual_seed(FORMATS.index(fmt))
    for T, k in ((1, 4), (3, 2), (8, 3)):
        run_case(pk, gen, fmt, fmt, T, k)


@pytest.mark.parametrize("isa", ALL_ISAS, indirect=True)
def test_mixed_formats_bf16_activations(pk, isa):
    """A Q4_K_M-like layer: q4_k gate/up, q6_k down, bf16 x, more tokens than a tile, repeated experts."""
    gen = torch.Generator().manual_seed(99)
    run_case(pk, gen, "q4_k", "q6_k", 11, 4, hidden=512, experts=4, x_dtype=torch.bfloat16, gscale=False)
    run_case(pk, gen, "q8_0", "nvfp4", 5, 2, hidden=96, inter=64, experts=3)


@pytest.mark.parametrize("isa", ALL_ISAS, indirect=True)
@pytest.mark.parametrize("fmts", [("mxfp4", "mxfp4"), ("q4_k", "q8_0")])
def test_biases_and_clamped_swiglu_match_float64(pk, isa, fmts):
    """gpt-oss's epilogue: gate / up / down biases and the clamped SwiGLU, on every SIMD path,
    bf16 and f32 activations, tiles of several tokens and single tokens."""
    gen = torch.Generator().manual_seed(17)
    for (T, k), dtype in zip(((1, 4), (9, 3), (4, 2)), (torch.float32, torch.bfloat16, torch.float32), strict=True):
        run_case(pk, gen, *fmts, T, k, x_dtype=dtype, clamped=True)


def test_clamped_check_sees_a_missing_bias_or_clamp(pk):
    """The epilogue check fails where the kernel's epilogue differs: the reference without the down
    bias, or with silu in place of the clamped SwiGLU."""
    gen = torch.Generator().manual_seed(21)
    E, H, inter = 3, 64, 32
    gu, dn = make_bank(pk, "mxfp4", E, 2 * inter, H, gen), make_bank(pk, "mxfp4", E, H, inter, gen)
    x, ids, w = torch.randn(2, H, generator=gen) * 5, torch.tensor([[0, 2], [1, 0]], dtype=torch.int32), torch.ones(2, 2)
    epi = dict(bias_gu=torch.randn(E, 2 * inter, generator=gen), bias_d=torch.randn(E, H, generator=gen),
               activation="swiglu_clamped", alpha=1.702, limit=1.0)
    out = torch.zeros(2, H)
    pk.moe_packed(x, ids, w, gu, "mxfp4", dn, "mxfp4", None, out, **epi)
    ref = reference(x, ids, w, gu, "mxfp4", dn, "mxfp4", None, torch.zeros(2, H), **epi)
    scale = np.abs(ref).max()
    assert np.abs(out.numpy() - ref).max() <= TOL * scale
    for change in (dict(bias_d=None), dict(activation="silu"), dict(limit=7.0)):
        wrong = reference(x, ids, w, gu, "mxfp4", dn, "mxfp4", None, torch.zeros(2, H), **{**epi, **change})
        assert np.abs(out.numpy() - wrong).max() > 100 * TOL * scale, change


@pytest.mark.parametrize("isa", ALL_ISAS, indirect=True)
def test_tolerance_catches_a_swapped_nibble_order(pk, isa):
    """The check is tight enough to see a layout slip: q4_k with each byte's two nibbles swapped."""
    def swap(gu: torch.Tensor) -> torch.Tensor:
        blocks = gu.clone().view(-1, 144)
        qs = blocks[:, 16:]
        blocks[:, 16:] = (qs >> 4) | (qs << 4)
        return blocks.view(gu.shape)

    with pytest.raises(AssertionError, match="max abs err"):
        run_case(pk, torch.Generator().manual_seed(8), "q4_k", "q4_k", 3, 2, corrupt=swap)


def test_scalar_decoder_is_exact(pk):
    gen = torch.Generator().manual_seed(5)
    for fmt in FORMATS:
        rows = pk.random_blocks(fmt, (4,), 512, gen)
        ref = ref_dequant(fmt, rows.numpy(), 512).astype(np.float32)  # the decoder's values are float32
        np.testing.assert_array_equal(pk.dequantize(fmt, rows).numpy(), ref, err_msg=fmt)


def test_mxfp4_small_exponents(pk):
    """e8m0 codes 0 and 1 are ggml's subnormal halves, not 2^-128 / 2^-127 rounded to zero."""
    rows = pk.random_blocks("mxfp4", (2,), 64, torch.Generator().manual_seed(1)).clone()
    rows[:, 0], rows[:, 17] = 0, 1
    ref = ref_dequant("mxfp4", rows.numpy(), 64)
    assert (ref[:, :32] != 0).any() and (ref[:, 32:] != 0).any()
    np.testing.assert_array_equal(pk.dequantize("mxfp4", rows).double().numpy(), ref)


def test_bad_arguments_name_the_argument(pk):
    gen = torch.Generator().manual_seed(3)
    T, H, inter, E, k = 2, 64, 32, 3, 2
    good = dict(x=torch.randn(T, H), ids=torch.zeros(T, k, dtype=torch.int32), weights=torch.ones(T, k),
                gate_up=pk.random_blocks("q8_0", (E, 2 * inter), H, gen), fmt_gu="q8_0",
                down=pk.random_blocks("q4_0", (E, H), inter, gen), fmt_d="q4_0", gscale=None, out=torch.zeros(T, H))
    bad = {
        "ids": dict(ids=torch.full((T, k), E, dtype=torch.int32)),
        "ids ": dict(ids=torch.zeros(T, k, dtype=torch.int64)),
        "weights": dict(weights=torch.ones(T, k + 1)),
        "gate_up": dict(gate_up=pk.random_blocks("q8_0", (E, 2 * inter), 2 * H, gen)),
        "fmt_gu": dict(fmt_gu="q9_9"),
        "down": dict(down=pk.random_blocks("q4_0", (E + 1, H), inter, gen)),
        "down ": dict(fmt_d="q4_k"),  # 32 values per row are no whole q4_k block
        "gscale": dict(gscale=torch.ones(E, 2)),
        "out": dict(out=torch.zeros(T, H, dtype=torch.bfloat16)),
        "x": dict(x=torch.randn(T, H, dtype=torch.float64)),
        "bias_gu": dict(bias_gu=torch.zeros(E, inter)),
        "bias_d": dict(bias_d=torch.zeros(E, H, dtype=torch.float64)),
        "activation": dict(activation="gelu"),
    }
    for name, change in bad.items():
        with pytest.raises(ValueError, match=f"^{name.strip()}"):
            pk.moe_packed(**{**good, **change})
    pk.moe_packed(**good)  # and the good call still runs


def test_bench_counts_packed_bytes(pk, capsys):
    """`bench cpu-experts --format F` (freetoken_agent/bench/packed_experts.py) on the native kernel: the
    bytes of the experts one call reads, its rate over them, and the plain-read bound of the same bytes."""
    import argparse
    import json

    from freetoken_agent.bench.cpu_experts import add_parser
    from freetoken_agent.bench.packed_experts import run_packed

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["cpu-experts", "--format", "q4_k", "--threads", "1", "--seconds", "0.01",
                              "--rounds", "1", "--json", "--no-torch"])
    assert run_packed(args, hidden=256, inter=256, top_k=2, bank_gb=0.001) == 0
    r = json.loads(capsys.readouterr().out)
    per_expert = 3 * 256 * 144  # gate/up and down rows of one q4_k block each
    assert r["kernel"] == "native" and r["bytes_per_call"] == 2 * per_expert
    assert r["packed_ms"] > 0 and r["read_bound_gbps"] > 0
    # the reported figures are rounded (ms to 3 decimals): a few percent
    assert r["weight_gbps"] == pytest.approx(r["bytes_per_call"] / r["packed_ms"] / 1e6, rel=0.03)
    assert r["fraction_of_bound"] == pytest.approx(r["weight_gbps"] / r["read_bound_gbps"], rel=0.03)


@pytest.mark.skipif("avx2" not in CPU_ISAS, reason="compares the avx2 path with the scalar one")
def test_bench_times_each_isa_it_is_given(pk, capsys):
    """`--isa avx2,scalar`: one row per path, each timed on its own path (scalar is several times
    slower: a bench that ignored --isa would time one path twice), and the path in force restored."""
    import argparse
    import json

    from freetoken_agent.bench.cpu_experts import add_parser
    from freetoken_agent.bench.packed_experts import run_packed
    from native import ftnative

    before = ftnative.get_isa()
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["cpu-experts", "--format", "q4_k", "--threads", "1", "--seconds", "0.05",
                              "--rounds", "2", "--json", "--no-torch", "--isa", "avx2,scalar"])
    assert run_packed(args, hidden=512, inter=256, top_k=2, bank_gb=0.002) == 0
    rows = {r["isa"]: r for r in json.loads(capsys.readouterr().out)}
    assert set(rows) == {"avx2", "scalar"}
    assert rows["avx2"]["weight_gbps"] > 2 * rows["scalar"]["weight_gbps"]
    assert ftnative.get_isa() == before


def test_all_skipped_leaves_out_unchanged(pk):
    gen = torch.Generator().manual_seed(4)
    gu, dn = pk.random_blocks("q4_0", (2, 64), 64, gen), pk.random_blocks("q4_0", (2, 64), 32, gen)
    out = torch.randn(3, 64, generator=gen)
    before = out.clone()
    pk.moe_packed(torch.randn(3, 64), torch.full((3, 2), -1, dtype=torch.int32), torch.ones(3, 2), gu, "q4_0", dn,
                  "q4_0", None, out)
    assert torch.equal(out, before)


def test_host_task_overwrites_out_and_reports_failures(pk):
    gen = torch.Generator().manual_seed(6)
    T, H, inter, E, k = 3, 256, 64, 4, 2
    gu, dn = pk.random_blocks("q4_k", (E, 2 * inter), H, gen), pk.random_blocks("q8_0", (E, H), inter, gen)
    x, weights = torch.randn(T, H, generator=gen) * 0.05, torch.rand(T, k, generator=gen)
    ids = torch.tensor([[0, 3], [2, -1], [1, 1]], dtype=torch.int32)
    want = torch.zeros(T, H)
    pk.moe_packed(x, ids, weights, gu, "q4_k", dn, "q8_0", None, want)
    out = torch.full((T, H), 7.0)
    task = pk.PackedHostTask(x, ids, weights, gu, "q4_k", dn, "q8_0", None, out)
    task.run()
    task.run()  # overwritten, not added to
    assert torch.equal(out, want) and (want != 0).any()
    task.check()
    ids[0, 0] = E  # a bad id at run time: counted, out zeroed, raised by check()
    task.run()
    assert not out.any()
    with pytest.raises(RuntimeError, match="out of range"):
        task.check()


def test_host_task_runs_the_epilogue(pk):
    """PackedHostTask with gpt-oss's biases and clamped SwiGLU: the same numbers as the direct call."""
    gen = torch.Generator().manual_seed(7)
    T, H, inter, E, k = 2, 64, 32, 3, 2
    gu, dn = make_bank(pk, "mxfp4", E, 2 * inter, H, gen), make_bank(pk, "mxfp4", E, H, inter, gen)
    x, weights = torch.randn(T, H, generator=gen) * 5, torch.rand(T, k, generator=gen)
    ids = torch.tensor([[0, 2], [1, -1]], dtype=torch.int32)
    epi = dict(bias_gu=torch.randn(E, 2 * inter, generator=gen), bias_d=torch.randn(E, H, generator=gen),
               activation="swiglu_clamped", alpha=1.702, limit=1.0)
    want, plain = torch.zeros(T, H), torch.zeros(T, H)
    pk.moe_packed(x, ids, weights, gu, "mxfp4", dn, "mxfp4", None, want, **epi)
    pk.moe_packed(x, ids, weights, gu, "mxfp4", dn, "mxfp4", None, plain)
    out = torch.full((T, H), 7.0)
    task = pk.PackedHostTask(x, ids, weights, gu, "mxfp4", dn, "mxfp4", None, out, **epi)
    task.run()
    task.check()
    assert torch.equal(out, want) and not torch.allclose(want, plain)


@pytest.mark.parametrize("isa", ALL_ISAS, indirect=True)
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_token_count_around_the_tile(pk, isa, fmt):
    """One expert taking every token: 1..9 tokens per expert are whole tiles of TMAX tokens (AVX2 2,
    AVX-512 4) and the single-token remainders; rows of 3 blocks (an odd block count: the group sums,
    the per-group scale and the prefetch stride over a row that is no power of two of blocks)."""
    gen = torch.Generator().manual_seed(40 + FORMATS.index(fmt))
    block = pk.FORMATS[fmt].block
    hidden = inter = 3 * block if block >= 32 else 6 * block
    gu, dn = make_bank(pk, fmt, 1, 2 * inter, hidden, gen), make_bank(pk, fmt, 1, hidden, inter, gen)
    w_rms = float(np.sqrt(np.mean(ref_dequant(fmt, gu[0].numpy(), hidden) ** 2)))
    gs = torch.rand(1, 3, generator=gen) + 0.5
    for T in range(1, 10):
        x = torch.randn(T, hidden, generator=gen) / (w_rms * hidden**0.5) + 0.3 / (w_rms * hidden**0.5)  # sum(x) != 0
        ids, weights = torch.zeros(T, 1, dtype=torch.int32), torch.rand(T, 1, generator=gen)
        out0 = torch.randn(T, hidden, generator=gen)
        out = out0.clone()
        pk.moe_packed(x, ids, weights, gu, fmt, dn, fmt, gs, out)
        ref = reference(x, ids, weights, gu, fmt, dn, fmt, gs, out0)
        err = np.abs(out.double().numpy() - ref).max()
        scale = np.abs(ref - out0.double().numpy()).max() + 1e-30
        assert err <= TOL * scale, f"{fmt} T={T}: max abs err {err:.3g} > {TOL:g} * {scale:.3g}"


def test_chunk_rows_changes_the_split_not_the_result(pk, ft):
    """The rows a thread takes at a time only move work between threads: every chunk size gives the
    same bits (each output row is summed by one thread in a fixed order), including chunks that do
    not divide the rows and one chunk for the whole matrix; a size that is not a multiple of 4 is refused."""
    gen = torch.Generator().manual_seed(5)
    E, H, inter, T, k = 4, 512, 256, 5, 3
    gu, dn = make_bank(pk, "q4_k", E, 2 * inter, H, gen), make_bank(pk, "q6_k", E, H, inter, gen)
    x, w = torch.randn(T, H, generator=gen).to(torch.bfloat16), torch.rand(T, k, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).to(torch.int32)
    before, threads = ft.chunk_rows(), ft.num_threads()
    outs = {}
    try:
        ft.set_num_threads(2)
        for rows in (4, 16, 20, 64, 4096):
            ft.set_chunk_rows(rows)
            assert ft.chunk_rows() == rows
            outs[rows] = torch.zeros(T, H)
            pk.moe_packed(x, ids, w, gu, "q4_k", dn, "q6_k", None, outs[rows])
        for bad in (0, 6, 4100):
            with pytest.raises(ValueError, match="chunk rows"):
                ft.set_chunk_rows(bad)
    finally:
        ft.set_chunk_rows(before)
        ft.set_num_threads(threads)
    ref = reference(x, ids, w, gu, "q4_k", dn, "q6_k", None, torch.zeros(T, H))
    assert np.abs(outs[16].numpy() - ref).max() <= TOL * np.abs(ref).max()
    for rows, out in outs.items():
        assert torch.equal(out, outs[16]), rows
