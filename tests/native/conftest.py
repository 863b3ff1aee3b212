"""Fixtures of the native executor tests: the module (skipped when the extension is not built,
unless FREETOKEN_REQUIRE_NATIVE=1, as in CI, where a missing build is a failure), ISA selection,
and the float64 reference."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ALL_ISAS = ["avx512bf16", "avx512", "avx2", "scalar"]


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


# set by tests/native/test_emulated_avx512.py: `native` is the test module of `native/build.py
# --emulate-avx512`, whose AVX-512 paths run on SIMDe's emulation wherever AVX2 runs
EMULATED_AVX512 = os.environ.get("FREETOKEN_NATIVE_EMULATED_AVX512") == "1"


def expected_isas() -> list[str]:
    f = _cpu_flags()
    isas = []
    if EMULATED_AVX512 and {"avx2", "fma", "f16c"} <= f:
        return ["avx512bf16", "avx512", "avx2", "scalar"]
    if {"avx512f", "avx512bw", "avx512vl", "avx2", "fma", "f16c"} <= f:
        if "avx512_bf16" in f:
            isas.append("avx512bf16")
        isas.append("avx512")
    if {"avx2", "fma", "f16c"} <= f:
        isas.append("avx2")
    return [*isas, "scalar"]


CPU_ISAS = expected_isas()


@pytest.fixture(scope="session")
def ft():
    try:
        from native import ftnative
    except ImportError as exc:
        if os.environ.get("FREETOKEN_REQUIRE_NATIVE") == "1":
            pytest.fail(f"native extension required but not loadable: {exc}")
        pytest.skip(f"native extension not built: {exc}")
    assert ftnative._ext.emulated_avx512 == EMULATED_AVX512, f"{ftnative._ext.__file__} is not the module asked for"
    yield ftnative
    ftnative.set_isa("auto")


@pytest.fixture
def isa(ft, request):
    name = request.param
    if name not in CPU_ISAS:
        pytest.skip(f"CPU lacks {name}")
    ft.set_isa(name)
    yield name
    ft.set_isa("auto")


def reference(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
              w2: torch.Tensor) -> torch.Tensor:
    """float64: sum_j w * down(silu(gate x) * up x), from float64 (dequantized) banks."""
    inter = w2.shape[-1]
    gu = torch.einsum("tkih,th->tki", w13[ids].double(), x.double())
    h = F.silu(gu[..., :inter]) * gu[..., inter:]
    y = torch.einsum("tkhi,tki->tkh", w2[ids].double(), h)
    return (y * weights.double()[..., None]).sum(1)


def tolerance(isa: str, fmt: str, x_dtype: torch.dtype, out_dtype: torch.dtype) -> float:
    """Allowed max-abs error relative to the reference's max-abs value."""
    if isa == "avx512bf16" and fmt == "bf16":
        return 2e-2  # activations (x and the hidden h) are rounded to bf16 for vdpbf16ps
    if out_dtype == torch.bfloat16:
        return 1e-2  # the output itself is rounded to bf16
    return 2e-5


def check_close(out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    assert not torch.isnan(out).any(), "NaN in output (an element was not written?)"
    err = (out.double() - ref).abs().max().item()
    scale = ref.abs().max().item() + 1e-12
    assert err <= tol * scale, f"max abs err {err:.3g} > {tol:g} * {scale:.3g}"
