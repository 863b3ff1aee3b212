"""Streamed prefill (engine/gpu/prefill.py) and the cache table's reserved slots, with the CPU
standing in for the GPU (no copy stream: everything runs in order, same results):
- a whole 3-layer chunk through the streamer gives TorchExpertExecutor's outputs bit for bit, for
  an empty cache, a few experts of several layers resident (known slot contents), a full pool and
  every expert resident, with pools of exactly 2E slots and more, with and without prefetching;
- after finish(): the table's invariants hold, no slot is reserved any more, every expert that was
  resident outside the 2E reserved slots is still resident in the same slot with the same weights,
  the last two layers are resident (streamed ones registered, the freshest), the empty slots
  beyond the 2E buffers keep the first streamed experts, every resident slot holds its bank rows,
  and the decode path that follows gives the reference's outputs; a second chunk reads the kept
  experts in place and streams only the rest;
- the buffers are the 2E least recently used slots (empty first); plan_layer never hits a reserved
  slot nor takes one as a victim while it has unreserved slots to spare; `fits` is false below 2E;
- the kernel: an unknown name is a ConfigError naming the valid ones; a CPU pool (no Triton
  interpreter) runs the loop, bit for bit; through Triton's interpreter (when
  triton is installed; a subprocess) the grouped kernels give the reference's outputs (float32 to
  summation order, bf16 within a few roundings) and leave the same table, LRU state and stats as
  the loop path, for empty, partly resident and full caches, dense and sparse routing.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from triton_interpreter import run_in_interpreter

from engine.errors import ConfigError
from engine.gpu.cache_table import RESERVED_USE, CacheTable
from engine.gpu.executor import CachedExpertExecutor
from engine.gpu.plan import plan_layer
from engine.gpu.prefill import PrefillStreamer
from engine.gpu.slots import ExpertSlots
from engine.moe.executor import TorchExpertExecutor
from engine.weights.layout import ExpertBanks

L, E, H, INTER, K, N = 3, 8, 32, 16, 2, 40


def _banks(seed: int = 0) -> ExpertBanks:
    g = torch.Generator().manual_seed(seed)
    return ExpertBanks(torch.randn(L * E, 2 * INTER, H, generator=g) / H ** 0.5,
                       torch.randn(L * E, H, INTER, generator=g) / INTER ** 0.5, E)


def _chunk(seed: int, n: int = N, experts: int = E) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(x, ids, weights) of every MoE layer of one chunk, top-K among the first `experts`."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(L):
        x = torch.randn(n, H, generator=g)
        ids = torch.stack([torch.randperm(experts, generator=g)[:K] for _ in range(n)])
        out.append((x, ids, torch.rand(n, K, generator=g)))
    return out


def _place(table: CacheTable, slots: ExpertSlots, banks: ExpertBanks, placed: dict[int, tuple[int, int]]) -> None:
    """Makes expert flat resident in slot s with last_use u, for each flat: (s, u)."""
    for flat, (slot, use) in placed.items():
        table.table_flat[flat] = slot
        table.owner_flat[slot] = flat
        table.last_use_flat[slot] = use
        slots.w13[slot] = banks.w13[flat]
        slots.w2[slot] = banks.w2[flat]
    table.step.fill_(max((u for _, u in placed.values()), default=0))
    assert table.invariant_errors() == []


def _state(name: str, n_slots: int) -> dict[int, tuple[int, int]]:
    g = torch.Generator().manual_seed(n_slots)
    if name == "empty":
        return {}
    if name == "some":  # experts of every layer, scattered slots, distinct ages
        flats = [0, 5, E + 1, E + 7, 2 * E + 2, 2 * E + 3]
        where = torch.randperm(n_slots, generator=g)[:len(flats)].tolist()
        return {f: (s, 1 + i) for i, (f, s) in enumerate(zip(flats, where, strict=True))}
    if name == "full":  # every slot (or every expert) filled, ages shuffled
        flats = torch.randperm(L * E, generator=g)[:min(n_slots, L * E)].tolist()
        ages = (torch.randperm(len(flats), generator=g) + 1).tolist()
        return {f: (s, u) for s, (f, u) in enumerate(zip(flats, ages, strict=True))}
    raise AssertionError(name)


def _spare(placed: dict[int, tuple[int, int]], n_slots: int) -> int:
    """Empty slots beyond the buffers' 2E: the streamer keeps streamed experts there."""
    return max(0, n_slots - len(placed) - 2 * E)


