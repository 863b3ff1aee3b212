"""Time the decode step's gate/up slot GEMV (engine/gpu/kernels.py `_gate_up_kernel`) reduced across
lanes every step (its form before the sixth session) against its REDUCE_ONCE form (a [BLOCK_I,
BLOCK_H] tile accumulated and reduced once after the loop; expert_rows runs [16, 128]) at several
block shapes, on one layer of each shape at batch 1 with 5 of 8 entries in slots.
Prints us per call and the weight bytes' GB/s, and the variants' largest difference (float32 sum
order only). Usage on the GPU machine: python evals/gpu/gemv_probe.py"""

from __future__ import annotations

import functools

import torch
import triton

from engine.gpu import kernels
from evals.gpu.step_probe import _events_ms


def main() -> None:
    print("| shape | kernel | BLOCK_I x BLOCK_H, warps | us / call | GB/s | max |diff| vs the first row |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, hidden, inter in (("qwen3.6-35b-a3b", 2048, 512), ("qwen3-30b-a3b", 2048, 768)):
        k, slots = 8, 64
        w13 = torch.randn(slots, 2 * inter, hidden, device="cuda").bfloat16() / 32
        x = torch.randn(1, hidden, device="cuda").bfloat16()
        slot_ids = torch.tensor([3, -1, 17, 40, -1, 9, -1, 55], device="cuda")
        h = torch.empty(k, inter, dtype=torch.bfloat16, device="cuda")
        nbytes = 5 * 2 * inter * hidden * 2
        runs = [("reduce each step", False, 16, 256, 4)]
        runs += [("reduce once", True, bi, bh, w) for bi, bh, w in ((16, 256, 4), (8, 256, 4), (16, 128, 4),
                                                                       (32, 128, 8), (8, 512, 4))]
        ref = None
        for label, once, bi, bh, warps in runs:
            grid = (k, triton.cdiv(inter, bi))
            call = functools.partial(kernels._gate_up_kernel[grid], x, slot_ids, w13, h, slot_ids, slot_ids, hidden, inter, K=k,
                                     BLOCK_I=bi, BLOCK_H=bh, REDUCE_ONCE=once, num_warps=warps)
            call()
            out = h.float().clone()
            ref = out if ref is None else ref
            us = _events_ms(call, 200) * 1e3
            diff = (out - ref).abs().max().item()
            print(f"| {name} | {label} | {bi} x {bh}, {warps} | {us:.1f} | {nbytes / us / 1e3:.0f} | {diff:.2e} |")


if __name__ == "__main__":
    main()
