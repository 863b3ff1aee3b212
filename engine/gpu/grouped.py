"""Grouped routed experts for a large chunk whose experts all sit in slots: two Triton GEMM kernels
over the entries sorted by expert, with no host read and no Python loop over experts.

Contract: `grouped_experts(x [N, H], ids [N, k], weights [N, k], slot_of [E] int64,
slots_w13 [S, 2I, H], slots_w2 [S, H, I], layout=None) -> [N, H]` in x's dtype and device: for
each token the sum over its k entries of weight * down(silu(gate) * up), gate / up = the first /
last I rows of w13 times x (TorchExpertExecutor's convention), expert e's weights read from slot
`slot_of[e]`. Every routed expert must have a slot (slot_of of an expert no token is routed to is
never read); a token's k ids are distinct (top-k routing). `group_entries(ids, slot_of)` is step 1
below on its own (`layout`), for a caller that queues it before waiting for the slots' contents.

How:
1. Bookkeeping with torch ops on the device, every size fixed by the host-known N, k, E and the
   block size: the N*k entries are sorted by expert (stable), each expert's group is padded to a
   multiple of BLOCK_M rows, within M = N*k + E*(BLOCK_M - 1) rows (rounded up to whole blocks);
   `row_entry[r]` is the entry (token * k + j) of padded row r or -1, `block_slot[b]` the slot of
   the expert of block b or -1 for a block past the last group. No synchronisation, so a layer can
   be queued ahead (and captured in a CUDA graph).
2. `_gate_up_kernel`, one program per (block, I-tile): x's rows of the block's entries times the
   expert's gate and up rows, over H, accumulated in float32; writes silu(gate) * up for the
   block's rows.
3. `_down_kernel`, one program per (block, H-tile): that times the expert's w2 over I, float32
   accumulation, times the entry's routing weight; writes the entry's contribution at its entry
   index (so no two programs write the same element).
4. Each token's k contributions are summed in float32 (a torch reduction over k: deterministic, no
   atomics) and rounded once to x's dtype.
Blocks past the last group (and the I / H tiles of them) read their slot id and exit.
Tiles: BLOCK_M rows = the mean group size (N*k / E) as a power of two in [16, 64] (16: tl.dot's
minimum; 64 for dense chunks, e.g. 8192 tokens x top-8 over 128 experts, ~512 rows per expert,
where padding costs < 13%); gate/up: 64 columns of I (each of gate and up: two 64 x 64 float32
accumulators) over H in steps of 64; down: 128 columns of H over I in steps of 64; 4 warps, 3
stages (72 KiB of shared memory for bf16 at BLOCK_M 64; compiled for sm_90: wgmma at BLOCK_M 64,
mma.sync below, cp.async-pipelined loads, no spills). H and I are compile-time constants (one
compilation per model shape) so the K loops have constant bounds (pipelined; and the interpreter's
range() takes them). Program ids run over the tiles of a block first, so consecutive programs
share its gathered rows in L2. Chosen as the usual sizes for bf16 GEMMs of this shape on Hopper,
not yet tuned on the H200.

Rounding: each intermediate is rounded to x's dtype where TorchExpertExecutor rounds it (the gate
and up F.linear outputs, silu, the product, the down F.linear output, the weighted contribution);
only the final sum differs: the reference adds the k contributions into a running sum in x's dtype
(rounded after every add), here they are added in float32 and rounded once. So the float32 result
equals the reference up to summation order, and a bf16 result is within a few bf16 ulps of it.
Dots take x's dtype as input (tensor cores for bf16 / f16) and float32 input with IEEE precision
(no TF32). Under Triton's interpreter (TRITON_INTERPRET=1, the CPU tests) the 16-bit operands are
widened to float32 before the dot, which the interpreter gets wrong for bfloat16; a product of two
16-bit floats is exact in float32, so this only changes the summation order.

Workspace: silu(gate) * up for M rows ([M, I] in x's dtype) and the contributions ([N*k, H] in x's
dtype), plus a few int64 vectors of N*k or M entries.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from engine.options import triton_interpreted

_INTERPRET = triton_interpreted()
# tiles: rows of a block are entries of one expert; N / K tiles over the weights (see block_m)
_GATE_UP_N, _GATE_UP_K = 64, 64  # I-tile (gate and up each: 128 output columns in all), H step
_DOWN_N, _DOWN_K = 128, 64  # H-tile, I step
_WARPS, _STAGES = 4, 3


def block_m(entries: int, experts: int) -> int:
    """Rows per block: about the mean group size (entries / experts), a power of two in [16, 64];
    small chunks waste fewer padded rows, large ones get the bigger tile."""
    mean = -(-entries // max(experts, 1))
    return min(64, max(16, triton.next_power_of_2(mean)))


class GroupedLayout(NamedTuple):
    """The padded expert-sorted layout of a call's entries (module docstring, step 1)."""

    row_entry: torch.Tensor  # [M] int64: entry (token * k + j) of each padded row, -1 for padding
    block_slot: torch.Tensor  # [M / block] int64: slot of each block's expert, -1 past the last group
    block: int  # rows per block (BLOCK_M)


