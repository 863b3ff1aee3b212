"""The overlapped decode's inputs and outputs moved by kernels, not by copies (CUDA only).

Contract: `stage_pass(host, ids, input_ids, positions, new_slots, lengths, table)` writes a staged
pass's inputs (engine/decode_pipeline.py): from `host` [2, n] int64 in page-locked memory (each
row's position and new KV slot, read through its device mapping) and `ids` [n] int64 on the device
(the previous pass's draws) into the decode graph's buffers: input ids, positions, new slots,
lengths (position + 1, int32) and table[row, position] = new slot (int32). `publish_draws(draws,
host, next_ids)` writes draws [n, 2] float64 into `host` (page-locked, read by the host after the
pass's event) and their first column into next_ids [n] int64.

Why kernels: these run while an earlier pass may still wait for the host-issued expert fetch,
whose copies use the copy engines; a kernel reading or writing page-locked memory through its
mapping keeps any copy-engine transfer from queueing behind such a pass and folds the conversions
(int64 positions to the int32 table, float64 draws to int64 ids) into the same launch. Neither
kernel specialises on its arguments: one compiled kernel per BLOCK, loaded before anything is in
flight (a load behind a pass that waits for the host deadlocked in the twelfth GPU session).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# No specialisation on values or alignment: one compiled kernel per BLOCK, whatever the KV table's
# stride (the warm-up's scratch table has stride 1, a value Triton would otherwise bake in) or the
# buffers' addresses, so nothing new is compiled and loaded while a pass is in flight
# (engine/gpu/load_guard.py: the twelfth GPU session's hang)
_STAGE_ARGS = ["host_ptr", "ids_ptr", "input_ids_ptr", "positions_ptr", "new_slots_ptr", "lengths_ptr", "table_ptr"]
_PUBLISH_ARGS = ["draws_ptr", "host_ptr", "next_ids_ptr"]


@triton.jit(do_not_specialize=["table_stride", "n"], do_not_specialize_on_alignment=_STAGE_ARGS)
def _stage_kernel(host_ptr, ids_ptr, input_ids_ptr, positions_ptr, new_slots_ptr, lengths_ptr, table_ptr,
                  table_stride, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    m = i < n
    pos = tl.load(host_ptr + i, mask=m, other=0)
    slot = tl.load(host_ptr + n + i, mask=m, other=0)
    tl.store(input_ids_ptr + i, tl.load(ids_ptr + i, mask=m, other=0), mask=m)
    tl.store(positions_ptr + i, pos, mask=m)
    tl.store(new_slots_ptr + i, slot, mask=m)
    tl.store(lengths_ptr + i, (pos + 1).to(tl.int32), mask=m)
    tl.store(table_ptr + i.to(tl.int64) * table_stride + pos, slot.to(tl.int32), mask=m)


@triton.jit(do_not_specialize=["n"], do_not_specialize_on_alignment=_PUBLISH_ARGS)
def _publish_kernel(draws_ptr, host_ptr, next_ids_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    m = i < n
    index = tl.load(draws_ptr + 2 * i, mask=m, other=0.0)
    valid = tl.load(draws_ptr + 2 * i + 1, mask=m, other=0.0)
    tl.store(host_ptr + 2 * i, index, mask=m)
    tl.store(host_ptr + 2 * i + 1, valid, mask=m)
    tl.store(next_ids_ptr + i, index.to(tl.int64), mask=m)


def stage_pass(host: torch.Tensor, ids: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
               new_slots: torch.Tensor, lengths: torch.Tensor, table: torch.Tensor) -> None:
    n = ids.shape[0]
    if host.shape != (2, n) or not host.is_contiguous() or table.stride(1) != 1:
        raise ValueError(f"staged inputs [2, {n}] contiguous and a row-major table expected, got {tuple(host.shape)}")
    _stage_kernel[(1,)](host, ids, input_ids, positions, new_slots, lengths, table, table.stride(0), n,
                        BLOCK=max(16, triton.next_power_of_2(n)), num_warps=1)


def publish_draws(draws: torch.Tensor, host: torch.Tensor, next_ids: torch.Tensor) -> None:
    n = draws.shape[0]
    if draws.shape != (n, 2) or host.shape != (n, 2) or not (draws.is_contiguous() and host.is_contiguous()):
        raise ValueError(f"draws and their host buffer [{n}, 2] contiguous expected")
    _publish_kernel[(1,)](draws, host, next_ids, n, BLOCK=max(16, triton.next_power_of_2(n)), num_warps=1)
