"""Native CPU expert executor (native/): correctness per SIMD path, input checking, threading, timing.

Everything is skipped when the extension cannot be built or loaded; the session fixture first tries to
build it (native/build.py) when the .so is missing or older than its sources.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
NATIVE = ROOT / "native"


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _expected_isas() -> list[str]:
    f = _cpu_flags()
    isas = []
    if {"avx512f", "avx512bw", "avx512vl", "avx2", "fma"} <= f:
        if "avx512_bf16" in f:
            isas.append("avx512bf16")
        isas.append("avx512")
    if {"avx2", "fma"} <= f:
        isas.append("avx2")
    return [*isas, "scalar"]


ALL_ISAS = ["avx512bf16", "avx512", "avx2", "scalar"]
CPU_ISAS = _expected_isas()


def _stale(so: Path) -> bool:
    srcs = [*NATIVE.glob("src/*"), NATIVE / "build.py"]
    return so.stat().st_mtime < max(p.stat().st_mtime for p in srcs)


@pytest.fixture(scope="session")
def ft():
    sys.path.insert(0, str(NATIVE))
    try:
        import build as native_build  # native/build.py

        so = native_build.output_path()
        if not so.exists() or _stale(so):
            try:
                native_build.build(verbose=False)
            except Exception as exc:  # no compiler, no pybind11, compile error
                pytest.skip(f"native extension could not be built: {exc}")
        try:
            import ftnative
        except ImportError as exc:
            pytest.skip(f"native extension not loadable: {exc}")
        yield ftnative
        ftnative.set_isa("auto")
    finally:
        sys.path.remove(str(NATIVE))


@pytest.fixture
def isa(ft, request):
    name = request.param
    if name not in CPU_ISAS:
        pytest.skip(f"CPU lacks {name}")
    ft.set_isa(name)
    yield name
    ft.set_isa("auto")


def _reference(x, ids, weights, w13, w2) -> torch.Tensor:
    """float64 reference: sum_j w * down(silu(gate x) * up x)."""
    xd = x.double()
    inter = w2.shape[-1]
    a = w13[ids].double()  # [T, k, 2I, H]
    gu = torch.einsum("tkih,th->tki", a, xd)
    h = F.silu(gu[..., :inter]) * gu[..., inter:]
    y = torch.einsum("tkhi,tki->tkh", w2[ids].double(), h)
    return (y * weights.double()[..., None]).sum(1)


def _problem(gen, T, H, inter, R, k, x_dtype=torch.float32):
    w13 = (torch.randn(R, 2 * inter, H, generator=gen) / H**0.5).bfloat16()
    w2 = (torch.randn(R, H, inter, generator=gen) / inter**0.5).bfloat16()
    x = torch.randn(T, H, generator=gen).to(x_dtype)
    ids = torch.stack([torch.randperm(R, generator=gen)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=gen)
    return x, ids, weights, w13, w2


def _tol(isa: str, x_dtype, out_dtype) -> float:
    """Allowed max-abs error relative to the reference's max-abs value."""
    if isa == "avx512bf16":
        return 2e-2  # activations (x and the hidden h) are rounded to bf16 for vdpbf16ps
    if x_dtype == torch.bfloat16 or out_dtype == torch.bfloat16:
        return 1e-2
    return 2e-5


def _check_close(out, ref, tol):
    err = (out.double() - ref).abs().max().item()
    scale = ref.abs().max().item() + 1e-12
    assert err <= tol * scale, f"max abs err {err:.3g} > {tol:g} * {scale:.3g}"


def test_isa_detection(ft):
    assert ft.supported_isas() == CPU_ISAS
    assert ft.get_isa() == CPU_ISAS[0] or os.environ.get("FREETOKEN_NATIVE_ISA")
    with pytest.raises(ValueError, match="unknown ISA"):
        ft.set_isa("sse9")
    for name in ALL_ISAS:
        if name not in CPU_ISAS:
            with pytest.raises(ValueError, match="not supported"):
                ft.set_isa(name)


