"""Device-resident state of the expert cache: which (layer, expert) lives in which slot, and LRU
timestamps.

Contract: `CacheTable(layers, experts, slots, device)` holds
- `table` [layers, experts] int32: slot of each expert, -1 when not resident;
- `slot_owner` [slots] int64: flat id `layer * experts + expert` of the expert in each slot, -1
  when empty;
- `last_use` [slots] int64: value of the step counter when the slot was last hit or filled (-1
  for an empty slot);
- `step` 0-d int64: bumped once per planned layer call (engine/gpu/plan.py), so timestamps order
  every layer call of every decode step (one LRU over all layers).
`table` and `slot_owner` are inverse maps (checked by `invariant_errors()`, host-side, for tests
and debugging). All tensors live on `device`; nothing here synchronises with the host except
`invariant_errors()`, `resident()` and `reserve()`.

Reserved slots (streamed prefill, engine/gpu/prefill.py): `reserve(n)` takes the n least recently
used slots (empty ones first, by index; then by last_use, then index: the decode planner's victim
order), evicts their owners and marks them reserved: `slot_owner` = `reserved_owner` (= the trash
flat id `layers * experts`, so no table entry points at the slot and a stray table write through
it lands in the trash element) and `last_use` = `RESERVED_USE` (int64 max, the key plan_layer
gives protected slots: its victim sort puts reserved slots last, after every empty or filled one,
and never reports them as hits). `register(slots, flat_ids)` turns reserved slots into resident
ones (last_use = the current step); `release(slots)` gives reserved slots back empty. The set of
reserved slots is also kept on the host (`reserved()`), so `register` and `release` validate
their arguments without a device read. Caveat: plan_layer caps its fetches by S - hits, counting
reserved slots as available, so it keeps away from them only while a call fetches at most as many
experts as there are unreserved, unprotected slots (the streamed prefill does not plan at all
while it holds them).

Each backing tensor has one extra trailing "trash" element (not part of the public views): the
planner scatters masked-out writes there, which keeps every update a fixed-shape scatter with no
data-dependent shapes or host synchronisation (what a CUDA graph needs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.gpu.slots import SlotPool
    from engine.weights.layout import ExpertBanks

RESERVED_USE = torch.iinfo(torch.int64).max  # last_use of a reserved slot: never a victim


class CacheTable:
    def __init__(self, layers: int, experts: int, slots: int, device: torch.device | str = "cpu") -> None:
        if layers <= 0 or experts <= 0 or slots < 0:
            raise ValueError(f"bad cache table sizes: layers={layers}, experts={experts}, slots={slots}")
        self.layers, self.experts, self.slots = layers, experts, slots
        self.device = torch.device(device)
        self.table_flat = torch.full((layers * experts + 1,), -1, dtype=torch.int32, device=self.device)
        self.owner_flat = torch.full((slots + 1,), -1, dtype=torch.int64, device=self.device)
        self.last_use_flat = torch.full((slots + 1,), -1, dtype=torch.int64, device=self.device)
        self.step = torch.zeros((), dtype=torch.int64, device=self.device)
        self._reserved: set[int] = set()

    # the public views exclude the trash element
    @property
    def table(self) -> torch.Tensor:
        return self.table_flat[:-1].view(self.layers, self.experts)

    @property
    def slot_owner(self) -> torch.Tensor:
        return self.owner_flat[:-1]

    @property
    def last_use(self) -> torch.Tensor:
        return self.last_use_flat[:-1]

    @property
    def trash_flat_id(self) -> int:
        return self.layers * self.experts

    @property
    def trash_slot(self) -> int:
        return self.slots

    @property
    def reserved_owner(self) -> int:
        """`slot_owner` value of a reserved slot: the trash flat id."""
        return self.layers * self.experts

    def check_matches(self, banks: ExpertBanks, slots: SlotPool) -> None:
        """Raises ValueError unless this table describes `banks` (layers x experts) and `slots`."""
        if self.slots != slots.slots:
            raise ValueError(f"cache table has {self.slots} slots but the pool has {slots.slots}")
        if self.experts != banks.num_experts or self.layers * self.experts != banks.rows:
            raise ValueError("cache table shape does not match the expert banks")
        if self.device != slots.device:
            raise ValueError(f"cache table on {self.device} but slots on {slots.device}")

    def reset(self) -> None:
        """Empties the cache (slot contents become garbage; nothing points at them)."""
        self.table_flat.fill_(-1)
        self.owner_flat.fill_(-1)
        self.last_use_flat.fill_(-1)
        self.step.zero_()
        self._reserved.clear()

    def resident(self) -> dict[int, int]:
        """{flat expert id: slot} of every resident expert (host-side; syncs)."""
        owner = self.slot_owner.tolist()
        return {flat: slot for slot, flat in enumerate(owner) if 0 <= flat < self.reserved_owner}

    def reserved(self) -> list[int]:
        """The reserved slots, ascending (host-side bookkeeping: no device read)."""
        return sorted(self._reserved)

    def reserve(self, n: int, every_empty: bool = False) -> list[int]:
        """Reserves the n least recently used unreserved slots (empty first) and returns them
        ascending; their experts leave the table. With `every_empty`, also every further empty
        slot (so max(n, empty slots) in all). Host-side: reads slot_owner and last_use (a sync).
        Raises ValueError when fewer than n unreserved slots exist."""
        free = self.slots - len(self._reserved)
        if not 0 <= n <= free:
            raise ValueError(f"cannot reserve {n} slots: {free} of {self.slots} are not reserved")
        owner = self.slot_owner.tolist()
        candidates = [s for s in range(self.slots) if s not in self._reserved]
        if every_empty:
            n = max(n, sum(1 for s in candidates if owner[s] < 0))
        if n == 0:
            return []
        last = self.last_use.tolist()
        candidates.sort(key=lambda s: (last[s] if owner[s] >= 0 else -1, s))
        chosen = sorted(candidates[:n])
        evicted = [owner[s] for s in chosen if owner[s] >= 0]
        if evicted:
            self.table_flat[self._index(evicted)] = -1
        idx = self._index(chosen)
        self.owner_flat[idx] = self.reserved_owner
        self.last_use_flat[idx] = RESERVED_USE
        self._reserved.update(chosen)
        return chosen

    def register(self, slots: list[int], flat_ids: list[int]) -> None:
        """Reserved `slots` become resident, holding experts `flat_ids` (which must not be resident
        already), with last_use = the current step (>= 1: call after a step was taken). No sync."""
        if len(slots) != len(flat_ids):
            raise ValueError(f"{len(slots)} slots for {len(flat_ids)} experts")
        self._unreserve(slots)
        if not slots:
            return
        idx = self._index(slots)
        self.table_flat[self._index(flat_ids)] = idx.to(torch.int32)
        self.owner_flat[idx] = self._index(flat_ids)
        self.last_use_flat[idx] = self.step.expand(len(slots))

    def release(self, slots: list[int]) -> None:
        """Reserved `slots` become empty. No sync."""
        self._unreserve(slots)
        if slots:
            idx = self._index(slots)
            self.owner_flat[idx] = -1
            self.last_use_flat[idx] = -1

    def _unreserve(self, slots: list[int]) -> None:
        wrong = [s for s in slots if s not in self._reserved]
        if wrong or len(set(slots)) != len(slots):
            raise ValueError(f"slots {wrong or slots} are not (distinct) reserved slots")
        self._reserved.difference_update(slots)

    def _index(self, values: list[int]) -> torch.Tensor:
        """An int64 index tensor on the device, sent without a host sync (pinned staging on CUDA)."""
        t = torch.tensor(values, dtype=torch.int64)
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t.to(self.device)

    def invariant_errors(self) -> list[str]:
        """Host-side consistency check: empty when table and slot_owner are inverse maps."""
        errors: list[str] = []
        table = self.table.reshape(-1).tolist()
        owner = self.slot_owner.tolist()
        last = self.last_use.tolist()
        step = int(self.step)
        for flat, slot in enumerate(table):
            if slot < -1 or slot >= self.slots:
                errors.append(f"table[{flat}] = {slot} is not a slot")
            elif slot >= 0 and owner[slot] != flat:
                errors.append(f"table[{flat}] = {slot} but slot_owner[{slot}] = {owner[slot]}")
        for slot, flat in enumerate(owner):
            if flat == self.reserved_owner:
                if last[slot] != RESERVED_USE:
                    errors.append(f"slot {slot} is reserved but last_use = {last[slot]}")
                if slot not in self._reserved:
                    errors.append(f"slot {slot} is marked reserved on the device but not on the host")
                continue
            if slot in self._reserved:
                errors.append(f"slot {slot} is reserved on the host but slot_owner[{slot}] = {flat}")
            if flat < -1 or flat >= self.layers * self.experts:
                errors.append(f"slot_owner[{slot}] = {flat} is not an expert")
            elif flat >= 0 and table[flat] != slot:
                errors.append(f"slot_owner[{slot}] = {flat} but table[{flat}] = {table[flat]}")
            if flat >= 0 and not 1 <= last[slot] <= step:
                errors.append(f"slot {slot} is filled but last_use = {last[slot]} (step {step})")
            if flat < 0 and last[slot] != -1:
                errors.append(f"slot {slot} is empty but last_use = {last[slot]}")
        return errors
