"""The packed expert executor (engine/moe/packed.py) with the native kernel (native/packed.py) equals
the float64 dequantise-then-compute reference for every packed format, per-layer formats mixed,
bf16 and f32 activations, skipped (-1) ids, per-expert global scales; the torch path equals it too.
`create_executor` picks native under "auto" when it is built, torch under "torch"."""

from __future__ import annotations

import pytest
import torch

from engine.moe.executor import create_executor
from engine.moe.packed import PackedExpertExecutor, native_moe_packed, torch_moe_packed
from engine.quant.formats import FORMATS, PACKED
from engine.weights.layout import PackedExpertBanks

H, INTER, E, T, K = 256, 256, 4, 2, 2


def _banks(fmt_gu: str, fmt_d: str, seed: int) -> PackedExpertBanks:
    g = torch.Generator().manual_seed(seed)
    b = PackedExpertBanks.empty(E, H, INTER)
    b.gate_up.append(FORMATS[fmt_gu].random_rows((E, 2 * INTER), H, g, scale=0.02))
    b.down.append(FORMATS[fmt_d].random_rows((E, H), INTER, g, scale=0.02))
    b.fmt_gu.append(fmt_gu)
    b.fmt_d.append(fmt_d)
    scales = torch.rand(E, 3, generator=g) + 0.5  # the layout: 1.0 where the format has no global scale
    scales[:, :2] = scales[:, :2] if FORMATS[fmt_gu].has_gscale else 1.0
    scales[:, 2] = scales[:, 2] if FORMATS[fmt_d].has_gscale else 1.0
    b.gscale.append(scales)
    return b


def _reference(b: PackedExpertBanks, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(x.shape[0], H, dtype=torch.float64)
    fgu, fd = FORMATS[b.fmt_gu[0]], FORMATS[b.fmt_d[0]]
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e < 0:
                continue
            s = b.gscale[0][e].double()
            gate = fgu.dequantize(b.gate_up[0][e, :INTER], H).double() * s[0]
            up = fgu.dequantize(b.gate_up[0][e, INTER:], H).double() * s[1]
            dn = fd.dequantize(b.down[0][e], INTER).double() * s[2]
            xe = x[t].double()
            h = torch.nn.functional.silu(gate @ xe) * (up @ xe)
            out[t] += float(w[t, j]) * (dn @ h)
    return out


def _inputs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, H, generator=g).to(dtype)
    ids = torch.randint(0, E, (T, K), generator=g, dtype=torch.int64)
    ids[1, 0] = -1
    return x, ids, torch.rand(T, K, generator=g)


KERNELS = {"torch": torch_moe_packed, "native": native_moe_packed()}


@pytest.mark.parametrize("fmt", list(PACKED))
def test_packed_kernels_equal_float64(fmt: str) -> None:
    if KERNELS["native"] is None:
        pytest.fail("native/packed.py is not built (python native/build.py)")
    other = "q6_k" if fmt != "q6_k" else "q8_0"
    for fmt_gu, fmt_d, dtype in ((fmt, fmt, torch.float32), (fmt, other, torch.bfloat16)):
        b = _banks(fmt_gu, fmt_d, seed=len(fmt))
        x, ids, w = _inputs(dtype)
        ref = _reference(b, x, ids, w)
        for kernel, fn in KERNELS.items():
            assert fn is not None
            out = torch.zeros(T, H)
            fn(x, ids.to(torch.int32), w, b.gate_up[0], fmt_gu, b.down[0], fmt_d, b.gscale[0], out)
            err = float((out.double() - ref).abs().max() / ref.abs().max())
            assert err < 1e-5, f"{kernel} {fmt_gu}/{fmt_d} {dtype}: relative error {err:.2e}"
            got = PackedExpertExecutor(b, fn, kernel)(x, ids, w, 0)  # the engine's call: x's dtype back
            assert got.dtype == dtype and torch.equal(got, out.to(dtype))


def test_create_executor_picks_the_kernel() -> None:
    b = _banks("q4_k", "q6_k", 0)
    auto = create_executor("auto", b)
    assert isinstance(auto, PackedExpertExecutor)
    assert auto.kernel is (native_moe_packed() or torch_moe_packed)
    assert create_executor("torch", b).kernel is torch_moe_packed  # type: ignore[attr-defined]


def test_packed_native_executor_takes_the_thread_count() -> None:
    """`--cpu-threads` sizes the native pool the packed kernel runs on, as it does for float banks (a
    GPU run whose pool kept one thread per core oversubscribed the cores its poller shares)."""
    from engine.moe.native import load_native

    ft = load_native()
    before = ft.num_threads()
    want = 1 if before != 1 else 2
    try:
        ex = create_executor("auto", _banks("q4_k", "q4_k", 0), threads=want)
        assert isinstance(ex, PackedExpertExecutor) and ex.name == "native"
        assert ft.num_threads() == want
    finally:
        ft.set_num_threads(before)