def _expected_reserved(placed: dict[int, tuple[int, int]], n_slots: int) -> list[int]:
    age = {s: u for s, u in placed.values()}
    return sorted(sorted(range(n_slots), key=lambda s: (age.get(s, -1), s))[:2 * E + _spare(placed, n_slots)])


def _check_pool(table: CacheTable, slots: ExpertSlots, banks: ExpertBanks) -> None:
    for flat, slot in table.resident().items():
        assert torch.equal(slots.w13[slot], banks.w13[flat]) and torch.equal(slots.w2[slot], banks.w2[flat])


CASES = [("empty", 2 * E), ("empty", 2 * E + 5), ("some", 2 * E), ("some", 2 * E + 5), ("full", 2 * E),
         ("full", L * E), ("full", L * E + 2 * E)]


@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize(("state", "n_slots"), CASES)
def test_streamed_chunk_matches_reference(state: str, n_slots: int, prefetch: bool) -> None:
    banks = _banks()
    ref = TorchExpertExecutor(banks)
    slots = ExpertSlots(tuple(banks.w13.shape[1:]), tuple(banks.w2.shape[1:]), banks.w13.dtype, n_slots)
    table = CacheTable(L, E, n_slots)
    placed = _state(state, n_slots)
    _place(table, slots, banks, placed)
    before_w13, before_w2 = slots.w13.clone(), slots.w2.clone()
    step0 = int(table.step)

    streamer = PrefillStreamer(banks, slots, table, None)
    if prefetch:
        streamer.start(0)
    else:
        streamer.start(None)
    reserved = table.reserved()
    assert reserved == _expected_reserved(placed, n_slots)
    assert table.invariant_errors() == []  # reserved slots are valid table states
    owner = table.slot_owner.tolist()
    assert all(owner[s] == table.reserved_owner for s in reserved)
    assert all(table.last_use[s] == RESERVED_USE for s in reserved)
    resident_in_place = {f: s for f, (s, _) in placed.items() if s not in reserved}
    assert table.resident() == resident_in_place  # the reserved slots' experts were evicted

    for layer, (x, ids, w) in enumerate(_chunk(seed=n_slots)):
        nxt = layer + 1 if prefetch and layer + 1 < L else None
        got = streamer.layer(x, ids, w, layer, nxt)
        assert torch.equal(got, ref(x, ids, w, layer))
    streamer.finish()
    assert not streamer.active

    assert table.invariant_errors() == []
    assert table.reserved() == []
    assert table.reserved_owner not in table.slot_owner.tolist()
    after = table.resident()
    for flat, slot in resident_in_place.items():  # the decode working set survives untouched
        assert after[flat] == slot
        assert torch.equal(slots.w13[slot], before_w13[slot]) and torch.equal(slots.w2[slot], before_w2[slot])
    for layer in (L - 2, L - 1):  # the last two layers are resident
        assert all(layer * E + e in after for e in range(E))
    # the empty slots beyond the buffers hold the first streamed experts (layer by layer)
    spare = reserved[2 * E:]
    streamed_order = [f for f in range(L * E) if f not in resident_in_place]
    assert len(spare) == _spare(placed, n_slots)
    assert all(after[f] == slot for f, slot in zip(streamed_order, spare, strict=False))
    _check_pool(table, slots, banks)
    registered = [f for f in after if f not in resident_in_place]
    last = table.last_use.tolist()
    assert all(last[after[f]] == int(table.step) for f in registered)
    assert int(table.step) == step0 + L + 1

    s = streamer.stats
    streamed = sum(1 for f in range(L * E) if f not in resident_in_place)
    assert (s.chunks, s.layers, s.streamed, s.registered) == (1, L, streamed, len(registered))
    assert s.bytes_streamed == streamed * banks.expert_bytes
    assert s.streamed_unused == 0  # N tokens top-2 of 8: every expert is routed
    assert s.in_place == len(resident_in_place)


