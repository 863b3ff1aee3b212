"""The split expert of the cache plan (engine/gpu/policy.py `split_share`, engine/gpu/plan.py with
`split`): the GPU's share m * ratio rounded to 1/units of an expert, q whole experts fetched, the
next miss split (its entries sent to the scratch slot, the table unchanged for it), never a hit or
a fetched expert; without a fraction nothing is split. The fused kernel makes the same decisions
(tests/engine/gpu_cache/test_plan_kernel.py)."""

from __future__ import annotations

import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.gpu.cache_table import CacheTable
from engine.gpu.plan import plan_layer
from engine.gpu.policy import split_share


@pytest.mark.parametrize(("m", "ratio", "units", "q", "rem"), [
    (4, 0.47, 24, 1, 21),  # 45.12 units: one expert and 21/24 of the next
    (4, 0.5, 24, 2, 0),  # a whole number of experts: nothing split
    (1, 0.47, 24, 0, 11),  # one miss: part of it on each side (no "at least one fetch")
    (3, 1.0, 24, 3, 0),  # every miss fetched: nothing left to split
    (5, 0.0, 24, 0, 0),  # fetching off
    (0, 0.5, 24, 0, 0),
    (3, 0.5, 2, 1, 1),  # 3 halves: one expert and half of the next
    (1, 0.25, 2, 0, 0),  # half a unit rounds to even: nothing on the GPU
])
def test_split_share(m: int, ratio: float, units: int, q: int, rem: int) -> None:
    got_q, got_rem = split_share(torch.tensor(m), ratio, units)
    assert (int(got_q), int(got_rem)) == (q, rem)


