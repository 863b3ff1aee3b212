"""The radix prefix cache (`engine/cache/radix.py`) behaves as its contract says, with fake free
callbacks: match / insert / split, lock and unlock across splits, LRU eviction that never touches
locked nodes or their ancestors, snapshot ownership (attach / displace / evict_state), and
`need_state` matching only at snapshot positions.
"""

from __future__ import annotations

import torch

from engine.cache.radix import RadixCache


class Freed:
    """Fake pool callbacks recording what the cache hands back."""

    def __init__(self) -> None:
        self.kv: list[int] = []
        self.states: list[int] = []

    def free_kv(self, slots: torch.Tensor) -> None:
        self.kv.extend(slots.tolist())

    def free_state(self, slot: int) -> None:
        self.states.append(slot)


def _cache() -> tuple[RadixCache, Freed]:
    freed = Freed()
    return RadixCache(freed.free_kv, freed.free_state), freed


def _slots(*ids: int) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.long)


def _edges(cache: RadixCache) -> dict[tuple[int, ...], list[int]]:
    """Every node as (path tokens) -> its edge's slots."""
    out = {}
    stack = [(cache.root, ())]
    while stack:
        node, path = stack.pop()
        for child in node.children.values():
            p = path + tuple(child.key)
            out[p] = child.value.tolist()
            stack.append((child, p))
    return out


def test_radix_empty_match() -> None:
    cache, _ = _cache()
    m = cache.match([1, 2, 3], 3, need_state=False)
    assert m.length == 0 and m.node is cache.root and m.slots.numel() == 0 and m.state_slot == -1


def test_radix_insert_and_match() -> None:
    cache, freed = _cache()
    node, existing = cache.insert([1, 2, 3, 4], _slots(10, 11, 12, 13))
    assert existing == 0 and node.depth == 4 and cache.cached_tokens == 4
    m = cache.match([1, 2, 3, 4, 5], 5, need_state=False)
    assert m.length == 4 and m.node is node and m.slots.tolist() == [10, 11, 12, 13]
    # limit caps the match even when more is cached
    m = cache.match([1, 2, 3, 4], 3, need_state=False)
    assert m.length == 3 and m.slots.tolist() == [10, 11, 12]
    # a diverging token stops it
    m = cache.match([1, 2, 9, 4], 4, need_state=False)
    assert m.length == 2 and m.slots.tolist() == [10, 11]
    assert cache.match([7, 1, 2], 3, need_state=False).length == 0
    assert freed.kv == [] and cache.cached_tokens == 4


def test_radix_split_and_shared_prefix() -> None:
    cache, _ = _cache()
    cache.insert([1, 2, 3, 4], _slots(10, 11, 12, 13))
    m = cache.match([1, 2, 7], 3, need_state=False)  # splits [1,2,3,4] at 2
    assert m.length == 2 and m.node.key == [1, 2] and m.node.depth == 2
    assert _edges(cache) == {(1, 2): [10, 11], (1, 2, 3, 4): [12, 13]}
    node, existing = cache.insert([1, 2, 5, 6], _slots(90, 91, 20, 21))
    assert existing == 2 and node.depth == 4 and node.value.tolist() == [20, 21]
    assert cache.cached_tokens == 6
    assert _edges(cache) == {(1, 2): [10, 11], (1, 2, 3, 4): [12, 13], (1, 2, 5, 6): [20, 21]}
    # inserting a prefix of a cached path splits it and adds nothing
    node, existing = cache.insert([1, 2, 3], _slots(90, 91, 92))
    assert existing == 3 and node.depth == 3 and cache.cached_tokens == 6
    assert cache.match([1, 2, 3, 4], 4, need_state=False).slots.tolist() == [10, 11, 12, 13]
    assert cache.match([1, 2, 5, 6, 0], 5, need_state=False).slots.tolist() == [10, 11, 20, 21]


def test_radix_lock_survives_split() -> None:
    cache, _ = _cache()
    leaf, _ = cache.insert([1, 2, 3, 4], _slots(10, 11, 12, 13))
    cache.lock(leaf)
    cache.match([1, 2, 9], 3, need_state=False)  # splits the locked edge
    upper = leaf.parent
    assert upper is not None and upper is not cache.root and upper.lock == 1
    cache.unlock(leaf)
    assert leaf.lock == 0 and upper.lock == 0 and cache.root.lock == 1


def test_radix_evict_is_lru() -> None:
    cache, freed = _cache()
    cache.insert([1, 2, 3], _slots(10, 11, 12))
    cache.insert([4, 5], _slots(20, 21))
    cache.insert([6, 7, 8, 9], _slots(30, 31, 32, 33))
    cache.match([1, 2, 3], 3, need_state=False)  # [1,2,3] is now the most recent
    assert cache.evict(1) == 2
    assert freed.kv == [20, 21]
    assert cache.evict(1) == 4
    assert freed.kv == [20, 21, 30, 31, 32, 33]
    assert cache.cached_tokens == 3
    assert cache.match([1, 2, 3], 3, need_state=False).length == 3


def test_radix_evict_walks_up_to_emptied_parents() -> None:
    cache, freed = _cache()
    cache.insert([1, 2, 3], _slots(10, 11, 12))
    cache.insert([1, 2, 4], _slots(10, 11, 22))
    assert cache.cached_tokens == 4
    assert cache.evict(4) == 4
    assert sorted(freed.kv) == [10, 11, 12, 22]
    assert cache.cached_tokens == 0 and not cache.root.children