def test_sparse_routing_and_repeated_chunks_then_decode() -> None:
    """Experts no token uses are streamed anyway (counted as unused); a second chunk on the same
    streamer; then decode on the same table and pool matches the reference and hits the last two
    layers."""
    banks = _banks(seed=3)
    ref = TorchExpertExecutor(banks)
    n_slots = 2 * E + 4
    slots = ExpertSlots(tuple(banks.w13.shape[1:]), tuple(banks.w2.shape[1:]), banks.w13.dtype, n_slots)
    table = CacheTable(L, E, n_slots)
    decode = CachedExpertExecutor(banks, slots, table, TorchExpertExecutor(banks), 1.0, overlap=False)
    g = torch.Generator().manual_seed(9)
    for _ in range(4):  # warm the cache through the decode path
        x, ids, w = torch.randn(1, H, generator=g), torch.randperm(E, generator=g)[:K][None], torch.rand(1, K, generator=g)
        for layer in range(L):
            torch.testing.assert_close(decode(x, ids, w, layer), ref(x, ids, w, layer), rtol=1e-5, atol=1e-6)
    streamer = PrefillStreamer(banks, slots, table)
    for seed in (1, 2):
        for layer, (x, ids, w) in enumerate(_chunk(seed, n=3, experts=5)):  # experts 5..7 never routed
            assert torch.equal(streamer.layer(x, ids, w, layer, layer + 1 if layer + 1 < L else None),
                               ref(x, ids, w, layer))
        streamer.finish()
        assert table.invariant_errors() == [] and table.reserved() == []
        _check_pool(table, slots, banks)
    s = streamer.stats
    assert s.chunks == 2 and s.layers == 2 * L and s.streamed_unused >= 2 * 3
    assert 0.0 <= s.in_place_rate <= 1.0
    hits = decode.stats.hits
    x, ids, w = torch.randn(1, H, generator=g), torch.tensor([[6, 7]]), torch.rand(1, K, generator=g)
    torch.testing.assert_close(decode(x, ids, w, L - 1), ref(x, ids, w, L - 1), rtol=1e-5, atol=1e-6)
    assert decode.stats.hits == hits + 2  # streamed, never routed, but resident after finish()
    assert table.invariant_errors() == []
    _check_pool(table, slots, banks)


def test_same_parity_next_layer_and_unfinished_prefetch() -> None:
    """A `next_moe_index` of the same parity is not prefetched (it would overwrite the running
    layer's buffer); layers in any order work; a prefetch never computed is registered by finish."""
    banks = _banks(seed=4)
    ref = TorchExpertExecutor(banks)
    slots = ExpertSlots(tuple(banks.w13.shape[1:]), tuple(banks.w2.shape[1:]), banks.w13.dtype, 2 * E)
    table = CacheTable(L, E, 2 * E)
    streamer = PrefillStreamer(banks, slots, table)
    chunk = _chunk(5)
    for layer, nxt in [(0, 2), (2, 1), (1, 0)]:
        x, ids, w = chunk[layer]
        assert torch.equal(streamer.layer(x, ids, w, layer, nxt), ref(x, ids, w, layer))
    # layer 0 was prefetched into buffer 0 (over layer 2) and never computed
    streamer.finish()
    assert table.invariant_errors() == []
    assert sorted(table.resident()) == list(range(2 * E))  # layers 0 and 1
    _check_pool(table, slots, banks)
    assert streamer.stats.streamed == 4 * E


def test_fits_and_too_small_pool() -> None:
    banks = _banks()
    assert PrefillStreamer.fits(2 * E, E) and not PrefillStreamer.fits(2 * E - 1, E)
    small = ExpertSlots(tuple(banks.w13.shape[1:]), tuple(banks.w2.shape[1:]), banks.w13.dtype, 2 * E - 1)
    assert not PrefillStreamer.fits(small, E)
    streamer = PrefillStreamer(banks, small, CacheTable(L, E, 2 * E - 1))
    x, ids, w = _chunk(0)[0]
    with pytest.raises(ValueError, match="needs"):
        streamer.layer(x, ids, w, 0)
    assert not streamer.active and streamer.table.reserved() == []
    with pytest.raises(ValueError):
        PrefillStreamer(banks, small, CacheTable(L, E, 2 * E))  # table and pool disagree
    big = ExpertSlots(tuple(banks.w13.shape[1:]), tuple(banks.w2.shape[1:]), banks.w13.dtype, 2 * E)
    with pytest.raises(ValueError, match="out of range"):
        PrefillStreamer(banks, big, CacheTable(L, E, 2 * E)).layer(x, ids, w, L)


