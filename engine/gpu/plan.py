"""The per-layer cache plan of a decode step: dedupe, lookup, q*, victims, state update, id
rewrite, copy list. Fully vectorised: no `.item()`, no Python loop over data, no Python number
written into a tensor (`t[i] = 3` copies a host scalar to the GPU, which a capture refuses), every
output of a fixed shape (padded with -1, counts as 0-d tensors), so it can be captured in a CUDA graph.

Contract: `plan_layer(state, layer, ids, ratio)` for routed ids [N, k] (int, expert ids of MoE
layer `layer`, on `state.device`) and a ratio (a float, or a float64 0-d tensor on that device:
the executor's online one) updates `state` (engine/gpu/cache_table.py) and returns a
`LayerPlan`. The policy, which tests/engine/gpu's pure-Python reference restates:
1. the distinct experts routed in this call are split into hits (resident) and misses (m of them);
2. q = min(fetch_count(m, ratio), slots that may be taken) (engine/gpu/policy.py; hits are never
   evicted within their own call, so at most S - hits slots can be refilled);
3. the misses to fetch are the first q by (tokens routed to them descending, expert id ascending):
   an expert many tokens use costs the CPU most;
4. victims, in one smallest-q selection over the slots: empty slots first (by index), then the least recently used
   (by last_use, then index); slots holding this call's hits are excluded. Fetched expert i goes
   to victim i; the victim's old owner leaves the table;
5. the step counter advances by one; hits and fetched slots get last_use = the new step;
6. `slot_ids` [N, k] int64: each entry's slot when its expert is resident after the update (hits
   and fetched), else -1 (run on the CPU); `copy_src` / `copy_dst` [E] int64: flat expert ids
   (`layer * E + expert`) and their destination slots, the q valid pairs first, padded with -1:
   one batched host->device copy for every bank (engine/gpu/slots.py).
With `split=(units, rows)` and a `scratch` slot (past the table's; gpu.split_expert), step 2
is `split_share`: q whole experts, and the next miss in step 3's order is the split expert, its
first rem * rows intermediate rows fetched into the scratch slot and run there, the others on the
CPU. Its entries' slot id is `scratch`; `LayerPlan.split` = [its flat id, rem * rows] ([-1, 0]
when nothing is split). The table does not change for it: it is not resident after the call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.gpu.cache_table import CacheTable
from engine.gpu.policy import Ratio, fetch_count, split_share

_NEVER = 2**40  # key of protected and reserved slots: never chosen (steps stay far below)


def _smallest(key: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k smallest keys, ascending, ties by lower index (a stable sort's first k):
    one top-k over key * n + index, which is unique."""
    n = key.numel()
    unique = key * n + torch.arange(n, device=key.device)
    return torch.topk(unique, k, largest=False, sorted=True).indices


@dataclass(frozen=True)
class LayerPlan:
    slot_ids: torch.Tensor  # [N, k] int64: slot, or -1 = CPU
    copy_src: torch.Tensor  # [E] int64: flat expert ids to copy, -1 padded
    copy_dst: torch.Tensor  # [E] int64: destination slots, -1 padded
    hits: torch.Tensor  # 0-d int64: distinct routed experts already resident
    misses: torch.Tensor  # 0-d int64: distinct routed experts not resident (m)
    fetched: torch.Tensor  # 0-d int64: q, misses copied in this call (the rest run on the CPU)
    split: torch.Tensor | None = None  # [2] int64: the split expert's flat id (-1: none) and its GPU rows

    def counts(self) -> torch.Tensor:
        """[4] int64 on the device: hits, misses, fetched, split experts (0 or 1)."""
        split = self.split[0] >= 0 if self.split is not None else torch.zeros_like(self.hits, dtype=torch.bool)
        return torch.stack([self.hits, self.misses, self.fetched, split.to(torch.int64)])


