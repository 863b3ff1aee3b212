"""The grouped prefill GEMM over packed slots (engine/gpu/quant/grouped.py), on engine/gpu/grouped.py's
expert-sorted layout: each token's sum over its k routed experts of weight * down(silu(gate x) *
up x), the experts' packed rows read from their slots, equals a float64 MoE over the reference-
dequantised experts (quant_reference.py) to float32 rounding, for format mixes of every block size;
a layout the caller made first gives the same result. x in bf16, and in float32 and float16 on
layers that mix 16- and 32-value scale groups with and without offsets, one of them with K not a
multiple of 32. The same checks for the bf16 kernel of engine/gpu/quant/grouped_bf16.py (bf16
dots of exact codes, which the layer entry runs for q8_0 and mxfp4, x in one, two or three bf16 pieces: the same tolerance, which one piece misses
for a float32 x). On a CPU through Triton's interpreter; on CUDA directly, and there also at
Qwen3-30B-A3B's expert shape (H 2048, I 768) for a 256-token chunk."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from quant_reference import ALL, reference_moe
from test_gemv import FEW, make_slots, shape_for
from triton_interpreter import run_in_interpreter


def kernel(name: str) -> Callable[..., torch.Tensor]:
    """The tf32x3 kernel ("engine") or the bf16 one ("bf16")."""
    if name == "engine":
        from engine.gpu.quant.grouped import packed_grouped_experts

        return packed_grouped_experts
    from engine.gpu.quant.grouped_bf16 import bf16_packed_grouped_experts

    return bf16_packed_grouped_experts


def run_case(fmt_gu: str, fmt_d: str, hidden: int, inter: int, tokens: int, experts: int, k: int, device: str,
             seed: int, dtype: torch.dtype = torch.bfloat16, which: str = "engine") -> None:
    from engine.gpu.grouped import group_entries

    packed_grouped_experts = kernel(which)

    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    pool, fmt, dgu, dd = make_slots(fmt_gu, fmt_d, hidden, inter, experts + 1, rng, device, spare=5)
    # expert e sits in slot perm[e]; one slot holds no routed expert
    slot_of = torch.randperm(experts + 1, generator=g)[:experts]
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w = torch.rand(tokens, k, generator=g)
    want = reference_moe(x.float(), slot_of[ids], w, dgu, dd).view(tokens, k, hidden).sum(dim=1)
    dev = [t.to(device) for t in (x, ids, w, slot_of)]
    got = packed_grouped_experts(dev[0], dev[1], dev[2], dev[3], pool, fmt).cpu()
    torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=2e-6 * float(want.abs().max()))
    again = packed_grouped_experts(dev[0], dev[1], dev[2], dev[3], pool, fmt, group_entries(dev[1], dev[3])).cpu()
    assert torch.equal(again, got)


def check(device: str, pairs: list[tuple[str, str]], which: str = "engine") -> int:
    for i, (fmt_gu, fmt_d) in enumerate(pairs):
        hidden, inter = shape_for(fmt_gu, fmt_d)
        run_case(fmt_gu, fmt_d, hidden, inter, tokens=5, experts=4, k=2, device=device, seed=30 + i, which=which)
    return len(pairs)


# (gate_up, down, H, I, x dtype): groups of 16 (q2_k: with an offset; q6_k, nvfp4) next to groups of
# 32 (q4_k, q4_1: with offsets); nvfp4 at H 80, I 48: the last 32-value step holds one group
DTYPE_CASES = [("q4_k", "q6_k", 256, 256, torch.float32), ("q2_k", "q4_1", 256, 64, torch.float16),
               ("nvfp4", "nvfp4", 80, 48, torch.float32), ("q6_k", "q4_k", 256, 256, torch.float16)]


def check_dtypes(device: str, which: str = "engine", cases: int = len(DTYPE_CASES)) -> int:
    for i, (fmt_gu, fmt_d, hidden, inter, dtype) in enumerate(DTYPE_CASES[:cases]):
        run_case(fmt_gu, fmt_d, hidden, inter, tokens=5, experts=4, k=2, device=device, seed=60 + i, dtype=dtype,
                 which=which)
    return cases


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("which", ["engine", "bf16"])
def test_packed_grouped_cuda(which: str) -> None:
    assert check("cuda", [(f, f) for f in ALL] + FEW, which) == 19
    assert check_dtypes("cuda", which) == len(DTYPE_CASES)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("pair", [("q4_k", "q6_k"), ("q8_0", "q8_0"), ("mxfp4", "mxfp4"), ("fp8", "fp8"),
                                  ("nvfp4", "nvfp4")])
def test_packed_grouped_qwen3_30b_shape_cuda(pair: tuple[str, str]) -> None:
    run_case(*pair, hidden=2048, inter=768, tokens=256, experts=8, k=4, device="cuda", seed=7)


@pytest.mark.parametrize("which", ["engine", "bf16"])
def test_packed_grouped_in_triton_interpreter(which: str) -> None:
    run_in_interpreter(__file__, which)


if __name__ == "__main__":  # the interpreter test's child: argv[1] names the kernel
    import sys

    assert check("cpu", FEW[:3], sys.argv[1]) == 3
    # the tf32x3 kernel widens any x to float32 (one case covers it); the bf16 kernel's pieces differ per
    # dtype (three and two pieces, 16- and 32-value groups, a K tail: the first three; all four on CUDA)
    cases = 1 if sys.argv[1] == "engine" else 3
    assert check_dtypes("cpu", sys.argv[1], cases) == cases
    print("ok")