def test_reserve_release_register_and_plan() -> None:
    S = 10
    table = CacheTable(L, E, S)
    g = torch.Generator().manual_seed(0)
    for step in range(6):  # fill a few slots through the planner
        plan_layer(table, step % L, torch.randperm(E, generator=g)[:2][None], 1.0)
    owner, last = table.slot_owner.tolist(), table.last_use.tolist()
    want = sorted(sorted(range(S), key=lambda s: (last[s] if owner[s] >= 0 else -1, s))[:4])
    got = table.reserve(4)
    assert got == want == table.reserved()
    assert table.invariant_errors() == []
    assert all(owner[s] < 0 or owner[s] not in table.resident() for s in got)
    with pytest.raises(ValueError):
        table.reserve(S - 4 + 1)
    # decode planning with few misses: never hits a reserved slot, never evicts one
    for step in range(20):
        p = plan_layer(table, step % L, torch.randperm(E, generator=g)[:2][None], 1.0)
        assert not set(p.slot_ids.reshape(-1).tolist()) & set(got)
        assert not set(p.copy_dst.tolist()) & set(got)
        assert table.invariant_errors() == [] and table.reserved() == got
    with pytest.raises(ValueError):
        table.release([got[0], got[0]])
    with pytest.raises(ValueError):
        table.register([s for s in range(S) if s not in got][:1], [0])  # not reserved
    free = [f for f in range(L * E) if f not in table.resident()][:2]
    table.register(got[:2], free)
    table.release(got[2:])
    assert table.reserved() == [] and table.invariant_errors() == []
    assert {f: table.resident()[f] for f in free} == dict(zip(free, got[:2], strict=True))
    assert [table.last_use[s] for s in got[2:]] == [-1, -1]
    table.reserve(3)
    table.reset()
    assert table.reserved() == [] and table.invariant_errors() == []


def test_bad_prefill_kernel_is_a_config_error() -> None:
    banks = _banks()
    slots = ExpertSlots(tuple(banks.w13.shape[1:]), tuple(banks.w2.shape[1:]), banks.w13.dtype, 2 * E)
    with pytest.raises(ConfigError, match=r"'fused'.*valid: loop, grouped"):
        PrefillStreamer(banks, slots, CacheTable(L, E, 2 * E), kernel="fused")
    with pytest.raises(ConfigError, match="valid: loop, grouped"):
        PrefillStreamer(banks, slots, CacheTable(L, E, 2 * E), kernel="Grouped")
    assert PrefillStreamer(banks, slots, CacheTable(L, E, 2 * E), kernel="loop").kernel == "loop"


def test_a_cpu_pool_runs_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without Triton's interpreter a CPU pool has no grouped kernels: the loop, asked or not."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    banks = _banks(seed=6)
    ref = TorchExpertExecutor(banks)
    slots = ExpertSlots(tuple(banks.w13.shape[1:]), tuple(banks.w2.shape[1:]), banks.w13.dtype, 2 * E)
    assert PrefillStreamer(banks, slots, CacheTable(L, E, 2 * E), kernel="grouped").kernel == "loop"
    streamer = PrefillStreamer(banks, slots, CacheTable(L, E, 2 * E))
    assert streamer.kernel == "loop" and not streamer.grouped
    for layer, (x, ids, w) in enumerate(_chunk(7)):
        got = streamer.layer(x, ids, w, layer, layer + 1 if layer + 1 < L else None)
        assert torch.equal(got, ref(x, ids, w, layer))
    streamer.finish()


