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
`invariant_errors()` and `resident()`.

Each backing tensor has one extra trailing "trash" element (not part of the public views): the
planner scatters masked-out writes there, which keeps every update a fixed-shape scatter with no
data-dependent shapes or host synchronisation (what a CUDA graph needs).
"""

from __future__ import annotations

import torch


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

    def reset(self) -> None:
        """Empties the cache (slot contents become garbage; nothing points at them)."""
        self.table_flat.fill_(-1)
        self.owner_flat.fill_(-1)
        self.last_use_flat.fill_(-1)
        self.step.zero_()

    def resident(self) -> dict[int, int]:
        """{flat expert id: slot} of every resident expert (host-side; syncs)."""
        owner = self.slot_owner.tolist()
        return {flat: slot for slot, flat in enumerate(owner) if flat >= 0}

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
            if flat < -1 or flat >= self.layers * self.experts:
                errors.append(f"slot_owner[{slot}] = {flat} is not an expert")
            elif flat >= 0 and table[flat] != slot:
                errors.append(f"slot_owner[{slot}] = {flat} but table[{flat}] = {table[flat]}")
            if flat >= 0 and not 1 <= last[slot] <= step:
                errors.append(f"slot {slot} is filled but last_use = {last[slot]} (step {step})")
            if flat < 0 and last[slot] != -1:
                errors.append(f"slot {slot} is empty but last_use = {last[slot]}")
        return errors
