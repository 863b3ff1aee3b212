"""Streamed prefill (engine/gpu/prefill.py) on a real CUDA device (skipped without one; run on the
GPU machine): a real copy stream, page-locked host banks, bfloat16 and float32.
- with the loop kernel, a whole chunk gives TorchExpertExecutor's outputs bit for bit, for an
  empty cache, a few experts resident and a full pool, with pools of exactly 2E slots and more;
  after finish() the table's
  invariants hold, the untouched working set keeps its slots and weights, empty slots beyond the
  buffers keep the first streamed experts, every resident slot holds its bank rows;
- chunks interleaved with decode steps on the same table and pool (the decode kernels that read a
  slot the next chunk reserves are ordered before that chunk's copies): still exact;
- the grouped kernels (the one path on CUDA, engine/gpu/grouped.py): the chunk's
  outputs equal the reference's within float32 summation order / bf16 rounding tolerance, and the
  table (slots, owners, LRU state) and stats equal those of the loop path on an identical pool,
  for empty, partly resident and full caches, dense and sparse routing, two chunks in a row;
- with large-ish banks (4 layers x 64 experts of ~4 MiB) it reports the achieved streaming rate
  (printed: run with -s), next to a plain copy of the same experts; it asserts only correctness.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from engine.gpu.cache_table import CacheTable
from engine.gpu.executor import CachedExpertExecutor
from engine.gpu.prefill import PrefillStreamer
from engine.gpu.slots import ExpertSlots
from engine.moe.executor import TorchExpertExecutor
from engine.weights.layout import ExpertBanks

pytestmark = pytest.mark.gpu

L, E, K = 3, 8, 2


def _banks(layers: int, experts: int, hidden: int, inter: int, dtype: torch.dtype, seed: int = 0) -> ExpertBanks:
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(layers * experts, 2 * inter, hidden, generator=g, dtype=dtype) / hidden ** 0.5).pin_memory()
    w2 = (torch.randn(layers * experts, hidden, inter, generator=g, dtype=dtype) / inter ** 0.5).pin_memory()
    return ExpertBanks(w13, w2, experts)


def _pool(banks: ExpertBanks, n: int) -> tuple[ExpertSlots, CacheTable]:
    slots = ExpertSlots(tuple(banks.w13.shape[1:]), tuple(banks.w2.shape[1:]), banks.w13.dtype, n, "cuda")
    layers = banks.w13.shape[0] // banks.num_experts
    return slots, CacheTable(layers, banks.num_experts, n, "cuda")


def _chunk(layers: int, experts: int, k: int, n: int, hidden: int, dtype: torch.dtype,
           seed: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(layers):
        x = torch.randn(n, hidden, generator=g).to("cuda", dtype)
        ids = torch.rand(n, experts, generator=g).topk(k, dim=-1).indices.cuda()
        w = torch.rand(n, k, generator=g).to("cuda", dtype)
        out.append((x, ids, w))
    return out


def _place(table: CacheTable, slots: ExpertSlots, banks: ExpertBanks, placed: dict[int, int]) -> None:
    for i, (flat, slot) in enumerate(placed.items()):
        table.table_flat[flat] = slot
        table.owner_flat[slot] = flat
        table.last_use_flat[slot] = i + 1
        slots.w13[slot].copy_(banks.w13[flat])
        slots.w2[slot].copy_(banks.w2[flat])
    table.step.fill_(len(placed))
    assert table.invariant_errors() == []


def _check_pool(table: CacheTable, slots: ExpertSlots, banks: ExpertBanks) -> None:
    for flat, slot in table.resident().items():
        assert torch.equal(slots.w13[slot].cpu(), banks.w13[flat]) and torch.equal(slots.w2[slot].cpu(), banks.w2[flat])


def _placed(state: str, n_slots: int) -> dict[int, int]:
    """{flat expert: slot} resident before the chunk: none, a few of every layer, or a full pool."""
    g = torch.Generator().manual_seed(n_slots)
    if state == "empty":
        return {}
    if state == "some":
        flats = [1, E + 2, E + 6, 2 * E + 0, 2 * E + 5]
        return dict(zip(flats, torch.randperm(n_slots, generator=g)[:len(flats)].tolist(), strict=True))
    flats = torch.randperm(L * E, generator=g)[:min(n_slots, L * E)].tolist()
    return {f: s for s, f in enumerate(flats)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("state", "n_slots"), [("empty", 2 * E), ("empty", 3 * E + 5), ("some", 2 * E),
                                                ("some", 2 * E + 5), ("full", 2 * E + 5), ("full", L * E + 2 * E)])
def test_streamed_chunk_on_cuda_matches_reference(state: str, n_slots: int, dtype: torch.dtype) -> None:
    H, inter = 64, 32
    banks = _banks(L, E, H, inter, dtype)
    ref = TorchExpertExecutor(banks)
    slots, table = _pool(banks, n_slots)
    placed = _placed(state, n_slots)
    _place(table, slots, banks, placed)
    before = (slots.w13.clone(), slots.w2.clone())
    streamer = PrefillStreamer(banks, slots, table, torch.cuda.Stream(), kernel="loop")
    streamer.start(0)
    reserved = set(table.reserved())
    kept = {f: s for f, s in placed.items() if s not in reserved}
    for layer, (x, ids, w) in enumerate(_chunk(L, E, K, 40, H, dtype, seed=n_slots)):
        got = streamer.layer(x, ids, w, layer, layer + 1 if layer + 1 < L else None)
        assert got.device.type == "cuda" and got.dtype == dtype
        assert torch.equal(got, ref(x, ids, w, layer))
    streamer.finish()
    assert table.invariant_errors() == [] and table.reserved() == []
    after = table.resident()
    for flat, slot in kept.items():
        assert after[flat] == slot
        assert torch.equal(slots.w13[slot], before[0][slot]) and torch.equal(slots.w2[slot], before[1][slot])
    assert all(f in after for f in range((L - 2) * E, L * E))
    if state == "empty" and n_slots > 2 * E:  # the spare slots kept the first streamed experts
        assert all(f in after for f in range(n_slots - 2 * E))
    _check_pool(table, slots, banks)
    assert streamer.stats.bytes_streamed == sum(1 for f in range(L * E) if f not in kept) * banks.expert_bytes


def test_chunks_interleaved_with_decode() -> None:
    H, inter, dtype = 64, 32, torch.float32
    banks = _banks(L, E, H, inter, dtype, seed=1)
    ref = TorchExpertExecutor(banks)
    slots, table = _pool(banks, 2 * E + 3)
    decode = CachedExpertExecutor(banks, slots, table, TorchExpertExecutor(banks), 1.0)
    streamer = PrefillStreamer(banks, slots, table, torch.cuda.Stream(), kernel="loop")
    try:
        for round_ in range(4):
            for layer, (x, ids, w) in enumerate(_chunk(L, E, K, 200, H, dtype, seed=round_)):
                got = streamer.layer(x, ids, w, layer, layer + 1 if layer + 1 < L else None)
                assert torch.equal(got, ref(x, ids, w, layer))
            streamer.finish()
            for step in range(3):
                for layer, (x, ids, w) in enumerate(_chunk(L, E, K, 1, H, dtype, seed=100 * round_ + step)):
                    torch.testing.assert_close(decode(x, ids, w, layer), ref(x, ids, w, layer), rtol=1e-5, atol=1e-6)
            assert table.invariant_errors() == []
            _check_pool(table, slots, banks)
    finally:
        decode.close()
    assert decode.stats.hits > 0


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """The grouped kernels against the reference: float32 to summation order, bf16 within a few
    roundings of the output's scale (the reference rounds a running bf16 sum)."""
    scale = want.abs().max().item()
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * scale)
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-6, atol=2**-6 * scale)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("state", "n_slots", "tokens", "experts"),
                         [("empty", 2 * E, 40, E), ("some", 2 * E + 5, 40, E), ("full", L * E + 2 * E, 40, E),
                          ("some", 2 * E, 600, E), ("some", 2 * E + 5, 3, 5)])
