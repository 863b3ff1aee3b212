"""The fused plan kernel (engine/gpu/plan_kernel.py) makes exactly the torch plan's decisions
(engine/gpu/plan.py, itself checked against a plain-Python policy model): over random call
streams on twin cache tables (skewed routing for hits, evictions, zero / few / many slots, every
ratio form, reserved slots), every output (slot ids, copy list, hit / miss / fetch counts) and every
state tensor (table, slot owners, LRU timestamps, step) stays equal, and the running counters add
up. On CUDA directly; on a CPU through Triton's interpreter, when triton is installed."""

from __future__ import annotations

import random

import pytest
import torch
from triton_interpreter import run_in_interpreter

from engine.gpu.cache_table import CacheTable
from engine.gpu.plan import plan_layer


def _state_equal(a: CacheTable, b: CacheTable) -> bool:
    """The public state (the trash elements take masked-out writes: their contents mean nothing)."""
    return all(torch.equal(x, y) for x, y in ((a.table, b.table), (a.slot_owner, b.slot_owner),
                                              (a.last_use, b.last_use), (a.step, b.step)))


def check(device: str, configs: list[tuple[int, int, int, int, int]], calls: int, seed: int = 0,
          split: tuple[int, int] | None = None) -> int:
    """configs: (layers, experts, slots, k, max tokens); returns the number of calls compared. With
    `split` (units, rows) both plans split one expert (scratch slot = the table's slot count), and
    the split entries [flat id, rows] are compared too."""
    from engine.gpu.plan_kernel import plan_layer_fused

    rng = random.Random(seed)
    compared = 0
    for layers, experts, slots, k, max_n in configs:
        for ratio in (0.0, 1.0, 0.5, 1 / 3, 0.3, 0.7, rng.random()):  # 0.3 / 0.7: m * ratio hits .5
            ref, got = CacheTable(layers, experts, slots, device), CacheTable(layers, experts, slots, device)
            counters = torch.zeros(4, dtype=torch.int64, device=device)
            totals = [0, 0, 0, 0]
            hot = list(range(min(experts, 2 * k)))
            for call in range(calls):
                if call == calls // 2 and slots >= 4:  # a prefill holds some slots: never victims
                    assert ref.reserve(2) == got.reserve(2)
                layer = rng.randrange(layers)
                n = rng.randint(1, max_n)
                pool = hot if rng.random() < 0.7 and len(hot) >= k else list(range(experts))
                ids = torch.tensor([rng.sample(pool, k) for _ in range(n)], device=device)
                want = plan_layer(ref, layer, ids, ratio, split, slots)
                plan = plan_layer_fused(got, layer, ids, ratio, counters, split, slots)
                names = ("slot_ids", "copy_src", "copy_dst", "hits", "misses", "fetched")
                for name in names + (("split",) if split is not None else ()):
                    assert torch.equal(getattr(plan, name), getattr(want, name)), (name, layers, experts, slots, call)
                assert _state_equal(ref, got), (layers, experts, slots, k, ratio, call)
                totals = [t + int(v) for t, v in zip(totals, want.counts(), strict=True)]
                compared += 1
            assert counters.tolist() == totals
            assert got.invariant_errors() == []
    return compared


@pytest.mark.gpu
def test_fused_plan_equals_torch_plan_cuda() -> None:
    # the Qwen3-30B-A3B shape's layer at a 12 GiB cap, a tiny pool, no pool, and a pool of every expert
    # (up to 16 routed entries: what the fused plan serves)
    configs = [(4, 128, 1100, 8, 2), (3, 16, 5, 4, 4), (2, 8, 0, 2, 2), (2, 8, 16, 2, 4), (3, 256, 700, 8, 1)]
    assert check("cuda", configs, calls=60) == 5 * 7 * 60
    assert check("cuda", configs, calls=60, split=(24, 32)) == 5 * 7 * 60
    assert check("cuda", configs, calls=30, split=(3, 16), seed=1) == 5 * 7 * 30


def test_fused_plan_equals_torch_plan_in_triton_interpreter() -> None:
    run_in_interpreter(__file__)


if __name__ == "__main__":  # the interpreter test's child
    configs = [(2, 8, 5, 2, 3), (2, 8, 0, 2, 2), (3, 6, 18, 3, 2), (2, 16, 11, 4, 2)]
    print(check("cpu", configs, calls=10), check("cpu", configs, calls=8, split=(4, 16)), "ok")
