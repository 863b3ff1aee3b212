"""Where the time of one cached MoE decode layer goes, on a real shape (qwen3-30b-a3b experts,
random bf16 weights, page-locked host banks): the copy engine's PCIe rate, the slot-expert
kernels, the native CPU branch alone, and the whole device step (eager and graph-captured) at a
given cache fraction and fetch ratio. Prints one table; `--json PATH` too. (The retired fetch
kernel and host-node CPU branch, measured against these, are in docs/gpu-tier.md.)

Usage: python -m evals.gpu.step_probe [--layers 8] [--fraction 0.33] [--ratio 0.47] [--threads 8]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from engine.gpu.executor import create_cached_executor
from engine.gpu.kernels import slot_experts
from engine.gpu.setup import pin_in_place
from engine.moe.native import NativeExpertExecutor
from engine.weights.layout import ExpertBanks


def _events_ms(fn, reps: int) -> float:  # type: ignore[no-untyped-def]
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps


def _contention(engine_copy, bytes_per_call: int, cpu, banks, k: int, L: int, E: int,  # type: ignore[no-untyped-def]
                H: int, seconds: float = 1.5) -> dict[str, float]:
    import threading

    def gpu_rate(fn) -> float:  # type: ignore[no-untyped-def]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        calls = 0
        while time.perf_counter() - t0 < seconds:
            for _ in range(10):
                fn()
            torch.cuda.synchronize()
            calls += 10
        return calls * bytes_per_call / (time.perf_counter() - t0) / 1e9

    def cpu_loop(stop: threading.Event, out: list[float]) -> None:
        xc = torch.randn(1, H, dtype=torch.bfloat16)
        g = torch.Generator().manual_seed(1)
        t0 = time.perf_counter()
        calls = 0
        while not stop.is_set():
            cpu(xc, torch.randperm(E, generator=g)[:k][None], torch.rand(1, k), calls % L)
            calls += 1
        out.append(calls * k * banks.expert_bytes / (time.perf_counter() - t0) / 1e9)

    def with_cpu(fn) -> tuple[float, float]:  # type: ignore[no-untyped-def]
        stop, out = threading.Event(), []
        th = threading.Thread(target=cpu_loop, args=(stop, out))
        th.start()
        time.sleep(0.1)
        g = gpu_rate(fn)
        stop.set()
        th.join()
        return g, out[0]

    res: dict[str, float] = {}
    stop, out = threading.Event(), []
    th = threading.Thread(target=cpu_loop, args=(stop, out))
    th.start()
    time.sleep(seconds)
    stop.set()
    th.join()
    res["cpu_alone_gbps"] = round(out[0], 1)
    res["copy_alone_gbps"] = round(gpu_rate(engine_copy), 1)
    g, c = with_cpu(engine_copy)
    res["copy_with_cpu_gbps"], res["cpu_with_copy_gbps"] = round(g, 1), round(c, 1)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--fraction", type=float, default=1 / 3)
    ap.add_argument("--ratio", type=float, default=0.47)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--json", default="")
    ap.add_argument("--connections", type=int, default=0, help="CUDA_DEVICE_MAX_CONNECTIONS (0: leave as is)")
    ap.add_argument("--skip-micro", action="store_true", help="only the whole-step variants")
    ap.add_argument("--variants", default="", help="comma list of step variants to run (default all)")
    ap.add_argument("--tag", default="", help="suffix for the row names")
    ap.add_argument("--trace", default="", help="write a torch.profiler trace of 2 steps of each variant here")
    a = ap.parse_args()
    L, E, H, inter, k = a.layers, a.experts, a.hidden, a.inter, a.top_k
    t0 = time.perf_counter()
    if a.connections:
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = str(a.connections)  # read when CUDA starts, below
    # one layer of random weights, repeated (routing is random anyway; filling 10 GB takes seconds)
    w13 = torch.empty(L * E, 2 * inter, H, dtype=torch.bfloat16)
    w2 = torch.empty(L * E, H, inter, dtype=torch.bfloat16)
    w13[:E].uniform_(-0.03, 0.03)
    w2[:E].uniform_(-0.03, 0.03)
    for layer in range(1, L):
        w13[layer * E:(layer + 1) * E] = w13[:E]
        w2[layer * E:(layer + 1) * E] = w2[:E]
    banks = ExpertBanks(w13, w2, E)
    assert pin_in_place(banks)
    eb = banks.expert_bytes
    rows = {"bank_gb": round(L * E * eb / 1e9, 2), "fill_s": round(time.perf_counter() - t0, 1)}

    rows["connections"] = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "default")
    cpu = NativeExpertExecutor(banks, a.threads)
    if not a.skip_micro:
        _micro(rows, banks, cpu, L, E, H, inter, k)
    _steps(rows, banks, cpu, a, L, E, H, k)
    for key, val in rows.items():
        print(f"{key:32s} {val}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


def _micro(rows, banks, cpu, L, E, H, inter, k) -> None:  # type: ignore[no-untyped-def]
    w13, w2, eb = banks.w13, banks.w2, banks.expert_bytes
    # 1. fetch: 8 experts per call through the copy engine
    n = 8
    slots13 = torch.empty(n, 2 * inter, H, dtype=torch.bfloat16, device="cuda")
    slots2 = torch.empty(n, H, inter, dtype=torch.bfloat16, device="cuda")
    src_list = [list(range(i * 37 % (L * E - n), i * 37 % (L * E - n) + n)) for i in range(20)]
    it = iter(range(10**9))

    def engine_copy() -> None:
        s = src_list[next(it) % 20]
        for j, r in enumerate(s):
            slots13[j].copy_(w13[r], non_blocking=True)
            slots2[j].copy_(w2[r], non_blocking=True)

    rows["copy_engine_gbps"] = round(n * eb / _events_ms(engine_copy, 20) / 1e6, 1)

    # 2. slot experts, batch 1, k entries
    S = 64
    s13 = torch.empty(S, 2 * inter, H, dtype=torch.bfloat16, device="cuda").uniform_(-0.03, 0.03)
    s2 = torch.empty(S, H, inter, dtype=torch.bfloat16, device="cuda").uniform_(-0.03, 0.03)
    for b in (1, 4, 8):
        x = torch.randn(b, H, device="cuda", dtype=torch.bfloat16)
        ids = torch.stack([torch.randperm(E, device="cuda")[:k] for _ in range(b)])
        sl = ids % S
        w = torch.rand(b, k, device="cuda", dtype=torch.bfloat16)
        ms = _events_ms(lambda: slot_experts(x, ids, sl, w, s13, s2), 50)  # noqa: B023
        distinct = len(set(sl.flatten().tolist()))
        rows[f"slot_experts_b{b}_us"] = round(ms * 1e3, 1)
        rows[f"slot_experts_b{b}_gbps"] = round(b * k * eb / ms / 1e6, 1)
        rows[f"slot_experts_b{b}_distinct"] = distinct

    # 3. the CPU branch alone (native, k entries, batch 1)
    xc = torch.randn(1, H, dtype=torch.bfloat16)
    t = []
    for i in range(30):
        ids = torch.randperm(E)[:k][None]
        t0 = time.perf_counter()
        cpu(xc, ids, torch.rand(1, k), i % L)
        t.append(time.perf_counter() - t0)
    t.sort()
    rows["cpu_layer_us_k8"] = round(t[len(t) // 2] * 1e6, 1)
    rows["cpu_gbps_k8"] = round(k * eb / t[len(t) // 2] / 1e9, 1)

    # 4. contention: PCIe fetches and the CPU experts at the same time
    rows.update(_contention(engine_copy, n * eb, cpu, banks, k, L, E, H))



def _steps(rows, banks, cpu, a, L, E, H, k) -> None:  # type: ignore[no-untyped-def]
    eb = banks.expert_bytes
    # 5. the whole device step per layer: all resident, PCIe only, CPU only, the split; graph / eager
    variants = [("resident", 1.0, 1.0, True), ("pcie", a.fraction, 1.0, True), ("cpu", a.fraction, 0.0, True),
                ("split", a.fraction, a.ratio, True), ("split_eager", a.fraction, a.ratio, False)]
    wanted = set(a.variants.split(",")) if a.variants else None
    for name, fraction, ratio, graphs in variants:
        if wanted is not None and name not in wanted:
            continue
        ex = create_cached_executor(banks, int(fraction * L * E) * eb, "cuda", ratio, cpu, graphs=graphs)
        g = torch.Generator().manual_seed(0)
        steps = [(torch.randn(1, H, generator=g).bfloat16().cuda(),
                  torch.randperm(E, generator=g)[:k][None].cuda(), torch.rand(1, k, generator=g).bfloat16().cuda())
                 for _ in range(64)]
        warm = 4 if name != "resident" else 64  # resident: let every routed expert in first
        for s in range(warm):
            for layer in range(L):
                ex(*steps[s % 64], layer)
        torch.cuda.synchronize()
        c0 = ex._counts.clone()
        t0 = time.perf_counter()
        host = 0.0
        for s in range(4, 64):
            for layer in range(L):
                h0 = time.perf_counter()
                ex(*steps[s], layer)
                host += time.perf_counter() - h0
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        ex.check()
        hits, misses, fetched, _ = (ex._counts - c0).tolist()
        calls = 60 * L
        if a.trace:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for s in range(2):
                    for layer in range(L):
                        ex(*steps[s], layer)
                torch.cuda.synchronize()
            prof.export_chrome_trace(os.path.join(a.trace, f"trace_{name}{a.tag}.json"))
        name = name + a.tag
        rows[f"{name}_us_per_layer"] = round(dt / calls * 1e6, 1)
        rows[f"{name}_host_us_per_layer"] = round(host / calls * 1e6, 1)
        rows[f"{name}_hit_rate"] = round(hits / max(1, hits + misses), 3)
        rows[f"{name}_fetched_per_layer"] = round(fetched / calls, 2)
        rows[f"{name}_cpu_per_layer"] = round((misses - fetched) / calls, 2)
        ex.close()
        del ex
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