def test_radix_locked_nodes_and_ancestors_never_evicted() -> None:
    cache, freed = _cache()
    cache.insert([1, 2, 3], _slots(10, 11, 12))
    cache.insert([1, 2, 4], _slots(10, 11, 22))
    cache.insert([5, 6], _slots(50, 51))
    m = cache.match([1, 2, 3], 3, need_state=False)
    cache.lock(m.node)
    assert cache.evict(100) == 3  # [1,2,4]'s leaf and [5,6]
    assert sorted(freed.kv) == [22, 50, 51]
    assert cache.evict(100) == 0
    assert cache.match([1, 2, 3], 3, need_state=False).slots.tolist() == [10, 11, 12]
    cache.unlock(m.node)
    assert cache.evict(100) == 3
    assert sorted(freed.kv) == [10, 11, 12, 22, 50, 51]
    assert cache.cached_tokens == 0


def test_radix_need_state_matches_only_at_snapshots() -> None:
    cache, freed = _cache()
    node, _ = cache.insert([1, 2, 3, 4], _slots(10, 11, 12, 13))
    # no snapshot anywhere: nothing reusable for a recurrent model, everything for attention
    assert cache.match([1, 2, 3, 4, 5], 5, need_state=True).length == 0
    assert cache.attach_state(node, 7) == -1
    assert cache.num_snapshots == 1
    m = cache.match([1, 2, 3, 4, 5], 5, need_state=True)
    assert (m.length, m.state_slot, m.slots.tolist()) == (4, 7, [10, 11, 12, 13])
    # the limit stops before the snapshot, or the tokens diverge before it: nothing
    assert cache.match([1, 2, 3, 4, 5], 3, need_state=True).length == 0
    assert cache.match([1, 2, 3, 9, 5], 5, need_state=True).length == 0
    # a longer path with a snapshot only at its end
    node6, existing = cache.insert([1, 2, 3, 4, 5, 6], _slots(10, 11, 12, 13, 14, 15))
    assert existing == 4
    m = cache.match([1, 2, 3, 4, 5, 6, 0], 7, need_state=True)
    assert (m.length, m.state_slot) == (4, 7)  # falls back to the snapshot at 4
    cache.attach_state(node6, 8)
    m = cache.match([1, 2, 3, 4, 5, 6, 0], 7, need_state=True)
    assert (m.length, m.state_slot) == (6, 8)
    m = cache.match([1, 2, 3, 4, 5, 6], 5, need_state=True)
    assert (m.length, m.state_slot) == (4, 7)
    # splitting an edge keeps its snapshot at the edge's end, never at the cut
    cache.match([1, 2, 9], 3, need_state=False)
    m = cache.match([1, 2, 3, 4, 0], 5, need_state=True)
    assert (m.length, m.state_slot) == (4, 7)
    assert cache.match([1, 2, 0], 3, need_state=True).length == 0
    assert freed.states == []


def test_radix_attach_state_displaces() -> None:
    cache, _ = _cache()
    node, _ = cache.insert([1, 2], _slots(10, 11))
    assert cache.attach_state(node, 3) == -1
    assert cache.attach_state(node, 4) == 3
    assert cache.num_snapshots == 1
    assert cache.match([1, 2, 0], 3, need_state=True).state_slot == 4


def test_radix_evict_state_lru_and_locks() -> None:
    cache, freed = _cache()
    a, _ = cache.insert([1, 2], _slots(10, 11))
    b, _ = cache.insert([3, 4], _slots(30, 31))
    c, _ = cache.insert([5, 6], _slots(50, 51))
    for node, slot in ((a, 1), (b, 2), (c, 3)):
        cache.attach_state(node, slot)
    cache.match([1, 2, 0], 3, need_state=True)  # a is now the most recent; b the least
    cache.lock(b)
    assert cache.evict_state() is True
    assert freed.states == [3]  # c: least recent among the unlocked
    assert cache.evict_state() is True
    assert freed.states == [3, 1]
    assert cache.evict_state() is False  # only b's, locked
    assert cache.num_snapshots == 1 and freed.kv == []
    assert cache.match([3, 4, 0], 3, need_state=True).state_slot == 2
    cache.unlock(b)
    assert cache.evict_state() is True and freed.states == [3, 1, 2]
    assert cache.num_snapshots == 0
    assert cache.match([3, 4, 0], 3, need_state=True).length == 0
    assert cache.match([3, 4, 0], 3, need_state=False).length == 2  # KV stays


def test_radix_evicting_a_leaf_frees_its_snapshot() -> None:
    cache, freed = _cache()
    node, _ = cache.insert([1, 2, 3], _slots(10, 11, 12))
    cache.attach_state(node, 5)
    assert cache.evict(1) == 3
    assert freed.kv == [10, 11, 12] and freed.states == [5] and cache.num_snapshots == 0


def test_radix_reset_frees_everything() -> None:
    cache, freed = _cache()
    node, _ = cache.insert([1, 2, 3], _slots(10, 11, 12))
    cache.insert([1, 2, 4], _slots(10, 11, 22))
    cache.attach_state(node, 6)
    cache.reset()
    assert sorted(freed.kv) == [10, 11, 12, 22] and freed.states == [6]
    assert cache.cached_tokens == 0 and cache.num_snapshots == 0
    assert cache.match([1, 2, 3], 3, need_state=False).length == 0
