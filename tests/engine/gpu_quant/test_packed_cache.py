"""The GPU expert cache over packed experts (engine/gpu/quant/pool.py through engine/gpu/executor.py,
device_step.py and prefill.py) equals the packed CPU executor (engine/moe/packed.py) on the same
banks: per-layer formats mixed (q4_k / q6_k as in Q4_K_M, q8_0, nvfp4 with its global scales), every
fetch ratio, pools from none to every expert, the planned path, the streamed prefill and (on CUDA)
the graph-captured decode steps with host-issued packed fetches and the native packed CPU branch.
"""

from __future__ import annotations

import pytest
import torch

from engine.gpu.executor import create_cached_executor
from engine.gpu.quant.pool import PackedPool
from engine.moe.packed import PackedExpertExecutor, torch_moe_packed
from engine.quant.formats import FORMATS
from engine.weights.layout import PackedExpertBanks

H, INTER, E, K = 256, 256, 8, 2
LAYERS = (("q4_k", "q6_k"), ("q4_k", "q4_k"), ("q8_0", "nvfp4"))


def _banks(seed: int = 0, layers: tuple[tuple[str, str], ...] = LAYERS) -> PackedExpertBanks:
    g = torch.Generator().manual_seed(seed)
    b = PackedExpertBanks.empty(E, H, INTER)
    for fmt_gu, fmt_d in layers:
        b.gate_up.append(FORMATS[fmt_gu].random_rows((E, 2 * INTER), H, g, scale=0.02))
        b.down.append(FORMATS[fmt_d].random_rows((E, H), INTER, g, scale=0.02))
        b.fmt_gu.append(fmt_gu)
        b.fmt_d.append(fmt_d)
        s = torch.rand(E, 3, generator=g) + 0.5
        s[:, :2] = s[:, :2] if FORMATS[fmt_gu].has_gscale else 1.0
        s[:, 2] = s[:, 2] if FORMATS[fmt_d].has_gscale else 1.0
        b.gscale.append(s.contiguous())
    return b


def _expert_bytes(b: PackedExpertBanks) -> int:
    return b.expert_bytes + 12


def _inputs(n: int, step: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(n, H, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)])
    w = torch.rand(n, K, generator=g)
    return x, ids, w


def _check(device: str, slots: int, ratio: float, sizes: tuple[int, ...], dtype: torch.dtype = torch.float32,
           tol: float = 1e-4, seed: int = 0) -> tuple[int, int]:
    banks = _banks(seed)
    reference = PackedExpertExecutor(banks, torch_moe_packed)
    ex = create_cached_executor(banks, slots * _expert_bytes(banks), device, ratio,
                                cpu_executor=None if device == "cuda" else PackedExpertExecutor(banks))
    assert isinstance(ex.slots, PackedPool) and ex.slots.slots == min(slots, len(LAYERS) * E)
    step = 0
    for n in sizes:
        for layer in range(len(LAYERS)):
            x, ids, w = _inputs(n, step)
            step += 1
            got = ex(x.to(device), ids.to(device), w.to(device), layer)
            if device == "cuda":
                ex.check(n)
            want = reference(x.float(), ids, w, layer)
            err = (got.float().cpu() - want).abs().max().item()
            assert err <= tol * max(1.0, want.abs().max().item()), (n, layer, err)
    stats = ex.stats
    ex.close()
    return stats.fetched, stats.misses


@pytest.mark.parametrize(("slots", "ratio"), [(0, 0.5), (5, 0.0), (5, 0.5), (16, 1.0), (24, 0.5)])
def test_cpu_pool_equals_packed_executor(slots: int, ratio: float) -> None:
    fetched, misses = _check("cpu", slots, ratio, (1, 3))
    if slots == 0 or ratio == 0.0:
        assert fetched == 0
    elif slots < 24:
        assert fetched > 0 and misses > 0


def test_cpu_streamed_prefill_equals_packed_executor() -> None:
    """A pool of 2E + 4 slots streams each layer of a 40-token chunk (N * k >= 4E entries)."""
    _check("cpu", 2 * E + 4, 0.5, (40, 1, 40))


def test_pool_copies_packed_bytes_and_scales() -> None:
    banks = _banks(3)
    pool = PackedPool(banks, 4)
    assert pool.gscales  # nvfp4 in the last layer
    pool.apply_copies(torch.tensor([2 * E + 5, -1, 1]), torch.tensor([3, 0, 1]), banks)
    fmt = pool.formats[2]
    assert torch.equal(pool.packed.gate_up(fmt)[3], banks.gate_up[2][5])
    assert torch.equal(pool.packed.down(fmt)[3], banks.down[2][5])
    assert torch.equal(pool.packed.gscale[3], banks.gscale[2][5])
    w13, w2 = pool.weights(1, 0)
    want = FORMATS["q6_k"].dequantize(banks.down[0][1], INTER)
    assert torch.equal(w2, want)
    assert w13.shape == (2 * INTER, H)
    with pytest.raises(ValueError, match="not a slot"):
        pool.copy_expert(4, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("slots", [5, 16, 24])
@pytest.mark.parametrize("ratio", [0.0, 0.5, 1.0])
def test_cuda_cache_equals_packed_executor(slots: int, ratio: float) -> None:
    """Decode steps (1 and 3 tokens: graphs, packed fetch, native packed CPU branch), a planned
    medium batch (12 tokens) and, where the pool holds two layers, a streamed chunk (40 tokens)."""
    sizes = (1, 3, 1, 12) + ((40, 1) if slots >= 2 * E else ())
    fetched, _ = _check("cuda", slots, ratio, sizes)
    if ratio > 0 and slots < 24:
        assert fetched > 0
