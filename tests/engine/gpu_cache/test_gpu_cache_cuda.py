"""The GPU expert tier on a real CUDA device (skipped without one; run on the GPU machine):
- `plan_layer` never synchronises with the host (torch's sync debug mode turns any sync into an
  error) and can be captured in a CUDA graph and replayed, with the same decisions as eager runs;
- `CachedExpertExecutor` with the slot pool on the GPU and pinned host banks gives the torch
  reference's outputs (ratio 0 / 0.5 / 1, a few slots and all experts);
- calibration measures B_P and the contended pair.
"""

from __future__ import annotations

import pytest
import torch

from engine.gpu.cache_table import CacheTable
from engine.gpu.executor import create_cached_executor
from engine.gpu.plan import plan_layer
from engine.moe.executor import TorchExpertExecutor
from engine.weights.layout import ExpertBanks

pytestmark = pytest.mark.gpu

L, E, K = 3, 16, 4


def _ids(step: int, n: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)])


def test_plan_never_syncs() -> None:
    state = CacheTable(L, E, 10, "cuda")
    ids = [_ids(s).cuda() for s in range(20)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for s, i in enumerate(ids):
            plan_layer(state, s % L, i, 0.5)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert state.invariant_errors() == []


def test_plan_in_a_cuda_graph_matches_eager() -> None:
    eager = CacheTable(L, E, 10, "cuda")
    graphed = CacheTable(L, E, 10, "cuda")
    static_ids = _ids(0).cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside capture, then reset the state it touched
        plan_layer(graphed, 0, static_ids, 0.5)
    torch.cuda.current_stream().wait_stream(side)
    graphed.reset()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = plan_layer(graphed, 0, static_ids, 0.5)
    graphed.reset()  # capture does not run the kernels, but be explicit
    for s in range(30):
        ids = _ids(s).cuda()
        want = plan_layer(eager, 0, ids, 0.5)
        static_ids.copy_(ids)
        graph.replay()
        assert torch.equal(out.slot_ids, want.slot_ids) and torch.equal(out.copy_src, want.copy_src)
        assert torch.equal(out.copy_dst, want.copy_dst) and int(out.fetched) == int(want.fetched)
        assert torch.equal(graphed.table, eager.table) and torch.equal(graphed.last_use, eager.last_use)


@pytest.mark.parametrize("ratio", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("slots", [5, L * E])
def test_executor_on_cuda_matches_reference(slots: int, ratio: float) -> None:
    g = torch.Generator().manual_seed(0)
    H, inter = 64, 32
    banks = ExpertBanks((torch.randn(L * E, 2 * inter, H, generator=g) / 8).pin_memory(),
                        (torch.randn(L * E, H, inter, generator=g) / 6).pin_memory(), E)
    ref = TorchExpertExecutor(banks)
    ex = create_cached_executor(banks, slots * banks.expert_bytes, "cuda", ratio, TorchExpertExecutor(banks))
    for s in range(12):
        n = 4 if s % 3 == 0 else 1
        x = torch.randn(n, H, generator=g).cuda()
        ids, w = _ids(s, n).cuda(), torch.rand(n, K, generator=g).cuda()
        for layer in range(L):
            got = ex(x, ids, w, layer)
            assert got.device.type == "cuda"
            torch.testing.assert_close(got, ref(x, ids, w, layer), rtol=1e-4, atol=1e-5)
    assert ex.table.invariant_errors() == []
    assert (ex.stats.fetched > 0) == (ratio > 0)


def test_calibrate_measures_pcie() -> None:
    from engine.gpu.calibrate import CalibrationSpec, calibrate

    cal = calibrate(CalibrationSpec(bank_bytes=500_000_000, seconds=0.2, rounds=1))
    assert cal.b_pcie and cal.b_pcie > 1 and cal.b_pcie_contended and cal.b_cpu_contended
    assert 0 < cal.ratio() <= 1 and cal.key.gpu != "none" and not cal.note
    # the decode split's ratio: the host-issued copies' contended rate against the CPU's beside it
    assert cal.ratio() == pytest.approx(cal.b_pcie_contended / (cal.b_pcie_contended + cal.b_cpu_contended))