def plan_layer(state: CacheTable, layer: int, ids: torch.Tensor, ratio: Ratio,
               split: tuple[int, int] | None = None, scratch: int = -1) -> LayerPlan:
    if not 0 <= layer < state.layers:
        raise ValueError(f"MoE layer {layer} out of range [0, {state.layers})")
    if split is not None and scratch < state.slots:
        raise ValueError(f"a split needs a scratch slot past the table's {state.slots}, got {scratch}")
    E, S, dev = state.experts, state.slots, state.device
    flat = ids.reshape(-1).to(torch.int64)
    # 1. dedupe with a fixed-size histogram (bincount would size its output from the data)
    counts = torch.zeros(E, dtype=torch.int64, device=dev).index_add_(0, flat, torch.ones_like(flat))
    present = counts > 0
    base = layer * E
    row = state.table_flat[base:base + E].to(torch.int64)
    hit = present & (row >= 0)
    miss = present & (row < 0)
    n_hit = hit.sum()
    m = miss.sum()
    state.step.add_(1)
    now = state.step

    copy_src = torch.full((E,), -1, dtype=torch.int64, device=dev)
    copy_dst = torch.full((E,), -1, dtype=torch.int64, device=dev)
    hit_slot = torch.where(hit, row, S)  # trash slot where not a hit
    split_out = None
    if split is not None:
        # [-1, 0] by a device op: `t[0] = -1` on a CUDA tensor copies a host scalar over, which a
        # CUDA graph capture refuses (the tenth GPU session's failed 4-token pass)
        split_out = torch.arange(-1, 1, dtype=torch.int64, device=dev)
    split_e = None
    if S == 0:
        q = torch.zeros_like(m)
    else:
        # q <= m <= distinct experts routed in this call <= min(entries, E), and q <= S: only
        # the first K candidates of each ordering can be taken, so only those are selected
        K = min(S, E, flat.numel())
        # 4. (first: it bounds q) victims: empty (-1) < least recently used < ... ; this call's
        # hits and reserved slots (prefill buffers) never. Keys made unique by the index, so a
        # smallest-K selection gives what a stable sort's first K would.
        protected = torch.zeros(S + 1, dtype=torch.bool, device=dev).index_fill_(0, hit_slot, True)[:S]
        owner = state.owner_flat[:S]
        slot_key = torch.where(owner < 0, -1, state.last_use_flat[:S].clamp(max=_NEVER))
        slot_key = torch.where(protected, _NEVER, slot_key)
        victims = _smallest(slot_key, K)
        # 2. how many misses to fetch: at most one per slot that may be taken
        takeable = (slot_key < _NEVER).sum()
        if split is None:
            q = torch.minimum(fetch_count(m, ratio), takeable)
        else:
            q, rem = split_share(m, ratio, split[0])
            q = torch.minimum(q, takeable)
        # 3. which misses: most tokens first, then lowest id
        miss_key = torch.where(miss, -counts, 1)
        fetch_e = _smallest(miss_key, min(K + (split is not None), E))
        if split is not None:
            assert split_out is not None
            # the next miss after the q fetched ones (q < m whenever rem > 0)
            nxt = fetch_e.gather(0, torch.clamp(q, max=fetch_e.numel() - 1).reshape(1))[0]
            on = rem > 0
            split_e = torch.where(on, nxt, -1)
            split_out = torch.stack([torch.where(on, base + nxt, -1), rem * split[1]])
            fetch_e = fetch_e[:K]
        take = torch.arange(K, device=dev) < q
        new_flat = base + fetch_e
        copy_src[:K] = torch.where(take, new_flat, -1)
        copy_dst[:K] = torch.where(take, victims, -1)
        # evict: the victims' old owners leave the table (masked writes go to the trash element)
        old = owner[victims]
        # (index_fill_ takes -1 as a kernel argument: no host scalar tensor to move to the device)
        state.table_flat.index_fill_(0, torch.where(take & (old >= 0), old, state.trash_flat_id), -1)
        # fill
        dst = torch.where(take, victims, state.trash_slot)
        state.table_flat[torch.where(take, new_flat, state.trash_flat_id)] = victims.to(torch.int32)
        state.owner_flat[dst] = new_flat
        state.last_use_flat[dst] = now.expand(K)
    # 5. hits are used now
    state.last_use_flat[hit_slot] = now.expand(E)
    # 6. rewrite routed ids: resident after the update -> slot, else CPU (-1)
    slot_of = state.table_flat[base:base + E].to(torch.int64)
    slot_ids = slot_of[flat].view(ids.shape)
    if split_e is not None:
        slot_ids = torch.where(flat.view(ids.shape) == split_e, scratch, slot_ids)
    return LayerPlan(slot_ids, copy_src, copy_dst, n_hit, m, q, split_out)
