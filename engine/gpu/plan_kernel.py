"""The decode step's cache plan (engine/gpu/plan.py's `plan_layer`) as one Triton kernel.

Contract: `plan_layer_fused(state, layer, ids, ratio, counters)` computes exactly what
`plan_layer(state, layer, ids, ratio)` does (the same `LayerPlan` values and the same updates of
the cache table, slot owners, LRU timestamps and step counter; the CPU and CUDA tests compare the
two over long random call sequences) and adds (hits, misses, fetched, split experts) to `counters`
([4] int64, when given), in one launch instead of ~25 small kernels. One program does it all: the routed entries' histogram,
the hit / miss split, q* (round half to even of m * ratio, at least 1, at most m, at most the
takeable slots), the victims and the misses to fetch chosen by K rounds of "first smallest key"
(K = min(S, E, N*k) unrolled rounds, of which only the first q do any work: 2-3 at batch 1;
the skipped ones cost a branch instead of three reductions over the slots), and the writes. The hits are
marked in `last_use` first (a value the victim order never takes) and the program waits at a
barrier before reading the slot keys, so the hits are protected without a scratch buffer.
Otherwise no value the program writes is read back from memory: the program's warps run apart
between barriers, so a read after another warp's write of the same address is a race (the step
counter and the running counters are read at the start and written after a final barrier; a
victim's old owner comes from the owners read before the rounds).
With `split=(units, rows)` and `scratch` it computes what `plan_layer(..., split, scratch)` does
(q and the split expert of `split_share`; one more round picks the split expert).
`fusable(state, ids)` says whether the sizes fit one program (slots up to 16384, up to 16 routed
entries: the rounds are unrolled), and so whether the device step uses it.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from engine.gpu.cache_table import CacheTable
from engine.gpu.plan import _NEVER, LayerPlan
from engine.gpu.policy import check_ratio

_MAX_SLOTS = 16384
_MAX_ENTRIES = 16
_BIG = 2**62  # above every key: padding, and positions already chosen


@functools.cache
def _ratio_tensor(ratio: float, device: torch.device) -> torch.Tensor:
    """The ratio as a float64 device scalar, made once (on a step's first, eager call: never while
    a graph is being captured, where a host-to-device copy could not be recorded)."""
    return torch.tensor([ratio], dtype=torch.float64, device=device)


def fusable(state: CacheTable, ids: torch.Tensor) -> bool:
    """Sizes the kernel serves: it unrolls K = min(S, E, N*k) rounds of two reductions over the
    slots and experts, which suits batch-1 decode (K = k); past 16 entries the torch plan's top-k
    selections are the better tool. (The rounding of q* compares with q + 0.5 rather than
    subtracting: on the H200 the compiler once fused a subtraction with the product into an FMA
    and rounded 1.5 down.)"""
    return state.slots <= _MAX_SLOTS and ids.numel() <= _MAX_ENTRIES and state.experts <= 4096


@triton.jit
def _plan_kernel(ids_ptr, table_ptr, owner_ptr, lu_ptr, step_ptr, counters_ptr, call_ptr, slot_ids_ptr, src_ptr,
                 dst_ptr, ratio_ptr, split_ptr,
                 base,
                 NK: tl.constexpr, NK_P: tl.constexpr, E: tl.constexpr, E_P: tl.constexpr, S: tl.constexpr,
                 S_P: tl.constexpr, K: tl.constexpr, NEVER: tl.constexpr, BIG: tl.constexpr,
                 UNITS: tl.constexpr = 0, ROWS: tl.constexpr = 0, SCRATCH: tl.constexpr = -1):
    ent = tl.arange(0, NK_P)
    ent_ok = ent < NK
    idv = tl.load(ids_ptr + ent, mask=ent_ok, other=-1).to(tl.int64)
    e = tl.arange(0, E_P)
    e_ok = e < E
    # 1. dedupe: a histogram of the routed entries
    counts = tl.sum((idv[None, :] == e[:, None]).to(tl.int64), axis=1)
    present = counts > 0
    row = tl.load(table_ptr + base + e, mask=e_ok, other=-1).to(tl.int64)
    hit = present & (row >= 0)
    miss = present & (row < 0)
    n_hit = tl.sum(hit.to(tl.int64), axis=0)
    m = tl.sum(miss.to(tl.int64), axis=0)
    now = tl.load(step_ptr) + 1
    c = tl.arange(0, 4)
    old_counts = tl.load(counters_ptr + c)
    slot_of = tl.where(hit, row, -1)
    src = tl.full([E_P], -1, tl.int64)
    dst = tl.full([E_P], -1, tl.int64)
    q = m * 0
    split_row = m * 0 - 1
    rem = m * 0
    if S > 0:
        # protect this call's hits: their slot keys read as NEVER (the final last_use comes below)
        tl.store(lu_ptr + row, NEVER, mask=hit)
        tl.debug_barrier()
        s = tl.arange(0, S_P)
        s_ok = s < S
        owner = tl.load(owner_ptr + s, mask=s_ok, other=0)
        lu = tl.load(lu_ptr + s, mask=s_ok, other=0)
        key = tl.where(owner < 0, -1, tl.minimum(lu, NEVER))
        key = tl.where(s_ok, key, BIG)
        takeable = tl.sum((key < NEVER).to(tl.int64), axis=0)
        # 2. q* = min(max(1, round(m * ratio)), m), 0 for ratio 0; at most the takeable slots
        # round half to even, as torch.round (m * ratio >= 0, so truncation is the floor)
        ratio = tl.load(ratio_ptr)  # float64, as the torch plan multiplies (a float argument would be float32)
        # x is compared with q + 0.5, never subtracted from: the GPU compiler contracts x - q into
        # one fused multiply-add of the exact product (5 * 0.3 - 1 = 0.4999..., not the 0.5 the
        # rounded product gives), which rounded 1.5 down on the H200
        x = m.to(tl.float64) * ratio
        if UNITS > 0:
            x = x * UNITS  # split_share: the GPU's share in 1/UNITS of an expert
        q = x.to(tl.int64)
        half = q.to(tl.float64) + 0.5
        q = q + tl.where(x > half, 1, 0) + tl.where((x == half) & (q % 2 == 1), 1, 0)
        if UNITS > 0:
            rem = q % UNITS
            q = tl.minimum(q // UNITS, m)
            rem = tl.where(q < m, rem, 0)
        else:
            q = tl.minimum(tl.maximum(q, 1), m)
            q = tl.where(ratio == 0.0, 0, q)
        q = tl.minimum(q, takeable)
        # 3. misses by tokens descending, then id
        mkey = tl.where(miss, -counts, 1)
        mkey = tl.where(e_ok, mkey, BIG)
        for i in tl.static_range(K + (UNITS > 0)):
            # the split expert: the next miss after the q fetched ones (rem > 0 only when q < m)
            if UNITS > 0:  # noqa: SIM102 - a constexpr test: without a split the block is not compiled
                if (i == q) & (rem > 0):
                    f = tl.argmin(mkey, axis=0, tie_break_left=True).to(tl.int64)
                    split_row = base + f
                    slot_of = tl.where(e == f, SCRATCH, slot_of)
            # only q of the K rounds do anything (2-3 at batch 1): the rest skip their reductions
            if i < q:
                v = tl.argmin(key, axis=0, tie_break_left=True).to(tl.int64)
                f = tl.argmin(mkey, axis=0, tie_break_left=True).to(tl.int64)
                key = tl.where(s == v, BIG, key)
                mkey = tl.where(e == f, BIG, mkey)
                old = tl.sum(tl.where(s == v, owner, 0), axis=0)  # v's owner before this call
                tl.store(table_ptr + old, -1, mask=old >= 0)  # the victim's owner leaves
                tl.store(table_ptr + base + f, v.to(tl.int32))
                tl.store(owner_ptr + v, base + f)
                tl.store(lu_ptr + v, now)
                src = tl.where(e == i, base + f, src)
                dst = tl.where(e == i, v, dst)
                slot_of = tl.where(e == f, v, slot_of)
        tl.store(lu_ptr + row, now, mask=hit)
    tl.store(src_ptr + e, src, mask=e_ok)
    tl.store(dst_ptr + e, dst, mask=e_ok)
    sid = tl.sum(tl.where(idv[None, :] == e[:, None], slot_of[:, None], 0), axis=0)
    tl.store(slot_ids_ptr + ent, tl.where(idv >= 0, sid, -1), mask=ent_ok)
    if UNITS > 0:
        tl.store(split_ptr + c, tl.where(c == 0, split_row, rem * ROWS), mask=c < 2)
    add = tl.where(c == 0, n_hit, tl.where(c == 1, m, tl.where(c == 2, q, (split_row >= 0).to(tl.int64))))
    tl.store(call_ptr + c, add)
    tl.debug_barrier()  # every warp has read the step and the counters before any writes them
    tl.store(step_ptr, now)
    tl.store(counters_ptr + c, old_counts + add)


def plan_layer_fused(state: CacheTable, layer: int, ids: torch.Tensor, ratio: float | torch.Tensor,
                     counters: torch.Tensor | None = None, split: tuple[int, int] | None = None,
                     scratch: int = -1) -> LayerPlan:
    if not 0 <= layer < state.layers:
        raise ValueError(f"MoE layer {layer} out of range [0, {state.layers})")
    if not fusable(state, ids):
        raise ValueError(f"the fused plan serves up to {_MAX_SLOTS} slots and {_MAX_ENTRIES} routed entries")
    E, S, dev = state.experts, state.slots, state.device
    if isinstance(ratio, torch.Tensor):  # a float64 device scalar its owner may rewrite between steps
        # against a tensor's device: the table's own may read "cuda" where tensors read "cuda:0"
        if ratio.dtype != torch.float64 or ratio.numel() != 1 or ratio.device != state.table_flat.device:
            raise ValueError(f"a ratio tensor must be one float64 on {state.table_flat.device}")
        ratio_t = ratio
    else:
        ratio_t = _ratio_tensor(check_ratio(ratio), dev)
    flat = ids.reshape(-1).contiguous()
    nk = flat.numel()
    slot_ids = torch.empty(nk, dtype=torch.int64, device=dev)
    copy_src = torch.empty(E, dtype=torch.int64, device=dev)
    copy_dst = torch.empty(E, dtype=torch.int64, device=dev)
    call = torch.empty(4, dtype=torch.int64, device=dev)
    if counters is None:
        counters = torch.zeros(4, dtype=torch.int64, device=dev)
    if split is not None and scratch < S:
        raise ValueError(f"a split needs a scratch slot past the table's {S}, got {scratch}")
    split_out = torch.full((2,), -1, dtype=torch.int64, device=dev) if split is not None else None
    units, rows = split if split is not None else (0, 0)
    _plan_kernel[(1,)](
        flat, state.table_flat, state.owner_flat, state.last_use_flat, state.step, counters, call, slot_ids, copy_src,
        copy_dst, ratio_t, counters if split_out is None else split_out, layer * E, NK=nk, NK_P=triton.next_power_of_2(max(nk, 2)), E=E,
        E_P=triton.next_power_of_2(max(E, 2)), S=S, S_P=triton.next_power_of_2(max(S, 2)), K=min(S, E, nk),
        NEVER=_NEVER, BIG=_BIG, UNITS=units, ROWS=rows, SCRATCH=scratch, num_warps=8)
    return LayerPlan(slot_ids.view(ids.shape), copy_src, copy_dst, call[0], call[1], call[2], split_out)
