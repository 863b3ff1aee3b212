"""The executor's entry point (engine/gpu/quant/entry.py) and the packed slot pool (slots.py):
- one pool shared by layers of different formats (a Q4_K_M-like mix): each layer's experts are
  copied into slots as their packed bytes (copy_in), and each layer's kernels read them with that
  layer's format: decode rows and the grouped prefill (in x's dtype; on the bf16 kernel for the q8_0
  and mxfp4 layers, tf32x3 for the others) equal the float64 reference;
- the expert split is refused (bf16 / f32 only), as is a format whose expert exceeds the stride;
- the budget helpers count packed bytes: a 4-bit slot costs about a quarter of a bf16 one.
Kernels on a CPU through Triton's interpreter; on CUDA directly."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from quant_reference import reference_moe
from test_gemv import make_slots
from triton_interpreter import run_in_interpreter

from engine.gpu.quant.formats import slot_bytes
from engine.gpu.quant.grouped_bf16 import bf16_wins
from engine.gpu.quant.slots import ExpertFormat, PackedSlots, slots_for_budget


def check(device: str) -> int:
    from engine.gpu.quant.entry import packed_layer_kernels

    rng = np.random.default_rng(40)
    g = torch.Generator().manual_seed(40)
    # the last two run their grouped prefill on the bf16 kernel (grouped_bf16.bf16_wins), the first two on tf32x3
    layers = [make_slots(gu, d, 64, 32, 2, rng, "cpu")
              for gu, d in (("q4_0", "q8_0"), ("q5_1", "nvfp4"), ("q8_0", "q8_0"), ("mxfp4", "mxfp4"))]
    formats = [fmt for _, fmt, _, _ in layers]
    assert [bf16_wins(f, torch.bfloat16) for f in formats] == [False, False, True, True]
    assert not bf16_wins(formats[2], torch.float32) and not bf16_wins(formats[3], torch.float16)
    pool = PackedSlots.allocate(formats, 3, device)
    kernels = packed_layer_kernels(pool, formats)
    x = torch.randn(2, 64, generator=g)
    w = torch.rand(2, 2, generator=g)
    for i, (src, fmt, dgu, dd) in enumerate(layers):
        # the layer's experts 0 and 1 land in slots 2 and 0 (slot 1 keeps the other layer's bytes)
        for e, s in ((0, 2), (1, 0)):
            pool.copy_in(s, fmt, src.gate_up(fmt)[e].to(device), src.down(fmt)[e].to(device), src.gscale[e].to(device))
        slot_ids = torch.tensor([[2, -1], [0, 2]])
        rows = kernels[i].expert_rows(x.to(device), slot_ids.to(device), w.to(device)).cpu()
        want = reference_moe(x, torch.tensor([[0, -1], [1, 0]]), w, dgu, dd)
        torch.testing.assert_close(rows.double(), want, rtol=2e-5, atol=2e-6 * float(want.abs().max()))
        slot_of = torch.tensor([2, 0], device=device)
        ids = torch.tensor([[0, 1], [1, 0]])
        out = kernels[i].grouped_experts(x.to(device).to(torch.bfloat16), ids.to(device), w.to(device), slot_of)
        assert out.dtype == torch.bfloat16
        want = reference_moe(x.to(torch.bfloat16).float(), torch.tensor([[0, 1], [1, 0]]), w, dgu, dd)
        torch.testing.assert_close(out.cpu().double(), want.view(2, 2, 64).sum(1), rtol=1e-2, atol=1e-2)
        with pytest.raises(ValueError, match="expert split"):
            kernels[i].expert_rows(x.to(device), slot_ids.to(device), w.to(device), split=slot_ids)
    return len(layers)


def test_pool_checks_and_budget() -> None:
    small = PackedSlots.allocate([ExpertFormat("q4_k", "q4_k", 256, 256)], 2)
    with pytest.raises(ValueError, match="cannot hold a q4_k/q6_k expert"):
        small.check(ExpertFormat("q4_k", "q6_k", 256, 256))
    with pytest.raises(ValueError, match="down: 100 columns"):
        ExpertFormat("q8_0", "q4_k", 256, 100)
    with pytest.raises(ValueError, match="gscale"):
        PackedSlots(torch.zeros(2, 8, dtype=torch.uint8), torch.ones(3, 3))
    mix = [ExpertFormat("q4_k", "q4_k", 2048, 768), ExpertFormat("q4_k", "q6_k", 2048, 768)]
    budget = 2**30
    assert slots_for_budget(budget, mix, 10**6) == budget // (slot_bytes("q4_k", "q6_k", 2048, 768) + 12)
    bf16 = slots_for_budget(budget, [ExpertFormat("bf16", "bf16", 2048, 768)], 10**6)
    assert 3.5 * bf16 <= slots_for_budget(budget, [ExpertFormat("mxfp4", "mxfp4", 2048, 768)], 10**6) <= 4 * bf16
    assert slots_for_budget(budget, mix, 5) == 5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_layer_kernels_cuda() -> None:
    assert check("cuda") == 4


def test_layer_kernels_in_triton_interpreter() -> None:
    run_in_interpreter(__file__)


if __name__ == "__main__":  # the interpreter test's child
    assert check("cpu") == 4
    print("ok")