def test_grouped_kernel_on_cuda(state: str, n_slots: int, tokens: int, experts: int, dtype: torch.dtype) -> None:
    H, inter = 64, 32
    banks = _banks(L, E, H, inter, dtype)
    ref = TorchExpertExecutor(banks)
    placed = _placed(state, n_slots)
    chunks = [_chunk(L, E, K, tokens, H, dtype, seed=n_slots + r) for r in range(2)]
    if experts < E:  # sparse routing: two neighbours among the first `experts` experts
        chunks = [[(x, torch.stack([ids[:, 0] % experts, (ids[:, 0] + 1) % experts], dim=1), w)
                   for x, ids, w in chunk] for chunk in chunks]
    runs = []
    for kernel in ("loop", "grouped"):
        slots, table = _pool(banks, n_slots)
        _place(table, slots, banks, placed)
        streamer = PrefillStreamer(banks, slots, table, torch.cuda.Stream(), kernel=None if kernel == "grouped" else kernel)
        assert streamer.kernel == kernel and streamer.grouped == (kernel == "grouped")
        outs = []
        for chunk in chunks:
            streamer.start(0)
            for layer, (x, ids, w) in enumerate(chunk):
                outs.append(streamer.layer(x, ids, w, layer, layer + 1 if layer + 1 < L else None))
            streamer.finish()
            assert table.invariant_errors() == [] and table.reserved() == []
        _check_pool(table, slots, banks)
        runs.append((outs, table, streamer.stats))
    (loop_outs, loop_table, loop_stats), (outs, table, stats) = runs
    wants = [ref(x, ids, w, layer) for chunk in chunks for layer, (x, ids, w) in enumerate(chunk)]
    for want, loop_out, got in zip(wants, loop_outs, outs, strict=True):
        assert torch.equal(loop_out, want)
        assert got.dtype == dtype and got.device.type == "cuda"
        _close(got, want)
    for name in ("table", "slot_owner", "last_use", "step"):
        assert torch.equal(getattr(table, name), getattr(loop_table, name)), name
    assert dataclasses.asdict(stats) == dataclasses.asdict(loop_stats)
    assert stats.layers == 2 * L and (stats.streamed_unused > 0) == (experts < E)