@pytest.mark.parametrize("isa", ALL_ISAS, indirect=True)
@pytest.mark.parametrize("seed", range(12))
def test_random_shapes_match_reference(ft, isa, seed):
    gen = torch.Generator().manual_seed(1000 + seed)
    ri = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=gen))  # noqa: E731
    T = [1, 64, ri(2, 63)][seed % 3]
    H = ri(1, 300) if seed % 4 else 16 * ri(1, 12)  # mostly not a multiple of the vector width
    inter = ri(1, 200)
    k = ri(1, 8)
    R = k + ri(0, 8)
    x_dtype = torch.bfloat16 if seed % 2 else torch.float32
    out_dtype = torch.float32 if seed % 5 == 0 else x_dtype
    x, ids, weights, w13, w2 = _problem(gen, T, H, inter, R, k, x_dtype)
    out = torch.full((T, H), float("nan"), dtype=out_dtype)
    got = ft.moe_layer(x, ids, weights, w13, w2, out=out)
    assert got is out and got.dtype == out_dtype
    _check_close(got, _reference(x, ids, weights, w13, w2), _tol(isa, x_dtype, out_dtype))


@pytest.mark.parametrize("isa", ALL_ISAS, indirect=True)
def test_repeated_experts_and_strided_inputs(ft, isa):
    gen = torch.Generator().manual_seed(7)
    T, H, inter, R, k = 9, 100, 37, 5, 4
    x, _, weights, w13, w2 = _problem(gen, T, H, inter, R, k)
    ids = torch.randint(0, R, (T, k), generator=gen)  # duplicates within a token too
    ids[:, 0] = 2  # one expert shared by every token
    wide = torch.randn(T, H + 13, generator=gen)
    wide[:, 5 : 5 + H] = x
    xs = wide[:, 5 : 5 + H]  # row stride H + 13
    big13 = torch.zeros(2 * R, 2 * inter, H + 3, dtype=torch.bfloat16)
    big13[::2, :, :H] = w13
    big2 = torch.zeros(2 * R, H, inter + 5, dtype=torch.bfloat16)
    big2[::2, :, :inter] = w2
    out_wide = torch.zeros(T, H + 7)
    got = ft.moe_layer(xs, ids, weights, big13[::2, :, :H], big2[::2, :, :inter], out=out_wide[:, :H])
    _check_close(got, _reference(x, ids, weights, w13, w2), _tol(isa, torch.float32, torch.float32))
    assert (out_wide[:, H:] == 0).all()


def test_matches_torch_executor(ft):
    from engine.moe.executor import TorchExpertExecutor
    from engine.weights.layout import ExpertBanks

    gen = torch.Generator().manual_seed(3)
    L, E, H, inter, T, k = 2, 6, 64, 48, 5, 2
    banks = ExpertBanks(
        w13=(torch.randn(L * E, 2 * inter, H, generator=gen) / 8).bfloat16(),
        w2=(torch.randn(L * E, H, inter, generator=gen) / 7).bfloat16(),
        num_experts=E,
    )
    x = torch.randn(T, H, generator=gen).bfloat16()
    ids = torch.randint(0, E, (T, k), generator=gen)
    weights = torch.rand(T, k, generator=gen)
    got = ft.NativeExpertExecutor(banks)(x, ids, weights, 1)
    want = TorchExpertExecutor(banks)(x, ids, weights, 1)
    assert got.dtype == want.dtype == torch.bfloat16
    _check_close(got, want.double(), 3e-2)


def test_thread_counts_and_concurrent_callers(ft):
    gen = torch.Generator().manual_seed(11)
    x, ids, weights, w13, w2 = _problem(gen, 6, 130, 70, 10, 3)
    ft.set_isa("scalar" if "avx2" not in CPU_ISAS else "avx2")  # deterministic f32 path
    n_before = ft.num_threads()
    try:
        base = ft.moe_layer(x, ids, weights, w13, w2)
        for n in (1, 2, 3, 5):
            ft.set_num_threads(n)
            assert ft.num_threads() == n
            _check_close(ft.moe_layer(x, ids, weights, w13, w2), base.double(), 1e-6)
        errors: list[BaseException] = []

        def worker():
            try:
                for _ in range(20):
                    _check_close(ft.moe_layer(x, ids, weights, w13, w2), base.double(), 1e-6)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=worker) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors[0]
    finally:
        ft.set_num_threads(n_before)
        ft.set_isa("auto")


