"""Triton kernels of the GPU expert cache's decode step: the routed experts that run from slots,
and the CPU branch's hand-off. None needs a host synchronisation (host memory is read and written
through its device mapping), so a whole MoE layer can be queued (and captured in a CUDA graph)
without one. (The fetch itself is issued by the host: native/src/dma_fetch.h. A Triton kernel that
copied the experts over PCIe through the banks' device mapping was 6 % slower: docs/gpu-tier.md.)

Contract:
- `slot_experts(x, ids, slot_ids, weights, slots_w13, slots_w2) -> [N, H]`: the sum over the entries
  with a slot (slot_ids >= 0) of weight * down(silu(gate(x)) * up(x)), weights read from the slot
  pool. Each intermediate is rounded to x's dtype where the reference (TorchExpertExecutor: F.linear
  outputs, silu, the product, the weighted output, a running sum in ascending expert id) rounds, so
  bf16 results differ from it only by the order of each dot product's float32 sum. Entries without
  a slot add exact zeros, so the result does not depend on which slot an expert sits in or on how
  many entries went to the CPU: the same routed experts give bit-identical output for any cache
  size. Meant for decode-sized batches (GEMV per entry); prefill uses GEMMs (engine/gpu/grouped.py).
  Its two halves: `expert_rows` (the weighted rows per entry) and `combine_experts` (their ordered
  sum per token, plus the CPU branch's part when given, in one launch).
- `hand_off(x, ids, slot_ids, weights, x_h, ids_h, w_h[, copy_src, copy_dst, copy_h])`: the CPU
  branch's inputs written into page-locked host buffers by one kernel (what were a select, a cast
  and three copies), and the copy list with them (the host issues the fetch).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from engine.options import triton_interpreted

# libdevice's exp (expf's accuracy, as the reference's silu) where a GPU compiles the kernels;
# Triton's interpreter has no libdevice and its tl.exp is numpy's
_LIBDEVICE_EXP = tl.constexpr(not triton_interpreted())


@triton.jit
def _phase_slot(slot_ptr, dst_ptr, e, PHASE: tl.constexpr, COPIES: tl.constexpr, COPIES_P: tl.constexpr,
                SCRATCH: tl.constexpr = -2):
    """Entry e's slot for this phase, and whether the phase writes the entry: PHASE 0 every entry;
    1 the entries whose slot is not being fetched (a fetched one reads as -1: zeros for now);
    2 only the fetched ones (dst_ptr[:COPIES]: the copy list's destinations, -1 padded, and the
    split expert's scratch slot, which the same fetch fills)."""
    s = tl.load(slot_ptr + e)
    go = s == s
    if PHASE != 0:
        c = tl.arange(0, COPIES_P)
        dst = tl.load(dst_ptr + c, mask=c < COPIES, other=-1)
        fetched = ((tl.sum((dst == s).to(tl.int32), axis=0) > 0) & (s >= 0)) | (s == SCRATCH)
        if PHASE == 1:
            s = tl.where(fetched, -1, s)
        else:
            go = fetched
    return s, go


@triton.jit
def _gate_up_kernel(x_ptr, slot_ptr, w13_ptr, h_ptr, dst_ptr, split_ptr, H: tl.constexpr, INTER: tl.constexpr,
                    K: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr, REDUCE_ONCE: tl.constexpr = False,
                    PHASE: tl.constexpr = 0, COPIES: tl.constexpr = 1, COPIES_P: tl.constexpr = 1,
                    SCRATCH: tl.constexpr = -2):
    # REDUCE_ONCE: accumulate a [BLOCK_I, BLOCK_H] tile and reduce it after the loop instead of
    # across lanes every step (evals/gpu/gemv_probe.py times both; expert_rows uses the faster)
    e = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    s, go = _phase_slot(slot_ptr, dst_ptr, e, PHASE, COPIES, COPIES_P, SCRATCH)
    smask = rows < INTER  # rows stored
    rmask = smask
    if SCRATCH >= 0:  # the split expert's scratch slot holds its first split_ptr[1] rows only
        rmask = rmask & (rows < tl.where(s == SCRATCH, tl.load(split_ptr + 1), INTER))
    out_ty = h_ptr.dtype.element_ty
    if go:
        if s < 0:
            tl.store(h_ptr + e * INTER + rows, tl.zeros((BLOCK_I,), dtype=out_ty), mask=smask)
        else:
            t = e // K
            base = w13_ptr + s.to(tl.int64) * (2 * INTER * H)
            acc_g = tl.zeros((BLOCK_I,), dtype=tl.float32)
            acc_u = tl.zeros((BLOCK_I,), dtype=tl.float32)
            tile_g = tl.zeros((BLOCK_I, BLOCK_H), dtype=tl.float32)
            tile_u = tl.zeros((BLOCK_I, BLOCK_H), dtype=tl.float32)
            for h0 in range(0, H, BLOCK_H):
                cols = h0 + tl.arange(0, BLOCK_H)
                cmask = cols < H
                xv = tl.load(x_ptr + t * H + cols, mask=cmask, other=0.0).to(tl.float32)
                m = rmask[:, None] & cmask[None, :]
                wg = tl.load(base + rows[:, None] * H + cols[None, :], mask=m, other=0.0).to(tl.float32)
                wu = tl.load(base + (rows[:, None] + INTER) * H + cols[None, :], mask=m, other=0.0).to(tl.float32)
                if REDUCE_ONCE:
                    tile_g += wg * xv[None, :]
                    tile_u += wu * xv[None, :]
                else:
                    acc_g += tl.sum(wg * xv[None, :], axis=1)
                    acc_u += tl.sum(wu * xv[None, :], axis=1)
            if REDUCE_ONCE:
                acc_g = tl.sum(tile_g, axis=1)
                acc_u = tl.sum(tile_u, axis=1)
            # round where the reference rounds: F.linear outputs, silu, the product
            g = acc_g.to(out_ty).to(tl.float32)
            u = acc_u.to(out_ty).to(tl.float32)
            if _LIBDEVICE_EXP:
                a = (g / (1.0 + libdevice.exp(-g))).to(out_ty).to(tl.float32)
            else:
                a = (g / (1.0 + tl.exp(-g))).to(out_ty).to(tl.float32)
            # rows past the split expert's share read as 0 (masked loads): exact zeros in h
            tl.store(h_ptr + e * INTER + rows, (a * u).to(out_ty), mask=smask)


@triton.jit
def _down_kernel(h_ptr, slot_ptr, w2_ptr, w_ptr, y_ptr, dst_ptr, split_ptr, H: tl.constexpr, INTER: tl.constexpr,
                 BLOCK_O: tl.constexpr, BLOCK_K: tl.constexpr, PHASE: tl.constexpr = 0, COPIES: tl.constexpr = 1,
                 COPIES_P: tl.constexpr = 1, SCRATCH: tl.constexpr = -2):
    e = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
    rmask = rows < H
    s, go = _phase_slot(slot_ptr, dst_ptr, e, PHASE, COPIES, COPIES_P, SCRATCH)
    limit = INTER
    if SCRATCH >= 0:  # the scratch slot's columns past the split share hold older rows: never read
        limit = tl.where(s == SCRATCH, tl.load(split_ptr + 1), INTER)
    out_ty = y_ptr.dtype.element_ty
    if go:
        if s < 0:
            tl.store(y_ptr + e * H + rows, tl.zeros((BLOCK_O,), dtype=out_ty), mask=rmask)
        else:
            base = w2_ptr + s.to(tl.int64) * (H * INTER)
            acc = tl.zeros((BLOCK_O,), dtype=tl.float32)
            for k0 in range(0, INTER, BLOCK_K):
                cols = k0 + tl.arange(0, BLOCK_K)
                cmask = cols < limit
                hv = tl.load(h_ptr + e * INTER + cols, mask=cmask, other=0.0).to(tl.float32)
                w = tl.load(base + rows[:, None] * INTER + cols[None, :], mask=rmask[:, None] & cmask[None, :],
                            other=0.0).to(tl.float32)
                acc += tl.sum(w * hv[None, :], axis=1)
            y = acc.to(out_ty).to(tl.float32)
            wt = tl.load(w_ptr + e).to(tl.float32)
            tl.store(y_ptr + e * H + rows, (y * wt).to(out_ty), mask=rmask)


def expert_rows(x: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor, slots_w13: torch.Tensor,
                slots_w2: torch.Tensor, copy_dst: torch.Tensor | None = None,
                between: Callable[[], None] | None = None, split: torch.Tensor | None = None,
                scratch: int = -2) -> torch.Tensor:
    """[N * k, H]: entry e's weight * expert(x[e // k]) read from its slot, zeros for entries without one.
    With `copy_dst` (the slots a fetch is filling) and `between` (what waits for that fetch: a
    stream wait), the entries in other slots run first, then `between()`, then the fetched ones:
    the same rows, the hits computed while the copies are in flight. With `split` ([2] int64, the
    plan's: flat id, r) and `scratch` (a slot index), entries in the scratch slot are the split
    expert's: only its first r intermediate rows run (the CPU adds the others), after `between()`."""
    n, hidden = x.shape
    k = slot_ids.shape[1]
    inter = slots_w2.shape[2]
    entries = n * k
    x = x.contiguous()
    slot_flat = slot_ids.reshape(-1).contiguous()
    y = torch.empty(entries, hidden, dtype=x.dtype, device=x.device)
    if slots_w13.shape[0] == 0:
        if between is not None:
            between()
        return y.zero_()
    h = torch.empty(entries, inter, dtype=x.dtype, device=x.device)
    w = weights.reshape(-1).to(x.dtype).contiguous()
    phased = copy_dst is not None and between is not None
    dst = copy_dst.contiguous() if copy_dst is not None and phased else slot_flat  # unused in phase 0
    copies = dst.numel() if phased else 1
    split_t = split if split is not None else slot_flat  # unused without a scratch slot
    if split is None:
        scratch = -2
    for phase in ((1, 2) if phased else (0,)):
        if phase == 2:
            assert between is not None
            between()
        # a [16, 128] tile reduced once after the loop: 15 us per Qwen3.6 / Qwen3 layer at batch 1 on
        # the H200 against 21 / 18 us for [16, 256] reduced every step (evals/gpu/gemv_probe.py)
        _gate_up_kernel[(entries, triton.cdiv(inter, 16))](x, slot_flat, slots_w13, h, dst, split_t, hidden, inter,
                                                            K=k, BLOCK_I=16, BLOCK_H=128, REDUCE_ONCE=True,
                                                            PHASE=phase, COPIES=copies,
                                                            COPIES_P=triton.next_power_of_2(copies), SCRATCH=scratch,
                                                            num_warps=4)
        _down_kernel[(entries, triton.cdiv(hidden, 16))](h, slot_flat, slots_w2, w, y, dst, split_t, hidden, inter,
                                                          BLOCK_O=16, BLOCK_K=256, PHASE=phase, COPIES=copies,
                                                          COPIES_P=triton.next_power_of_2(copies), SCRATCH=scratch,
                                                          num_warps=4)
    return y


@triton.jit
def _combine_kernel(y_ptr, ids_ptr, cpu_ptr, out_ptr, H, K: tl.constexpr, K_P: tl.constexpr, HAS_CPU: tl.constexpr,
                    BLOCK_O: tl.constexpr):
    t = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
    rmask = rows < H
    j = tl.arange(0, K_P)
    ids = tl.load(ids_ptr + t * K + j, mask=j < K, other=2**62)  # padding sorts last
    # the rank of each entry among its token's (distinct) ids: the reference adds in ascending id
    rank = tl.sum((ids[None, :] < ids[:, None]).to(tl.int32), axis=1)
    out_ty = out_ptr.dtype.element_ty
    first = tl.sum(tl.where(rank == 0, j, 0))
    acc = tl.load(y_ptr + (t * K + first) * H + rows, mask=rmask, other=0.0).to(tl.float32)
    for p in tl.static_range(1, K):
        e = tl.sum(tl.where(rank == p, j, 0))
        row = tl.load(y_ptr + (t * K + e) * H + rows, mask=rmask, other=0.0).to(tl.float32)
        acc = (acc + row).to(out_ty).to(tl.float32)  # rounded after every add, as the reference's running sum
    if HAS_CPU:
        # page-locked host memory the CPU branch just wrote: a volatile load (relaxed, system scope)
        # reads it again, never a cached line
        cpu = tl.load(cpu_ptr + t * H + rows, mask=rmask, other=0.0, volatile=True).to(tl.float32)
        acc = acc + cpu
    tl.store(out_ptr + t * H + rows, acc.to(out_ty), mask=rmask)


def combine_experts(y: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, cpu: torch.Tensor | None = None) -> None:
    """out [N, H] = the entries' rows y [N * k, H] summed per token in ascending expert id, rounded to
    out's dtype after every add (the reference's running sum), then + cpu [N, H] (the CPU branch's
    part, may live in page-locked host memory) rounded once more: one launch for what was a rank,
    a scatter and k adds."""
    n, k = ids.shape
    hidden = out.shape[1]
    block = 256
    _combine_kernel[(n, triton.cdiv(hidden, block))](y, ids.contiguous(), out if cpu is None else cpu, out, hidden,
                                                       K=k, K_P=triton.next_power_of_2(k), HAS_CPU=cpu is not None,
                                                       BLOCK_O=block, num_warps=4)


def slot_experts(x: torch.Tensor, ids: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor,
                 slots_w13: torch.Tensor, slots_w2: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    combine_experts(expert_rows(x, slot_ids, weights, slots_w13, slots_w2), ids, out)
    return out


@triton.jit
def _handoff_kernel(x_ptr, ids_ptr, slot_ptr, w_ptr, x_h, ids_h, w_h, src_ptr, dst_ptr, copy_h, split_ptr,
                    H: tl.constexpr, K: tl.constexpr, K_P: tl.constexpr, BLOCK_H: tl.constexpr,
                    COPIES: tl.constexpr = 0, COPIES_P: tl.constexpr = 1, SCRATCH: tl.constexpr = -2):
    t = tl.program_id(0)
    for h0 in tl.static_range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        m = cols < H
        tl.store(x_h + t * H + cols, tl.load(x_ptr + t * H + cols, mask=m), mask=m)
    j = tl.arange(0, K_P)
    m = j < K
    ids = tl.load(ids_ptr + t * K + j, mask=m)
    slot = tl.load(slot_ptr + t * K + j, mask=m)
    # the split expert runs on both sides: the CPU takes the rows after the GPU's share
    tl.store(ids_h + t * K + j, tl.where((slot < 0) | (slot == SCRATCH), ids, -1), mask=m)
    tl.store(w_h + t * K + j, tl.load(w_ptr + t * K + j, mask=m).to(tl.float32), mask=m)
    if COPIES > 0:  # noqa: SIM102 - a constexpr test: without a copy list the block is not compiled
        if t == 0:
            c = tl.arange(0, COPIES_P)
            cm = c < COPIES
            tl.store(copy_h + c, tl.load(src_ptr + c, mask=cm), mask=cm)
            tl.store(copy_h + COPIES + c, tl.load(dst_ptr + c, mask=cm), mask=cm)
            if SCRATCH >= 0:  # the split entry follows the list: [flat id or -1, r]
                p = tl.arange(0, 2)
                tl.store(copy_h + 2 * COPIES + p, tl.load(split_ptr + p))


def hand_off(x: torch.Tensor, ids: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor, x_h: torch.Tensor,
             ids_h: torch.Tensor, w_h: torch.Tensor, copy_src: torch.Tensor | None = None,
             copy_dst: torch.Tensor | None = None, copy_h: torch.Tensor | None = None,
             split: torch.Tensor | None = None, scratch: int = -2) -> None:
    """The CPU branch's inputs written straight into its page-locked host buffers (through their
    device mapping) in one launch: x_h = x, ids_h = ids where the entry has no slot (or sits in the
    `scratch` slot: the split expert, both sides run part of it) else -1, w_h = weights as float32,
    and with a copy list, copy_h[:n] = copy_src, copy_h[n:2n] = copy_dst (n = copy_src.numel(): the
    host-issued fetch reads it), then with `split` copy_h[2n:2n + 2] = split. The stream's next
    memory operation (the doorbell's write, which fences) orders these writes before it."""
    n, k = ids.shape
    copies = 0 if copy_src is None else copy_src.numel()
    extra = 2 if split is not None else 0
    if copies:
        assert copy_dst is not None and copy_h is not None and copy_dst.numel() == copies
        assert copy_h.numel() == 2 * copies + extra and copy_h.dtype == torch.int64
    else:
        assert split is None, "the split entry travels with a copy list"
        copy_src = copy_dst = copy_h = ids_h  # unused placeholders (COPIES = 0)
    assert copy_src is not None and copy_dst is not None and copy_h is not None
    if split is None:
        scratch = -2
    _handoff_kernel[(n,)](x.contiguous(), ids.contiguous(), slot_ids.contiguous(), weights.contiguous(), x_h, ids_h,
                          w_h, copy_src.contiguous(), copy_dst.contiguous(), copy_h,
                          copy_h if split is None else split, H=x.shape[1], K=k,
                          K_P=triton.next_power_of_2(k), BLOCK_H=1024, COPIES=copies,
                          COPIES_P=triton.next_power_of_2(max(copies, 1)), SCRATCH=scratch, num_warps=4)
