"""Triton kernels of the GPU expert cache's decode step: the fetch of missed experts into their
slots, and the routed experts that run from slots. Neither reads anything on the host, so a whole
MoE layer can be queued (and captured in a CUDA graph) without a synchronisation.

Contract:
- `fetch_experts(copy_src, copy_dst, banks_w13, banks_w2, slots_w13, slots_w2)`: for every i with
  copy_src[i] >= 0, slot copy_dst[i] of both slot tensors receives bank row copy_src[i]. The banks
  are page-locked host tensors (cudaHostRegister'd in place, engine/gpu/setup.py): the kernel
  reads them over PCIe through their device mapping, so the copy list never has to reach the host.
  Padding entries (-1) cost one program each that exits at once.
- `slot_experts(x, slot_ids, weights, slots_w13, slots_w2) -> [N, H]`: the sum over the entries
  with a slot (slot_ids >= 0) of weight * down(silu(gate(x)) * up(x)), weights read from the slot
  pool. Each intermediate is rounded to x's dtype where the reference (TorchExpertExecutor: F.linear
  outputs, silu, the product, the weighted output, a running sum in ascending expert id) rounds, so
  bf16 results differ from it only by the order of each dot product's float32 sum. Entries without
  a slot add exact zeros, so the result does not depend on which slot an expert sits in or on how
  many entries went to the CPU: the same routed experts give bit-identical output for any cache
  size. Meant for decode-sized batches (GEMV per entry); prefill uses GEMMs (engine/gpu/executor.py).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

_FETCH_BLOCK = 4096
_FETCH_CTAS = int(os.environ.get("FREETOKEN_FETCH_CTAS", "64"))  # read once: fetch_experts runs every layer


@triton.jit
def _fetch_kernel(src_ptr, dst_ptr, bank13, bank2, slot13, slot2, n13, n2, n_chunks, programs,
                  BLOCK: tl.constexpr):
    i = tl.program_id(0)
    src = tl.load(src_ptr + i)
    if src >= 0:
        dst = tl.load(dst_ptr + i)
        for c in range(tl.program_id(1), n_chunks, programs):
            offs = c.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            m13 = offs < n13
            tl.store(slot13 + dst * n13 + offs, tl.load(bank13 + src * n13 + offs, mask=m13), mask=m13)
            m2 = offs < n2
            tl.store(slot2 + dst * n2 + offs, tl.load(bank2 + src * n2 + offs, mask=m2), mask=m2)


def fetch_experts(copy_src: torch.Tensor, copy_dst: torch.Tensor, banks_w13: torch.Tensor, banks_w2: torch.Tensor,
                  slots_w13: torch.Tensor, slots_w2: torch.Tensor) -> None:
    n = copy_src.numel()
    if n == 0 or slots_w13.shape[0] == 0:
        return
    n13 = banks_w13[0].numel()
    n2 = banks_w2[0].numel()
    n_chunks = triton.cdiv(max(n13, n2), _FETCH_BLOCK)
    # A bounded number of programs per copy, each looping over its chunks: enough loads in flight to
    # fill PCIe, without occupying every SM (FREETOKEN_FETCH_CTAS: programs over all copies, 0 = one
    # per chunk). Measured on the H200 (docs/benchmarks.md): one program per chunk takes every SM and
    # delays the CPU branch's small copies behind it; 48-128 programs keep ~47 of 49.5 GB/s.
    programs = n_chunks if _FETCH_CTAS <= 0 else max(1, min(n_chunks, _FETCH_CTAS // n))
    _fetch_kernel[(n, programs)](copy_src, copy_dst, banks_w13, banks_w2, slots_w13, slots_w2, n13, n2, n_chunks,
                                 programs, BLOCK=_FETCH_BLOCK, num_warps=8)


@triton.jit
def _gate_up_kernel(x_ptr, slot_ptr, w13_ptr, h_ptr, H, INTER, K: tl.constexpr, BLOCK_I: tl.constexpr,
                    BLOCK_H: tl.constexpr):
    e = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    rmask = rows < INTER
    s = tl.load(slot_ptr + e)
    out_ty = h_ptr.dtype.element_ty
    if s < 0:
        tl.store(h_ptr + e * INTER + rows, tl.zeros((BLOCK_I,), dtype=out_ty), mask=rmask)
    else:
        t = e // K
        base = w13_ptr + s.to(tl.int64) * (2 * INTER * H)
        acc_g = tl.zeros((BLOCK_I,), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_I,), dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)
            cmask = cols < H
            xv = tl.load(x_ptr + t * H + cols, mask=cmask, other=0.0).to(tl.float32)
            m = rmask[:, None] & cmask[None, :]
            wg = tl.load(base + rows[:, None] * H + cols[None, :], mask=m, other=0.0).to(tl.float32)
            wu = tl.load(base + (rows[:, None] + INTER) * H + cols[None, :], mask=m, other=0.0).to(tl.float32)
            acc_g += tl.sum(wg * xv[None, :], axis=1)
            acc_u += tl.sum(wu * xv[None, :], axis=1)
        # round where the reference rounds: F.linear outputs, silu, the product
        g = acc_g.to(out_ty).to(tl.float32)
        u = acc_u.to(out_ty).to(tl.float32)
        a = (g / (1.0 + libdevice.exp(-g))).to(out_ty).to(tl.float32)
        tl.store(h_ptr + e * INTER + rows, (a * u).to(out_ty), mask=rmask)


@triton.jit
def _down_kernel(h_ptr, slot_ptr, w2_ptr, w_ptr, y_ptr, H, INTER, BLOCK_O: tl.constexpr, BLOCK_K: tl.constexpr):
    e = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
    rmask = rows < H
    s = tl.load(slot_ptr + e)
    out_ty = y_ptr.dtype.element_ty
    if s < 0:
        tl.store(y_ptr + e * H + rows, tl.zeros((BLOCK_O,), dtype=out_ty), mask=rmask)
    else:
        base = w2_ptr + s.to(tl.int64) * (H * INTER)
        acc = tl.zeros((BLOCK_O,), dtype=tl.float32)
        for k0 in range(0, INTER, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            cmask = cols < INTER
            hv = tl.load(h_ptr + e * INTER + cols, mask=cmask, other=0.0).to(tl.float32)
            w = tl.load(base + rows[:, None] * INTER + cols[None, :], mask=rmask[:, None] & cmask[None, :],
                        other=0.0).to(tl.float32)
            acc += tl.sum(w * hv[None, :], axis=1)
        y = acc.to(out_ty).to(tl.float32)
        wt = tl.load(w_ptr + e).to(tl.float32)
        tl.store(y_ptr + e * H + rows, (y * wt).to(out_ty), mask=rmask)


def slot_experts(x: torch.Tensor, ids: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor,
                 slots_w13: torch.Tensor, slots_w2: torch.Tensor) -> torch.Tensor:
    n, hidden = x.shape
    k = slot_ids.shape[1]
    inter = slots_w2.shape[2]
    entries = n * k
    x = x.contiguous()
    slot_flat = slot_ids.reshape(-1).contiguous()
    h = torch.empty(entries, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(entries, hidden, dtype=x.dtype, device=x.device)
    if slots_w13.shape[0] == 0:
        return torch.zeros_like(x)
    _gate_up_kernel[(entries, triton.cdiv(inter, 16))](x, slot_flat, slots_w13, h, hidden, inter, K=k, BLOCK_I=16,
                                                        BLOCK_H=256, num_warps=4)
    w = weights.reshape(-1).to(x.dtype).contiguous()
    _down_kernel[(entries, triton.cdiv(hidden, 16))](h, slot_flat, slots_w2, w, y, hidden, inter, BLOCK_O=16,
                                                      BLOCK_K=256, num_warps=4)
    # the reference's running sum, in ascending expert id per token, rounded after every add; the
    # rank of each entry among its token's (distinct) ids puts it in place without a sort
    rank = (ids[:, :, None] > ids[:, None, :]).sum(dim=2)
    y_sorted = torch.empty_like(y).view(n, k, hidden)
    y_sorted.scatter_(1, rank[:, :, None].expand(n, k, hidden), y.view(n, k, hidden))
    out = y_sorted[:, 0]
    for j in range(1, k):
        out = out + y_sorted[:, j]
    return out