@pytest.mark.parametrize("tokens", [64, 1024])
def test_streaming_rate(tokens: int) -> None:
    """4 MoE layers x 64 experts of ~4.3 MiB (bf16, H 2048, I 352), top-8: the whole chunk
    streams (empty cache, pool of exactly 2E). Prints the chunk time, the streaming rate it
    achieved and a plain copy of the same experts for comparison."""
    kernel = "grouped"
    layers, experts, k, H, inter, dtype = 4, 64, 8, 2048, 352, torch.bfloat16
    banks = _banks(layers, experts, H, inter, dtype, seed=2)
    ref = TorchExpertExecutor(banks)
    slots, table = _pool(banks, 2 * experts)
    copy = torch.cuda.Stream()
    streamer = PrefillStreamer(banks, slots, table, copy)
    chunk = _chunk(layers, experts, k, tokens, H, dtype, seed=3)

    def run() -> list[torch.Tensor]:
        table.reset()
        streamer.start(0)
        outs = [streamer.layer(x, ids, w, li, li + 1 if li + 1 < layers else None) for li, (x, ids, w) in enumerate(chunk)]
        streamer.finish()
        return outs

    outs = run()  # warm-up (cuBLAS handles, allocator, Triton compilation)
    assert streamer.kernel == kernel
    for li, (x, ids, w) in enumerate(chunk):
        _close(outs[li], ref(x, ids, w, li))
    torch.cuda.synchronize()
    reps = 3
    bytes0 = streamer.stats.bytes_streamed
    t0 = time.perf_counter()
    for _ in range(reps):
        run()
    torch.cuda.synchronize()
    chunk_s = (time.perf_counter() - t0) / reps
    streamed = (streamer.stats.bytes_streamed - bytes0) / reps

    # baseline: the same experts copied one row at a time on the copy stream, nothing else running
    t0 = time.perf_counter()
    with torch.cuda.stream(copy):
        for rep in range(reps):
            for flat in range(layers * experts):
                s = (flat + rep) % slots.slots
                slots.w13[s].copy_(banks.w13[flat], non_blocking=True)
                slots.w2[s].copy_(banks.w2[flat], non_blocking=True)
    copy.synchronize()
    copy_s = (time.perf_counter() - t0) / reps
    # compute alone: every expert resident, the buffers in empty slots: nothing streamed
    n_all = layers * experts
    all_slots, all_table = _pool(banks, n_all + 2 * experts)
    _place(all_table, all_slots, banks, {f: f for f in range(n_all)})
    compute = PrefillStreamer(banks, all_slots, all_table, copy)
    compute.start(None)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        for li, (x, ids, w) in enumerate(chunk):
            compute.layer(x, ids, w, li, li + 1 if li + 1 < layers else None)
    torch.cuda.synchronize()
    compute_s = (time.perf_counter() - t0) / reps
    compute.finish()
    assert compute.stats.streamed == 0 and compute.stats.in_place > 0
    print(f"\nstreamed prefill ({kernel}), {tokens} tokens, {layers} layers x {experts} experts of "
          f"{banks.expert_bytes / 2**20:.2f} MiB: chunk {chunk_s * 1e3:.1f} ms, streamed {streamed / 2**30:.2f} GiB "
          f"-> {streamed / chunk_s / 1e9:.1f} GB/s; plain copy {layers * experts * banks.expert_bytes / copy_s / 1e9:.1f} GB/s "
          f"({copy_s * 1e3:.1f} ms); compute alone (all resident) {compute_s * 1e3:.1f} ms")
    assert all_table.invariant_errors() == [] and table.invariant_errors() == []