def group_entries(ids: torch.Tensor, slot_of: torch.Tensor) -> GroupedLayout:
    """The layout of `ids` [N, k] for experts in slots `slot_of` [E]: device ops only, every size
    from N, k and E. Separate from the kernels so a caller can queue it before waiting for the
    slots' copies."""
    experts = slot_of.shape[0]
    flat = ids.reshape(-1).to(torch.int64)
    entries = flat.shape[0]
    block = block_m(entries, experts)
    dev = flat.device
    counts = torch.zeros(experts, dtype=torch.int64, device=dev).index_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block - 1) // block * block
    pad_end = torch.cumsum(padded, 0)
    group_start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    sorted_ids = flat[order]
    rank = torch.arange(entries, dtype=torch.int64, device=dev) - group_start[sorted_ids]
    rows = -(-(entries + experts * (block - 1)) // block) * block
    row_entry = torch.full((rows,), -1, dtype=torch.int64, device=dev)
    row_entry[pad_end[sorted_ids] - padded[sorted_ids] + rank] = order
    block_start = torch.arange(0, rows, block, dtype=torch.int64, device=dev)
    expert = torch.searchsorted(pad_end, block_start, right=True)  # E past the last group
    used = expert < experts
    block_slot = torch.where(used, slot_of.to(torch.int64)[expert.clamp(max=experts - 1)], -1)
    return GroupedLayout(row_entry, block_slot, block)


@triton.jit
def _gate_up_kernel(x_ptr, w13_ptr, row_entry_ptr, block_slot_ptr, h_ptr, K,
                    H: tl.constexpr, INTER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, WIDEN: tl.constexpr):
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(INTER, BLOCK_N)
    blk = pid // n_tiles  # consecutive programs share a block's rows of x (L2)
    s = tl.load(block_slot_ptr + blk)
    if s >= 0:
        rows = blk * BLOCK_M + tl.arange(0, BLOCK_M)
        entry = tl.load(row_entry_ptr + rows)
        rmask = entry >= 0
        token = tl.where(rmask, entry // K, 0)
        cols = (pid % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < INTER
        w_base = w13_ptr + s.to(tl.int64) * (2 * INTER * H)
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # H and INTER are constexpr (one compilation per model shape): a for loop over constant
        # bounds is software-pipelined on the GPU, and the interpreter's range() can take them
        for k0 in range(0, H, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            kmask = kk < H
            xt = tl.load(x_ptr + token.to(tl.int64)[:, None] * H + kk[None, :],
                         mask=rmask[:, None] & kmask[None, :], other=0.0)
            wmask = kmask[:, None] & cmask[None, :]
            wg = tl.load(w_base + cols[None, :] * H + kk[:, None], mask=wmask, other=0.0)  # [BLOCK_K, BLOCK_N]
            wu = tl.load(w_base + (cols[None, :] + INTER) * H + kk[:, None], mask=wmask, other=0.0)
            if WIDEN:
                xt, wg, wu = xt.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
            acc_g = tl.dot(xt, wg, acc_g, input_precision=PRECISION)
            acc_u = tl.dot(xt, wu, acc_u, input_precision=PRECISION)
        out_ty = h_ptr.dtype.element_ty
        # round where the reference rounds: the F.linear outputs, silu, the product
        g = acc_g.to(out_ty).to(tl.float32)
        u = acc_u.to(out_ty).to(tl.float32)
        a = (g / (1.0 + tl.exp(-g))).to(out_ty).to(tl.float32)
        tl.store(h_ptr + rows.to(tl.int64)[:, None] * INTER + cols[None, :], (a * u).to(out_ty),
                 mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _down_kernel(h_ptr, w2_ptr, weight_ptr, row_entry_ptr, block_slot_ptr, y_ptr,
                 H: tl.constexpr, INTER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, WIDEN: tl.constexpr):
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(H, BLOCK_N)
    blk = pid // n_tiles
    s = tl.load(block_slot_ptr + blk)
    if s >= 0:
        rows = blk * BLOCK_M + tl.arange(0, BLOCK_M)
        entry = tl.load(row_entry_ptr + rows)
        rmask = entry >= 0
        cols = (pid % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < H
        w_base = w2_ptr + s.to(tl.int64) * (H * INTER)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, INTER, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            kmask = kk < INTER
            ht = tl.load(h_ptr + rows.to(tl.int64)[:, None] * INTER + kk[None, :],
                         mask=rmask[:, None] & kmask[None, :], other=0.0)
            wt = tl.load(w_base + cols[None, :] * INTER + kk[:, None], mask=kmask[:, None] & cmask[None, :],
                         other=0.0)  # [BLOCK_K, BLOCK_N]
            if WIDEN:
                ht, wt = ht.to(tl.float32), wt.to(tl.float32)
            acc = tl.dot(ht, wt, acc, input_precision=PRECISION)
        out_ty = y_ptr.dtype.element_ty
        y = acc.to(out_ty).to(tl.float32)  # the down F.linear output
        wgt = tl.load(weight_ptr + tl.where(rmask, entry, 0), mask=rmask, other=0.0).to(tl.float32)
        tl.store(y_ptr + tl.where(rmask, entry, 0)[:, None] * H + cols[None, :], (y * wgt[:, None]).to(out_ty),
                 mask=rmask[:, None] & cmask[None, :])


def grouped_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, slot_of: torch.Tensor,
                    slots_w13: torch.Tensor, slots_w2: torch.Tensor,
                    layout: GroupedLayout | None = None) -> torch.Tensor:
    """See the module docstring. All tensors on one device; slots in x's dtype. `layout`:
    group_entries(ids, slot_of), when the caller made it already."""
    n, hidden = x.shape
    k = ids.shape[1]
    inter = slots_w2.shape[2]
    if slots_w13.dtype != x.dtype or slots_w2.dtype != x.dtype:
        raise ValueError(f"slots are {slots_w13.dtype}/{slots_w2.dtype}, x is {x.dtype}")
    if slots_w13.shape[1:] != (2 * inter, hidden) or slots_w2.shape[1:] != (hidden, inter):
        raise ValueError(f"slot shapes {tuple(slots_w13.shape)} / {tuple(slots_w2.shape)} do not match H {hidden}")
    if n == 0 or k == 0:
        return torch.zeros_like(x)
    row_entry, block_slot, block = layout if layout is not None else group_entries(ids, slot_of)
    blocks = block_slot.shape[0]
    x = x.contiguous()
    w13, w2 = slots_w13.contiguous(), slots_w2.contiguous()
    flat_w = weights.reshape(-1).contiguous()
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # tf32: Triton's default, unused by 16-bit dots
    widen = _INTERPRET and x.dtype != torch.float32
    h = torch.empty(row_entry.shape[0], inter, dtype=x.dtype, device=x.device)
    _gate_up_kernel[(blocks * triton.cdiv(inter, _GATE_UP_N),)](
        x, w13, row_entry, block_slot, h, k, H=hidden, INTER=inter, BLOCK_M=block, BLOCK_N=_GATE_UP_N,
        BLOCK_K=_GATE_UP_K, PRECISION=precision, WIDEN=widen, num_warps=_WARPS, num_stages=_STAGES)
    y = torch.empty(n * k, hidden, dtype=x.dtype, device=x.device)
    _down_kernel[(blocks * triton.cdiv(hidden, _DOWN_N),)](
        h, w2, flat_w, row_entry, block_slot, y, H=hidden, INTER=inter, BLOCK_M=block, BLOCK_N=_DOWN_N,
        BLOCK_K=_DOWN_K, PRECISION=precision, WIDEN=widen, num_warps=_WARPS, num_stages=_STAGES)
    # every entry's row of y was written (its expert's group is in some block); k adds in float32
    return y.view(n, k, hidden).sum(dim=1, dtype=torch.float32).to(x.dtype)
