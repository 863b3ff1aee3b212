"""The shared-expert tail kernel (engine/model/fused_ops.py `shared_gated_add`: out + sigmoid(x . g)
* shared) against the torch ops it replaces (engine/model/moe.py) and a float64 reference:
- float32: within 1e-5 relative of the torch ops;
- float16 / bfloat16 (bf16 on CUDA only: Triton's interpreter truncates bf16 casts): the same
  rounding points, so against the torch ops only the dot product's float32 order differs: every
  element within two ulps of the output (not a share of identical elements: a gate one ulp apart
  moves up to a quarter of a float16 row's products across a rounding boundary, 74 % identical for
  5 tokens on the H200); against float64 within the four roundings' worth;
- hidden sizes 2048, 96 (not a power of two) and 1; 1 and 5 tokens; a non-contiguous shared input.
On CUDA directly; on a CPU through Triton's interpreter, when triton is installed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from triton_interpreter import run_in_interpreter


def _torch_ops(out: torch.Tensor, x: torch.Tensor, gate: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    return out + torch.sigmoid(F.linear(x, gate)) * shared


def check(device: str, dtypes: tuple[torch.dtype, ...]) -> int:
    from engine.model.fused_ops import shared_gated_add

    cases = 0
    g = torch.Generator().manual_seed(3)
    for dtype in dtypes:
        for tokens, dim in ((1, 2048), (5, 2048), (3, 96), (2, 1)):
            x = (torch.randn(tokens, dim, generator=g) * 2).to(dtype).to(device)
            gate = (torch.randn(1, dim, generator=g) / dim**0.5).to(dtype).to(device)
            out = torch.randn(tokens, dim, generator=g).to(dtype).to(device)
            wide = torch.randn(tokens, 2 * dim, generator=g).to(dtype).to(device)
            shared = wide[:, ::2]  # a strided view
            got = shared_gated_add(out, x, gate, shared)
            want = _torch_ops(out, x, gate, shared)
            exact = _torch_ops(out.double(), x.double(), gate.double(), shared.double())
            scale = out.double().abs() + shared.double().abs()
            if dtype == torch.float32:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            else:
                ulp = 2.0 ** (-10 if dtype == torch.float16 else -7)
                diff = (got.double() - want.double()).abs()
                assert (diff <= 2 * ulp * scale + 1e-30).all(), (dtype, tokens, dim, diff.max().item())
                assert ((got.double() - exact).abs() <= 4 * ulp * scale + 1e-6).all(), (dtype, tokens, dim)
            cases += 1
    return cases


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_shared_gated_add_matches_torch_and_float64_cuda() -> None:
    assert check("cuda", (torch.float32, torch.float16, torch.bfloat16)) == 12


def test_shared_gated_add_matches_torch_and_float64_in_triton_interpreter() -> None:
    run_in_interpreter(__file__)


if __name__ == "__main__":  # the interpreter test's child
    assert check("cpu", (torch.float32, torch.float16)) == 8
    print("ok")