def compare_kernels(state: str, n_slots: int, dtype: torch.dtype, n: int = N, experts: int = E) -> None:
    """One chunk through a `loop` and a `grouped` streamer on identical tables and pools: the grouped
    outputs match the reference (float32: to summation order; bf16: within a few roundings of the
    output's scale), the tables (slots, owners, last use, step) and stats end up identical and every
    resident slot holds its bank rows."""
    base = _banks(seed=n_slots)
    banks = ExpertBanks(base.w13.to(dtype), base.w2.to(dtype), E)
    ref = TorchExpertExecutor(banks)
    runs = []
    for kernel in ("loop", "grouped"):
        slots = ExpertSlots(tuple(banks.w13.shape[1:]), tuple(banks.w2.shape[1:]), dtype, n_slots)
        table = CacheTable(L, E, n_slots)
        _place(table, slots, banks, _state(state, n_slots))
        streamer = PrefillStreamer(banks, slots, table, None, kernel=kernel)
        assert streamer.grouped == (kernel == "grouped")
        outs = []
        for layer, (x, ids, w) in enumerate(_chunk(seed=n_slots, n=n, experts=experts)):
            outs.append(streamer.layer(x.to(dtype), ids, w.to(dtype), layer, layer + 1 if layer + 1 < L else None))
        streamer.finish()
        assert table.invariant_errors() == [] and table.reserved() == []
        _check_pool(table, slots, banks)
        runs.append((outs, table, streamer.stats))
    (loop_outs, loop_table, loop_stats), (outs, table, stats) = runs
    for layer, (x, ids, w) in enumerate(_chunk(seed=n_slots, n=n, experts=experts)):
        want = ref(x.to(dtype), ids, w.to(dtype), layer)
        assert torch.equal(loop_outs[layer], want)
        got = outs[layer]
        assert got.dtype == dtype and got.shape == want.shape
        scale = want.abs().max().item()
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * scale)
        else:
            torch.testing.assert_close(got.float(), want.float(), rtol=2**-6, atol=2**-6 * scale)
    for name in ("table", "slot_owner", "last_use", "step"):
        assert torch.equal(getattr(table, name), getattr(loop_table, name)), name
    assert dataclasses.asdict(stats) == dataclasses.asdict(loop_stats)


def test_grouped_streamer_in_triton_interpreter() -> None:
    run_in_interpreter(__file__)


if __name__ == "__main__":  # the interpreter test's child
    for state, n_slots in CASES:
        compare_kernels(state, n_slots, torch.float32)
    compare_kernels("some", 2 * E + 5, torch.float32, n=3, experts=5)  # experts 5..7 never routed
    compare_kernels("some", 2 * E + 5, torch.bfloat16)
    print("ok")


def test_spare_empty_slots_keep_streamed_experts_for_the_next_chunk() -> None:
    """A pool larger than the buffers, empty at first: the first chunk keeps every expert it
    streams (the first layers in the spare slots, the last two in the buffers), so the second
    chunk reads most of them in place; outputs stay the reference's bit for bit."""
    banks = _banks(seed=6)
    ref = TorchExpertExecutor(banks)
    n_slots = 4 * E + 4  # 2E buffers + 2E + 4 spare: more than the L * E = 3E experts
    slots = ExpertSlots(tuple(banks.w13.shape[1:]), tuple(banks.w2.shape[1:]), banks.w13.dtype, n_slots)
    table = CacheTable(L, E, n_slots)
    streamer = PrefillStreamer(banks, slots, table)
    counts = []
    for seed in (1, 2):
        before = streamer.stats
        for layer, (x, ids, w) in enumerate(_chunk(seed)):
            nxt = layer + 1 if layer + 1 < L else None
            assert torch.equal(streamer.layer(x, ids, w, layer, nxt), ref(x, ids, w, layer))
        streamer.finish()
        assert table.invariant_errors() == [] and table.reserved() == []
        _check_pool(table, slots, banks)
        after = streamer.stats
        counts.append((after.streamed - before.streamed, after.in_place - before.in_place))
        if seed == 1:  # every expert stayed: 2E + 4 in spare slots, the rest in the buffers
            assert sorted(table.resident()) == list(range(L * E))
    # chunk 1 streams all 3E; chunk 2 reserves its buffers from the 2E + 4 - E = E + 4 empty slots
    # and the E - 4 oldest resident (all equally fresh: lowest slots first), so only those E - 4
    # experts are streamed again (without the spare slots only the last two layers would have
    # stayed: E streamed again, 2E in place)
    assert counts == [(L * E, 0), (E - 4, L * E - (E - 4))]
