"""The expert-cache plan (engine/gpu/plan.py) against a plain-Python model of the same policy
(cache_reference.py) under random id streams, plus its invariants after every call:
table and slot_owner are inverse maps, no slot holds two experts, this call's hits stay resident,
the copy list is exactly the newly resident experts (valid pairs first, then -1 padding), every
rewritten id points at a slot holding that expert, and q follows fetch_count capped by free slots.
Also the q* formula's two forms.
"""

from __future__ import annotations

import pytest
import torch
from cache_reference import RefCache, ref_fetch_count
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.gpu.cache_table import CacheTable
from engine.gpu.plan import plan_layer
from engine.gpu.policy import fetch_count, fetch_ratio

RATIOS = st.one_of(st.sampled_from([0.0, 1.0, 0.5, 0.25, 1 / 3]), st.floats(0.0, 1.0))


@st.composite
def streams(draw: st.DrawFn) -> tuple[int, int, int, float, list[tuple[int, list[list[int]]]]]:
    layers = draw(st.integers(1, 3))
    experts = draw(st.integers(1, 10))
    slots = draw(st.integers(0, layers * experts + 2))
    k = draw(st.integers(1, min(experts, 4)))
    ratio = draw(RATIOS)
    calls = []
    for _ in range(draw(st.integers(1, 25))):
        layer = draw(st.integers(0, layers - 1))
        n = draw(st.integers(1, 4))
        # a small "hot" id range most of the time, so that streams have hits as real routing does
        hi = draw(st.sampled_from([experts - 1, min(experts - 1, k + 1)]))
        rows = [draw(st.lists(st.integers(0, hi), min_size=k, max_size=k, unique=True)) if hi + 1 >= k else
                draw(st.lists(st.integers(0, experts - 1), min_size=k, max_size=k, unique=True)) for _ in range(n)]
        calls.append((layer, rows))
    return layers, experts, slots, ratio, calls


@settings(max_examples=150, deadline=None)
@given(streams())
def test_plan_matches_reference_and_keeps_invariants(stream) -> None:  # type: ignore[no-untyped-def]
    layers, experts, slots, ratio, calls = stream
    state = CacheTable(layers, experts, slots)
    ref = RefCache(layers, experts, slots)
    for layer, rows in calls:
        before = state.resident()
        ids = torch.tensor(rows)
        plan = plan_layer(state, layer, ids, ratio)
        want = ref.plan(layer, rows, ratio)
        after = state.resident()

        # same decisions as the reference policy
        assert plan.slot_ids.tolist() == want.slot_ids
        n = want.fetched
        assert plan.copy_src.tolist() == [f for f, _ in want.copies] + [-1] * (experts - n)
        assert plan.copy_dst.tolist() == [s for _, s in want.copies] + [-1] * (experts - n)
        assert (int(plan.hits), int(plan.misses), int(plan.fetched)) == (want.hits, want.misses, want.fetched)
        assert after == ref.table
        assert int(state.step) == ref.step
        assert {s: v for s, v in enumerate(state.last_use.tolist()) if v >= 0} == ref.last

        # invariants, independent of the reference
        assert state.invariant_errors() == []
        owners = [o for o in state.slot_owner.tolist() if o >= 0]
        assert len(owners) == len(set(owners)), "a slot holds two experts"
        hits = {layer * experts + e for row in rows for e in row} & before.keys()
        assert all(after.get(f) == before[f] for f in hits), "a hit was evicted or moved"
        new = {f: s for f, s in after.items() if f not in before}
        assert dict(zip(plan.copy_src.tolist()[:n], plan.copy_dst.tolist()[:n], strict=True)) == new
        for row, srow in zip(rows, plan.slot_ids.tolist(), strict=True):
            for e, s in zip(row, srow, strict=True):
                assert s == after.get(layer * experts + e, -1)
        m = len({e for row in rows for e in row} - {f - layer * experts for f in before if f // experts == layer})
        assert int(plan.misses) == m
        assert int(plan.fetched) == min(ref_fetch_count(m, ratio), slots - len(hits))


def test_lru_order_and_empty_slots_first() -> None:
    state = CacheTable(1, 6, 3)
    plan_layer(state, 0, torch.tensor([[0]]), 1.0)  # slot 0 <- 0 (empty slots by index)
    plan_layer(state, 0, torch.tensor([[1]]), 1.0)  # slot 1 <- 1
    plan_layer(state, 0, torch.tensor([[0]]), 1.0)  # hit: 0 is now the most recent
    plan_layer(state, 0, torch.tensor([[2]]), 1.0)  # slot 2 <- 2 (empty before any eviction)
    p = plan_layer(state, 0, torch.tensor([[3]]), 1.0)  # evicts 1, the least recently used
    assert p.copy_dst.tolist()[0] == 1 and state.resident() == {0: 0, 3: 1, 2: 2}
    # a hit is never a victim even when it is the oldest: 0 (hit) is older than 2 and 3
    p = plan_layer(state, 0, torch.tensor([[0, 4]]), 1.0)
    assert state.resident()[0] == 0 and p.copy_dst.tolist()[0] == 2


def test_most_used_miss_is_fetched_first() -> None:
    state = CacheTable(1, 8, 4)
    p = plan_layer(state, 0, torch.tensor([[5, 1], [5, 2], [1, 5]]), 0.25)  # m = 3, q = round(0.75) = 1
    assert int(p.fetched) == 1 and p.copy_src.tolist()[0] == 5
    assert p.slot_ids.tolist() == [[0, -1], [0, -1], [-1, 0]]


@given(st.integers(0, 300), RATIOS)
def test_fetch_count(m: int, ratio: float) -> None:
    q = int(fetch_count(torch.tensor(m), ratio))
    assert q == ref_fetch_count(m, ratio)
    assert 0 <= q <= m and (q >= 1 or m == 0 or ratio == 0)


def test_fetch_count_rejects_bad_ratio() -> None:
    with pytest.raises(ValueError):
        fetch_count(torch.tensor(3), 1.5)


@given(st.floats(0.1, 100), st.floats(0.1, 100))
def test_contended_ratio_reduces_to_the_papers_when_the_cpu_saturates_dram(b_p: float, extra: float) -> None:
    # the paper's model: alone the CPU reaches B_H = B_P + extra; with PCIe running it keeps B_H - B_P
    b_h = b_p + extra
    assert fetch_ratio(b_p, b_h - b_p, contended=True) == pytest.approx(fetch_ratio(b_p, b_h, contended=False))


def test_ratio_forms_differ_where_the_cpu_does_not_saturate_dram() -> None:
    # BENCHMARKS.md, 8 threads: PCIe 55 and CPU 50 alone, 52 + 49 together
    assert fetch_ratio(55, 50, contended=False) == 1.0  # every miss over PCIe
    assert fetch_ratio(52, 49) == pytest.approx(52 / 101)
    assert fetch_ratio(0, 0) == 0.0 and fetch_ratio(10, 0) == 1.0


def test_zero_slots_sends_every_miss_to_the_cpu() -> None:
    state = CacheTable(2, 4, 0)
    p = plan_layer(state, 1, torch.tensor([[0, 3]]), 1.0)
    assert p.slot_ids.tolist() == [[-1, -1]] and int(p.fetched) == 0 and p.copy_src.tolist() == [-1] * 4
