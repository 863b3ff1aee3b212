"""A plain-Python model of the expert-cache policy that engine/gpu/plan.py implements with
tensors, written from the policy's description (dicts and sorted(), no tensors), for the
property tests to compare against."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


def ref_fetch_count(m: int, ratio: float) -> int:
    if m == 0 or ratio == 0:
        return 0
    return min(max(round(m * ratio), 1), m)


@dataclass
class RefStep:
    slot_ids: list[list[int]]
    copies: list[tuple[int, int]]  # (flat expert id, slot) in fetch order
    hits: int
    misses: int
    fetched: int


@dataclass
class RefCache:
    layers: int
    experts: int
    slots: int
    table: dict[int, int] = field(default_factory=dict)  # flat id -> slot
    owner: dict[int, int] = field(default_factory=dict)  # slot -> flat id
    last: dict[int, int] = field(default_factory=dict)  # slot -> step of last use
    step: int = 0

    def plan(self, layer: int, ids: list[list[int]], ratio: float) -> RefStep:
        E = self.experts
        counts = Counter(e for row in ids for e in row)
        hits = [e for e in counts if layer * E + e in self.table]
        misses = sorted((e for e in counts if layer * E + e not in self.table), key=lambda e: (-counts[e], e))
        q = min(ref_fetch_count(len(misses), ratio), self.slots - len(hits))
        self.step += 1
        protected = {self.table[layer * E + e] for e in hits}

        def age(s: int) -> tuple[int, int]:
            return (self.last[s] if s in self.owner else -1, s)

        victims = sorted((s for s in range(self.slots) if s not in protected), key=age)
        copies = []
        for e, s in zip(misses[:q], victims, strict=False):
            if s in self.owner:
                del self.table[self.owner[s]]
            flat = layer * E + e
            self.table[flat], self.owner[s], self.last[s] = s, flat, self.step
            copies.append((flat, s))
        for e in hits:
            self.last[self.table[layer * E + e]] = self.step
        slot_ids = [[self.table.get(layer * E + e, -1) for e in row] for row in ids]
        return RefStep(slot_ids, copies, len(hits), len(misses), q)