def test_empty_batch(ft):
    x = torch.zeros(0, 8)
    ids = torch.zeros(0, 2, dtype=torch.int64)
    w = torch.zeros(0, 2)
    w13 = torch.zeros(3, 10, 8, dtype=torch.bfloat16)
    w2 = torch.zeros(3, 8, 5, dtype=torch.bfloat16)
    assert ft.moe_layer(x, ids, w, w13, w2).shape == (0, 8)


def _bad_cases():
    T, H, inter, R, k = 3, 20, 12, 4, 2
    x = torch.randn(T, H)
    ids = torch.zeros(T, k, dtype=torch.int64)
    w = torch.ones(T, k)
    w13 = torch.zeros(R, 2 * inter, H, dtype=torch.bfloat16)
    w2 = torch.zeros(R, H, inter, dtype=torch.bfloat16)
    good = dict(x=x, ids=ids, weights=w, w13=w13, w2=w2)
    return {
        "x float16": dict(good, x=x.half()),
        "x 1-d": dict(good, x=x[0]),
        "x transposed": dict(good, x=torch.randn(H, T).t()),
        "x hidden mismatch": dict(good, x=torch.randn(T, H + 1)),
        "x not a tensor": dict(good, x=x.tolist()),
        "ids int32": dict(good, ids=ids.int()),
        "ids wrong rows": dict(good, ids=ids[:2]),
        "ids non-contiguous": dict(good, ids=torch.zeros(k, T, dtype=torch.int64).t()),
        "ids out of range": dict(good, ids=torch.full((T, k), R)),
        "ids negative": dict(good, ids=torch.full((T, k), -1)),
        "weights float64": dict(good, weights=w.double()),
        "weights shape": dict(good, weights=torch.ones(T, k + 1)),
        "w13 float32": dict(good, w13=w13.float()),
        "w13 odd rows": dict(good, w13=torch.zeros(R, 2 * inter + 1, H, dtype=torch.bfloat16)),
        "w13 inner stride": dict(
            good, w13=torch.zeros(R, H, 2 * inter, dtype=torch.bfloat16).transpose(1, 2)
        ),
        "w2 shape": dict(good, w2=torch.zeros(R, H, inter + 1, dtype=torch.bfloat16)),
        "w2 experts": dict(good, w2=torch.zeros(R - 1, H, inter, dtype=torch.bfloat16)),
        "out shape": dict(good, out=torch.zeros(T, H + 1)),
        "out dtype": dict(good, out=torch.zeros(T, H, dtype=torch.float64)),
        "out transposed": dict(good, out=torch.zeros(H, T).t()),
    }


@pytest.mark.parametrize("case", list(_bad_cases()))
def test_bad_inputs_raise_value_error(ft, case):
    kwargs = _bad_cases()[case]
    with pytest.raises(ValueError):
        ft.moe_layer(**kwargs)


def _run_py(code: str, env_isa: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, FREETOKEN_NATIVE_ISA=env_isa, PYTHONPATH=str(NATIVE))
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("name", ALL_ISAS)
def test_env_var_forces_isa(ft, name):
    code = (
        "import torch, ftnative as ft\n"
        "g = torch.Generator().manual_seed(5)\n"
        "w13 = torch.randn(4, 2 * 33, 71, generator=g).bfloat16(); w2 = torch.randn(4, 71, 33, generator=g).bfloat16()\n"
        "x = torch.randn(3, 71, generator=g); ids = torch.tensor([[0, 1], [2, 3], [3, 0]]); w = torch.rand(3, 2, generator=g)\n"
        "o = ft.moe_layer(x, ids, w, w13, w2)\n"
        "a = w13[ids].double().einsum if False else None\n"
        "gu = torch.einsum('tkih,th->tki', w13[ids].double(), x.double())\n"
        "h = torch.nn.functional.silu(gu[..., :33]) * gu[..., 33:]\n"
        "r = (torch.einsum('tkhi,tki->tkh', w2[ids].double(), h) * w.double()[..., None]).sum(1)\n"
        "print(ft.get_isa(), float((o.double() - r).abs().max() / r.abs().max()))\n"
    )
    res = _run_py(code, name)
    if name in CPU_ISAS:
        assert res.returncode == 0, res.stderr
        got, rel = res.stdout.split()
        assert got == name
        assert float(rel) < _tol(name, torch.float32, torch.float32)
    else:
        assert res.returncode != 0 and "not supported" in res.stderr


