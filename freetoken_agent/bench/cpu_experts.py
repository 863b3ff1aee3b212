"""`freetoken-agent bench cpu-experts`: the native CPU expert executor on a bank of random expert
weights of a real shape, next to the plain-read bound and torch, on the same threads.

One configuration (thread count x ISA) measures three cases, interleaved over several rounds, each
on consecutive expert sets drawn without repeats from a bank far larger than any CPU cache (so
every call streams from DRAM, as a decode step does):
- native: one `moe_layer` call per step (T tokens, top-k experts each);
- read bound: a plain multi-threaded read of exactly the bytes those experts occupy (weights and
  scales), by the same pool with the same chunk hand-out, i.e. the fastest way to merely touch
  them;
- torch: the engine's torch executor (one gathered F.linear pair per expert) with torch's intra-op
  threads set to the same count; bf16 only (torch has no CPU kernel for fp8 / mxfp4 experts).
GB/s counts weight bytes (plus scales) per call; each case reports its best round (shared VMs are
noisy: compare within a row). The fixed per-call cost is measured in C++ (`call_overhead_us`:
pool wake-up, barriers, bookkeeping) and through the Python front end (`python_call_overhead_us`).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

from engine.weights.shapes import SHAPES
from freetoken_agent.argtypes import positive_int
from freetoken_agent.bench.isa import resolve_isas
from freetoken_agent.bench.timing import best_of

NATIVE_FORMATS = ("bf16", "f32")  # the float banks' native executor; every other format runs packed
# the packed formats of engine/quant/formats.py (listed here so defining the parser imports no torch)
PACKED_FORMATS = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_nl",
                  "iq4_xs", "mxfp4", "fp8", "nvfp4")
FORMATS = NATIVE_FORMATS + PACKED_FORMATS


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cpu-experts", help="native CPU expert executor vs plain-read bound vs torch")
    p.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES), help="expert shape (hidden, expert, top-k)")
    p.add_argument("--format", default="bf16", choices=FORMATS,
                   help="expert weight format: bf16 / f32 float banks, or a packed format (GGUF types, fp8, nvfp4, "
                        "mxfp4 as stored; freetoken_agent/bench/packed_experts.py)")
    p.add_argument("--threads", default="0",
                   help="thread count, or a comma list to measure several (0 = one per physical core)")
    p.add_argument("--isa", default="auto", help="SIMD path: auto, all, or a comma list (avx512bf16,avx512,avx2,scalar)")
    p.add_argument("--batch", type=positive_int, default=1, help="tokens per call (default 1: decode)")
    p.add_argument("--bank-gb", type=float, default=0.0,
                   help="bank size in GB (default: min(4, a quarter of available memory))")
    p.add_argument("--seconds", type=float, default=1.0, help="time per case per round")
    p.add_argument("--rounds", type=positive_int, default=3, help="rounds per case; the best is kept")
    p.add_argument("--no-torch", action="store_true", help="skip the torch case")
    p.add_argument("--json", action="store_true", help="print JSON: one object, or a list for several configurations")


def _available_gb() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 1e6
    except OSError:
        pass
    return 8.0


def _python_overhead_us(ft: Any) -> float:
    import torch

    from native.formats import ExpertWeights

    ew = ExpertWeights("f32", torch.full((1, 64, 32), 0.01), torch.full((1, 32, 32), 0.01))
    x, ids, w, out = torch.ones(1, 32), torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, 1), torch.empty(1, 32)
    times = []
    for _ in range(2000):
        t0 = time.perf_counter()
        ft.moe_layer(x, ids, w, ew, out=out)
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2] * 1e6


def run(args: argparse.Namespace) -> int:
    if args.format in PACKED_FORMATS:
        from freetoken_agent.bench.packed_experts import run_packed

        shape = SHAPES[args.shape]
        return run_packed(args, shape.hidden, shape.inter, shape.top_k, args.bank_gb or min(4.0, _available_gb() / 4))
    import torch

    from engine.moe.native import apply_native_options, load_native
    from engine.options import EngineOptions

    ft = load_native()
    apply_native_options(EngineOptions.resolve().native)  # FREETOKEN_NATIVE_PREFETCH etc., as an engine would
    from engine.moe.executor import TorchExpertExecutor
    from engine.weights.layout import ExpertBanks
    from native.formats import random_experts

    shape = SHAPES[args.shape]
    H, inter, k, T = shape.hidden, shape.inter, shape.top_k, args.batch
    if args.format == "mxfp4" and (H % 32 or inter % 32):
        raise ValueError(f"{shape.name} cannot be stored as mxfp4 (sizes must be multiples of 32)")
    threads = [int(t) or ft.physical_cores() for t in args.threads.split(",")]
    isas = resolve_isas(args.isa, ft)

    probe = random_experts(args.format, 1, H, inter)
    per_expert = probe.expert_nbytes()
    bank_gb = args.bank_gb or min(4.0, _available_gb() / 4)
    rows = max(int(bank_gb * 1e9 // per_expert), 4 * k * T)
    if not args.json:
        print(f"bank: {rows} experts of {shape.name} ({H}x{inter}, {args.format}), "
              f"{rows * per_expert / 1e9:.2f} GB, random weights", flush=True)
    bank = random_experts(args.format, rows, H, inter, seed=0)
    gen = torch.Generator().manual_seed(1)
    perm = torch.randperm(rows, generator=gen)
    per_call = k * T if T * k <= rows else rows
    n_sets = rows // per_call
    id_sets = [perm[j * per_call:(j + 1) * per_call].reshape(T, k).contiguous() for j in range(n_sets)]
    bytes_per_call = per_call * per_expert
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    weights = torch.rand(T, k, generator=gen)
    out = torch.empty(T, H, dtype=torch.bfloat16)
    ranges = [[r for e in s.flatten().tolist() for r in bank.expert_ranges(e)] for s in id_sets]
    torch_exec = (TorchExpertExecutor(ExpertBanks(bank.w13, bank.w2, rows))
                  if args.format == "bf16" and not args.no_torch else None)
    step = [0]

    def native() -> None:
        ft.moe_layer(x, id_sets[step[0] % n_sets], weights, bank, out=out)
        step[0] += 1

    def read() -> None:
        ft.read_ranges(ranges[step[0] % n_sets])
        step[0] += 1

    def torch_case() -> None:
        assert torch_exec is not None
        torch_exec(x, id_sets[step[0] % n_sets], weights, 0)
        step[0] += 1

    results = []
    torch_threads = torch.get_num_threads()
    try:
        for n in threads:
            ft.set_num_threads(n)
            torch.set_num_threads(n)
            for isa in isas:
                ft.set_isa(isa)
                cases: dict[str, Callable[[], None]] = {"native": native, "read": read}
                if torch_exec is not None:
                    cases["torch"] = torch_case
                best = best_of(cases, args.rounds, args.seconds)
                gbps = {name: bytes_per_call / s / 1e9 for name, s in best.items()}
                results.append({
                    "shape": shape.name, "format": args.format, "batch": T, "top_k": k, "threads": n,
                    "isa": isa, "pinned": ft.num_pinned(), "bank_gb": round(rows * per_expert / 1e9, 2),
                    "bytes_per_call": bytes_per_call,
                    "weight_gbps": round(gbps["native"], 2), "read_bound_gbps": round(gbps["read"], 2),
                    "torch_gbps": round(gbps["torch"], 2) if "torch" in gbps else None,
                    "fraction_of_bound": round(gbps["native"] / gbps["read"], 3),
                    "speedup_vs_torch": round(best["torch"] / best["native"], 2) if "torch" in best else None,
                    "native_ms": round(best["native"] * 1e3, 3), "read_ms": round(best["read"] * 1e3, 3),
                    "torch_ms": round(best["torch"] * 1e3, 3) if "torch" in best else None,
                    "call_overhead_us": round(ft.call_overhead_us(), 2),
                    "python_call_overhead_us": round(_python_overhead_us(ft), 2),
                })
                if not args.json:
                    _print_row(results[-1], header=len(results) == 1)
    finally:
        ft.set_isa("auto")
        torch.set_num_threads(torch_threads)
    if args.json:
        print(json.dumps(results[0] if len(results) == 1 else results))
    return 0


def _print_row(r: dict[str, Any], header: bool) -> None:
    cols = [("threads", 7), ("isa", 10), ("weight_gbps", 11), ("read_bound_gbps", 15), ("fraction_of_bound", 17),
            ("torch_gbps", 10), ("speedup_vs_torch", 16), ("native_ms", 9), ("call_overhead_us", 16)]
    if header:
        print("  ".join(name.rjust(w) for name, w in cols), flush=True)
    print("  ".join(("-" if r[name] is None else str(r[name])).rjust(w) for name, w in cols), flush=True)
