"""Rows of a page-locked host table gathered by the GPU (the token embedding under a GPU memory cap,
engine/gpu/setup.py `host_embedding`).

Contract: `gather_rows(ids, table) -> [*ids.shape, H]` on ids' device: table[ids], read through the
table's device mapping by one kernel (one row per token crosses PCIe; no host synchronisation, so
the decode graph captures it). A copy: bit-identical to F.embedding. Ids are validated by the
engine; one out of range gives a zero row here, never a read outside the table.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gather_rows_kernel(ids_ptr, table_ptr, out_ptr, V, H, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    i = tl.load(ids_ptr + t)
    ok = (i >= 0) & (i < V)
    row = tl.load(table_ptr + i.to(tl.int64) * H + cols, mask=(cols < H) & ok, other=0.0)
    tl.store(out_ptr + t.to(tl.int64) * H + cols, row, mask=cols < H)


def gather_rows(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    flat = ids.reshape(-1).contiguous()
    vocab, hidden = table.shape
    out = torch.empty(flat.numel(), hidden, dtype=table.dtype, device=ids.device)
    if flat.numel():
        block = min(1024, triton.next_power_of_2(hidden))
        _gather_rows_kernel[(flat.numel(), triton.cdiv(hidden, block))](flat, table, out, vocab, hidden, BLOCK=block,
                                                                        num_warps=4)
    return out.reshape(*ids.shape, hidden)