def test_split_plan_sends_one_miss_to_the_scratch_slot() -> None:
    rng = random.Random(4)
    layers, experts, slots, k, units, rows = 3, 16, 6, 4, 8, 16
    state = CacheTable(layers, experts, slots, "cpu")
    split_calls = 0
    for _ in range(300):
        layer = rng.randrange(layers)
        ratio = rng.choice([0.3, 0.47, 0.5, rng.random()])
        ids = torch.tensor([rng.sample(range(experts), k) for _ in range(rng.randint(1, 2))])
        before = state.table[layer].clone()
        plan = plan_layer(state, layer, ids, ratio, (units, rows), slots)
        assert plan.split is not None
        present = set(ids.reshape(-1).tolist())
        misses = {e for e in present if int(before[e]) < 0}
        assert int(plan.misses) == len(misses)
        n_units = round(len(misses) * ratio * units)  # Python's round: half to even, as the plan
        want_q = min(n_units // units, len(misses))
        want_rem = n_units % units if want_q < len(misses) else 0
        assert int(plan.fetched) <= want_q
        flat, gpu_rows = plan.split.tolist()
        if int(plan.fetched) == want_q:  # not capped by the free slots
            assert gpu_rows == want_rem * rows
        fetched = {s - layer * experts for s in plan.copy_src.tolist() if s >= 0}
        if flat < 0:
            assert gpu_rows == 0 and not (plan.slot_ids == slots).any()
            continue
        split_calls += 1
        e = flat - layer * experts
        assert e in misses and e not in fetched and 0 < gpu_rows < units * rows
        assert int(state.table[layer, e]) == -1  # not resident after the call
        assert torch.equal(plan.slot_ids == slots, ids == e)  # its entries, and only those, run from the scratch
        # the others: hits and fetched experts in table slots, the rest on the CPU
        for eid, sid in zip(ids.reshape(-1).tolist(), plan.slot_ids.reshape(-1).tolist(), strict=True):
            if eid != e:
                assert sid == int(state.table[layer, eid]) and sid < slots
    assert split_calls > 50


def test_a_split_needs_a_scratch_slot_past_the_table() -> None:
    state = CacheTable(1, 8, 4, "cpu")
    with pytest.raises(ValueError, match="scratch slot"):
        plan_layer(state, 0, torch.tensor([[1, 2]]), 0.5, (4, 16), 2)


def test_split_switch_is_checked_and_takes_a_slot_for_its_scratch(monkeypatch: pytest.MonkeyPatch) -> None:
    """FREETOKEN_SPLIT_EXPERT: a bad value or a path that cannot split is a ConfigError at start
    (never a silent fallback); the scratch row takes one slot's room of the budget."""
    from engine.errors import ConfigError
    from engine.gpu.executor import create_cached_executor
    from engine.gpu.slots import ExpertSlots
    from engine.weights.layout import ExpertBanks

    banks = ExpertBanks(torch.zeros(2 * 8, 2 * 64, 32), torch.zeros(2 * 8, 32, 64), 8)
    with pytest.raises(ConfigError, match=r"FREETOKEN_SPLIT_EXPERT=1\) needs the fused plan"):
        create_cached_executor(banks, 4 * banks.expert_bytes, "cpu", 0.5, plan="torch", split=True)
    from engine.options import EngineOptions

    with pytest.raises(ConfigError, match="FREETOKEN_SPLIT_EXPERT"):
        EngineOptions.resolve({}, {"FREETOKEN_SPLIT_EXPERT": "sometimes"})
    for raw, want in (("1", True), ("0", False), ("auto", None)):
        assert EngineOptions.resolve({}, {"FREETOKEN_SPLIT_EXPERT": raw}).gpu.split_expert is want
    odd = ExpertBanks(torch.zeros(8, 2 * 48, 32), torch.zeros(8, 32, 48), 8)  # 48 rows: no 32-row steps
    with pytest.raises(ConfigError, match="multiple of 32"):
        create_cached_executor(odd, 4 * odd.expert_bytes, "cpu", 0.5, split=True)
    four = ExpertSlots.from_budget(banks, 4 * banks.expert_bytes, "cpu", scratch=True)
    assert four.slots == 3 and four.scratch == 3 and four.w13.shape[0] == 4
    assert ExpertSlots.from_budget(banks, banks.expert_bytes, "cpu", scratch=True).scratch is None  # no room
    for room in (16, 17):  # every expert fits: nothing misses, no scratch
        every = ExpertSlots.from_budget(banks, room * banks.expert_bytes, "cpu", scratch=True)
        assert every.slots == 16 and every.scratch is None
    # off CUDA nothing splits (the step that would is CUDA-only), and the online ratio stays off
    ex = create_cached_executor(banks, 4 * banks.expert_bytes, "cpu", 0.5, split=True)
    assert not ex.split and not ex.adapt


def test_the_split_is_on_wherever_it_can_run_unless_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """resolve_split: unset, the split is on exactly where every part it needs is (a CUDA pool, the
    fused plan, the native CPU side, divisible experts) and quietly off
    elsewhere; off (FREETOKEN_SPLIT_EXPERT=0) turns it off where it could run, on (=1) insists."""
    from engine.errors import ConfigError
    from engine.gpu.executor import resolve_split
    from engine.weights.layout import ExpertBanks

    banks = ExpertBanks(torch.zeros(2 * 8, 2 * 64, 32, dtype=torch.bfloat16),
                        torch.zeros(2 * 8, 32, 64, dtype=torch.bfloat16), 8)
    fp8 = ExpertBanks(banks.w13.to(torch.float8_e4m3fn), banks.w2.to(torch.float8_e4m3fn), 8)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert resolve_split(None, banks, "fused", cuda, True)
    for why_not in ((banks, "torch", cuda, True), (banks, "fused", cpu, True), (banks, "fused", cuda, False),
                    (fp8, "fused", cuda, True)):
        assert not resolve_split(None, *why_not), why_not
    assert not resolve_split(False, banks, "fused", cuda, True)  # off where it could run
    assert resolve_split(True, banks, "fused", cuda, True)
    with pytest.raises(ConfigError, match="needs the fused plan"):  # on insists
        resolve_split(True, banks, "torch", cuda, True)
    with pytest.raises(ConfigError, match="multiple of 32"):
        resolve_split(True, fp8, "fused", cuda, True)
    assert not resolve_split(False, banks, "torch", cuda, True)


class _HostScalarCopies(TorchDispatchMode):
    """Counts copies whose source is a scalar tensor made from a Python number (`t[i] = 3`): on a
    CUDA tensor PyTorch makes that scalar in host memory, and a CUDA graph capture refuses the copy."""

    def __init__(self) -> None:
        super().__init__()
        self.made: set[int] = set()
        self.kept: list[torch.Tensor] = []
        self.copies: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.scalar_tensor.default:
            self.kept.append(out)  # alive, so no later tensor takes its id
            self.made.add(id(out))
        elif func is torch.ops.aten.copy_.default and id(args[1]) in self.made:
            self.copies.append(str(func))
        return out


@pytest.mark.parametrize("split", [None, (4, 16)])
@pytest.mark.parametrize("slots", [0, 3, 9])
def test_the_torch_plan_copies_no_python_number_into_a_tensor(split: tuple[int, int] | None, slots: int) -> None:
    """The torch plan runs inside the decode pass's CUDA graph for steps of more than 16 entries:
    no `t[i] = number` (the tenth GPU session's failed 4-token capture was `split_out[0] = -1`). On
    the meta device, which like CUDA (unlike the CPU) routes that number through a dispatched scalar
    tensor and a copy: the decisions are not computed, the ops are seen."""
    state = CacheTable(2, 16, slots, "meta")
    scratch = slots if split is not None else -1
    spy = _HostScalarCopies()
    with spy:
        for step in range(4):
            ids = torch.randint(0, 16, (5, 4), generator=torch.Generator().manual_seed(step)).to("meta")
            ratio = 0.5 if step % 2 else torch.tensor([0.5], dtype=torch.float64, device="meta")[0]
            plan_layer(state, step % 2, ids, ratio, split, scratch)
    assert spy.copies == []
    # and the spy does see the pattern it guards against
    with spy:
        t = torch.zeros(2, dtype=torch.int64, device="meta")
        t[0] = -1
    assert spy.copies == ["aten.copy_.default"]


@pytest.mark.parametrize("split", [None, (4, 16)])
@pytest.mark.parametrize("ratio", [0.0, 0.3, 0.47, 0.5, 1.0])
def test_the_torch_plan_reads_a_device_ratio_as_it_reads_a_float(split: tuple[int, int] | None,
                                                                 ratio: float) -> None:
    """The decode step's torch plan takes the executor's online ratio as a float64 0-d tensor (no
    host read inside a capture): the same plans and cache states as with the float, call by call."""
    states = [CacheTable(3, 16, 7, "cpu") for _ in range(2)]
    scratch = 7 if split is not None else -1
    device_ratio = torch.tensor([ratio], dtype=torch.float64)[0]
    rng = random.Random(7)
    for call in range(120):
        n = rng.choice([1, 2, 5])
        ids = torch.tensor([rng.sample(range(16), 4) for _ in range(n)])
        layer = rng.randrange(3)
        a = plan_layer(states[0], layer, ids, ratio, split, scratch)
        b = plan_layer(states[1], layer, ids, device_ratio, split, scratch)
        for name in ("slot_ids", "copy_src", "copy_dst", "hits", "misses", "fetched"):
            assert torch.equal(getattr(a, name), getattr(b, name)), (call, name)
        assert (a.split is None) == (b.split is None)
        assert a.split is None or torch.equal(a.split, b.split), call
    assert torch.equal(states[0].table, states[1].table) and torch.equal(states[0].last_use, states[1].last_use)
