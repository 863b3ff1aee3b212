"""Time the decode step's gate/up slot GEMV (engine/gpu/kernels.py `_gate_up_kernel`) against a
variant that accumulates a [BLOCK_I, BLOCK_H] tile and reduces once after the loop (no cross-lane
reduction per iteration), on one layer of each shape at batch 1 with 5 of 8 entries in slots.
Prints us per call and the weight bytes' GB/s, and the variants' largest difference (float32 sum
order only). Usage on the GPU machine: python evals/gpu/gemv_probe.py"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from engine.gpu import kernels


@triton.jit
def _gate_up_tile(x_ptr, slot_ptr, w13_ptr, h_ptr, H, INTER, K: tl.constexpr, BLOCK_I: tl.constexpr,
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
        acc_g = tl.zeros((BLOCK_I, BLOCK_H), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_I, BLOCK_H), dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)
            cmask = cols < H
            xv = tl.load(x_ptr + t * H + cols, mask=cmask, other=0.0).to(tl.float32)
            m = rmask[:, None] & cmask[None, :]
            wg = tl.load(base + rows[:, None] * H + cols[None, :], mask=m, other=0.0).to(tl.float32)
            wu = tl.load(base + (rows[:, None] + INTER) * H + cols[None, :], mask=m, other=0.0).to(tl.float32)
            acc_g += wg * xv[None, :]
            acc_u += wu * xv[None, :]
        g = tl.sum(acc_g, axis=1).to(out_ty).to(tl.float32)
        u = tl.sum(acc_u, axis=1).to(out_ty).to(tl.float32)
        a = (g / (1.0 + libdevice.exp(-g))).to(out_ty).to(tl.float32)
        tl.store(h_ptr + e * INTER + rows, (a * u).to(out_ty), mask=rmask)


def _time(fn, reps: int = 200) -> float:  # type: ignore[no-untyped-def]
    for _ in range(10):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps * 1e3


def main() -> None:
    print("| shape | kernel | BLOCK_I x BLOCK_H, warps | us / call | GB/s | max |diff| vs current |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, hidden, inter in (("qwen3.6-35b-a3b", 2048, 512), ("qwen3-30b-a3b", 2048, 768)):
        k, slots = 8, 64
        w13 = torch.randn(slots, 2 * inter, hidden, device="cuda").bfloat16() / 32
        x = torch.randn(1, hidden, device="cuda").bfloat16()
        slot_ids = torch.tensor([3, -1, 17, 40, -1, 9, -1, 55], device="cuda")
        h = torch.empty(k, inter, dtype=torch.bfloat16, device="cuda")
        nbytes = 5 * 2 * inter * hidden * 2
        runs = [("current", kernels._gate_up_kernel, 16, 256, 4)]
        runs += [("tile", _gate_up_tile, bi, bh, w) for bi, bh, w in ((16, 256, 4), (8, 256, 4), (16, 128, 4),
                                                                         (32, 128, 8), (8, 512, 4))]
        ref = None
        for label, fn, bi, bh, warps in runs:
            grid = (k, triton.cdiv(inter, bi))
            call = functools.partial(fn[grid], x, slot_ids, w13, h, hidden, inter, K=k, BLOCK_I=bi, BLOCK_H=bh,
                                     num_warps=warps)
            call()
            out = h.float().clone()
            ref = out if ref is None else ref
            us = _time(call)
            diff = (out - ref).abs().max().item()
            print(f"| {name} | {label} | {bi} x {bh}, {warps} | {us:.1f} | {nbytes / us / 1e3:.0f} | {diff:.2e} |")


if __name__ == "__main__":
    main()