def test_env_var_unknown_isa(ft):
    res = _run_py("import ftnative", "sse9")
    assert res.returncode != 0 and "unknown ISA" in res.stderr


@pytest.mark.slow
def test_timing_batch1(ft, capsys):
    """Printed, not asserted: weight GB/s at batch 1 vs a plain read of the same bytes vs torch bf16.

    The banks (FT_BENCH_R experts, default 128: ~1.2 GB) are much larger than any LLC and every call
    touches experts the previous calls did not, so the numbers are DRAM numbers. Each path is timed in
    several rounds, round-robin, and the best round is reported.
    """
    env = os.environ.get
    H, inter, k = int(env("FT_BENCH_H", 2048)), int(env("FT_BENCH_I", 768)), 8
    R = int(env("FT_BENCH_R", 128))
    gen = torch.Generator().manual_seed(0)
    # distinct memory per expert, cheap to make: one random expert repeated
    w13 = (torch.randn(1, 2 * inter, H, generator=gen) / H**0.5).bfloat16().repeat(R, 1, 1)
    w2 = (torch.randn(1, H, inter, generator=gen) / inter**0.5).bfloat16().repeat(R, 1, 1)
    x = torch.randn(1, H, generator=gen).bfloat16()
    weights = torch.rand(1, k)
    n_sets = R // k
    id_sets = [torch.arange(j * k, (j + 1) * k).reshape(1, k) for j in range(n_sets)]
    bytes_per_call = k * 3 * H * inter * 2
    flat = torch.cat([w13.reshape(-1), w2.reshape(-1)]).view(torch.uint8)
    n_slices = flat.numel() // bytes_per_call
    slices = [flat[j * bytes_per_call : (j + 1) * bytes_per_call] for j in range(n_slices)]
    n_threads = ft.num_threads()
    old_torch_threads = torch.get_num_threads()
    torch.set_num_threads(n_threads)
    counter = [0]

    def native(isa_name):
        def fn():
            ft.set_isa(isa_name)
            ft.moe_layer(x, id_sets[counter[0] % n_sets], weights, w13, w2)

        return fn

    def read():
        ft.read_bytes(slices[counter[0] % n_slices])

    def torch_ref():
        ids = id_sets[counter[0] % n_sets][0].tolist()
        y = torch.zeros(1, H, dtype=torch.bfloat16)
        for j, e in enumerate(ids):
            g, u = F.linear(x, w13[e]).chunk(2, dim=-1)
            y += F.linear(F.silu(g) * u, w2[e]) * weights[0, j]

    cases = {f"native {n}": native(n) for n in CPU_ISAS if n != "scalar"}
    cases["read bound (native read)"] = read
    cases["torch bf16 F.linear"] = torch_ref
    best = dict.fromkeys(cases, float("inf"))
    try:
        for _ in range(3):
            for label, fn in cases.items():
                fn()  # warm-up call
                counter[0] += 1
                reps = 8
                t0 = time.perf_counter()
                for _ in range(reps):
                    fn()
                    counter[0] += 1
                best[label] = min(best[label], (time.perf_counter() - t0) / reps)
    finally:
        ft.set_isa("auto")
        torch.set_num_threads(old_torch_threads)
    with capsys.disabled():
        print(
            f"\n[native timing] batch 1, H={H} I={inter} k={k}, {bytes_per_call / 1e6:.1f} MB weights/call, "
            f"{n_threads} threads, bank {flat.numel() / 1e9:.2f} GB"
        )
        for label, s in best.items():
            print(f"  {label:28s} {s * 1e3:8.2f} ms  {bytes_per_call / s / 1e9:6.2f} GB/s")
