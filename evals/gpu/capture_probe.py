"""Diagnostic: which part of the cached MoE decode step can be captured in a CUDA graph, per dtype
and slot count (prints OK or the error for each prefix of the step)."""

from __future__ import annotations

import torch

from engine.gpu.executor import create_cached_executor
from engine.gpu.host_fn import launch_host_task
from engine.gpu.plan import plan_layer
from engine.gpu.setup import pin_in_place
from engine.weights.layout import ExpertBanks


def parts(step, layer: int, upto: str) -> None:  # type: ignore[no-untyped-def]
    ex = step.ex
    plan = plan_layer(ex.table, layer, step.ids, ex.ratio)
    if upto == "plan":
        return
    ex._counts += torch.stack([plan.hits, plan.misses, plan.fetched])
    cpu_ids = torch.where(plan.slot_ids < 0, step.ids, -1)
    step.w32.copy_(step.w)
    if upto == "where":
        return
    main = torch.cuda.current_stream()
    step.side.wait_stream(main)
    with torch.cuda.stream(step.side):
        step.ids_h.copy_(cpu_ids, non_blocking=True)
        step.w_h.copy_(step.w32, non_blocking=True)
        step.x_h.copy_(step.x, non_blocking=True)
        if upto != "copies":
            launch_host_task(step._task(layer), step.side)
        step.cpu_out.copy_(step.out_h, non_blocking=True)
    main.wait_stream(step.side)
    if upto in ("copies", "hostfn"):
        return
    step._kernels.fetch_experts(plan.copy_src[:step.copies], plan.copy_dst[:step.copies], ex.banks.w13,
                                ex.banks.w2, ex.slots.w13, ex.slots.w2)
    if upto == "fetch":
        return
    gpu = step._kernels.slot_experts(step.x, step.ids, plan.slot_ids, step.w, ex.slots.w13, ex.slots.w2)
    torch.add(gpu, step.cpu_out, out=step.out)


def main() -> None:
    L, E, H, inter = 3, 16, 256, 96
    for dtype in (torch.float32, torch.bfloat16):
        banks = ExpertBanks(torch.randn(L * E, 2 * inter, H).to(dtype), torch.randn(L * E, H, inter).to(dtype), E)
        pin_in_place(banks)
        for slots in (0, 5):
            ex = create_cached_executor(banks, slots * banks.expert_bytes, "cuda", 0.5, graphs=False)
            x = torch.randn(1, H, dtype=dtype, device="cuda")
            ids = torch.randperm(E)[:4][None].cuda()
            w = torch.rand(1, 4, dtype=dtype, device="cuda")
            ex(x, ids, w, 0)  # eager: creates the step, compiles kernels
            step = ex._steps[1]
            for upto in ("plan", "where", "copies", "hostfn", "fetch", "all"):
                g = torch.cuda.CUDAGraph()
                try:
                    with torch.cuda.graph(g, capture_error_mode="thread_local"):
                        parts(step, 0, upto)
                    g.replay()
                    torch.cuda.synchronize()
                    res = "OK"
                except Exception as exc:
                    res = "ERR " + str(exc).splitlines()[0][:150]
                print(f"capture {dtype!s:15s} slots={slots} upto={upto:7s} {res}", flush=True)


if __name__ == "__main__":
    main()
