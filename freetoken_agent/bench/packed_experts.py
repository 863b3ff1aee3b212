"""`freetoken-agent bench cpu-experts --format F` for a packed format (engine/quant/formats.py: q4_k,
q8_0, ..., fp8, nvfp4, mxfp4): the engine's packed expert kernel on a bank of random valid blocks of a
real shape, next to the plain-read bound of the same bytes.

One configuration per thread count measures, interleaved over rounds, each call on consecutive expert
sets drawn without repeats from a bank far larger than the CPU caches (as a decode step streams them):
- packed: one `moe_packed` call per step (T tokens, top-k experts each): the native kernel when it is
  built (native/packed.py), else the torch dequantizing executor (engine/moe/packed.py);
- read bound: the native pool's plain read of exactly those experts' bytes (when the extension is built);
- torch: the torch dequantizing reference, only when the native kernel runs the packed case.
GB/s counts packed weight bytes per call (the bytes the file holds); each case keeps its best round.
`--isa` names the native SIMD paths to time (a comma list, `all`, or `auto`): each is a case of the
same interleaved rounds, one result row per thread count and path.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from freetoken_agent.bench.isa import resolve_isas
from freetoken_agent.bench.timing import best_of


def run_packed(args: argparse.Namespace, hidden: int, inter: int, top_k: int, bank_gb: float) -> int:
    import torch

    from engine.moe.packed import native_moe_packed, torch_moe_packed
    from engine.quant.formats import format_of

    fmt = format_of(args.format)
    rb_gu, rb_d = fmt.row_bytes(hidden, "hidden size"), fmt.row_bytes(inter, "expert intermediate size")
    per_expert = 2 * inter * rb_gu + hidden * rb_d
    T, k = args.batch, top_k
    rows = max(int(bank_gb * 1e9 // per_expert), 4 * k * T)
    kernel = native_moe_packed()
    try:
        from engine.moe.native import load_native

        ft: Any = load_native()
    except Exception:  # no extension: no read bound
        ft = None
    # checked before the bank is made: a path this CPU lacks is an error at once
    isas: list[str | None] = [*resolve_isas(args.isa, ft)] if kernel is not None and ft is not None else [None]
    isa_before = ft.get_isa() if ft is not None else None
    gen = torch.Generator().manual_seed(0)
    gate_up = fmt.random_rows((rows, 2 * inter), hidden, gen)
    down = fmt.random_rows((rows, hidden), inter, gen)
    gscale = torch.ones(rows, 3)
    if not args.json:
        print(f"bank: {rows} experts ({hidden}x{inter}, {fmt.name}, {per_expert} bytes each), "
              f"{rows * per_expert / 1e9:.2f} GB, random blocks; kernel: {'native' if kernel else 'torch'}", flush=True)
    perm = torch.randperm(rows, generator=gen)
    per_call = k * T
    n_sets = rows // per_call
    id_sets = [perm[j * per_call:(j + 1) * per_call].reshape(T, k).to(torch.int32).contiguous() for j in range(n_sets)]
    x = torch.randn(T, hidden, generator=gen).to(torch.bfloat16)
    weights = torch.rand(T, k, generator=gen)
    out = torch.zeros(T, hidden)
    step = [0]

    def call(fn: Any, isa: str | None = None) -> Callable[[], None]:
        def one() -> None:
            if isa is not None:
                ft.set_isa(isa)
            fn(x, id_sets[step[0] % n_sets], weights, gate_up, fmt.name, down, fmt.name, gscale, out)
            step[0] += 1
        return one

    def ranges(ids: torch.Tensor) -> list[tuple[int, int]]:
        return [(t[e].data_ptr(), t[e].numel()) for e in ids.flatten().tolist() for t in (gate_up, down)]

    read_sets = [ranges(s) for s in id_sets] if ft is not None else []

    def read() -> None:
        ft.read_ranges(read_sets[step[0] % n_sets])
        step[0] += 1

    cases: dict[str, Callable[[], None]] = {f"packed:{isa}": call(kernel or torch_moe_packed, isa) for isa in isas}
    if ft is not None:
        cases["read"] = read
    if kernel is not None and not args.no_torch:
        cases["torch"] = call(torch_moe_packed)
    bytes_per_call = per_call * per_expert
    results = []
    torch_threads = torch.get_num_threads()
    default_threads = ft.physical_cores() if ft is not None else torch_threads
    try:
        for n in [int(t) or default_threads for t in args.threads.split(",")]:
            torch.set_num_threads(n)
            if ft is not None:
                ft.set_num_threads(n)
            best = best_of(cases, args.rounds, args.seconds)
            gbps = {name: bytes_per_call / s / 1e9 for name, s in best.items()}
            for isa in isas:
                packed = gbps[f"packed:{isa}"]
                r = {"format": fmt.name, "kernel": "native" if kernel else "torch", "isa": isa, "hidden": hidden,
                     "inter": inter, "batch": T, "top_k": k, "threads": n, "bank_gb": round(rows * per_expert / 1e9, 2),
                     "bytes_per_call": bytes_per_call, "weight_gbps": round(packed, 3),
                     "read_bound_gbps": round(gbps["read"], 2) if "read" in gbps else None,
                     "fraction_of_bound": round(packed / gbps["read"], 3) if "read" in gbps else None,
                     "torch_gbps": round(gbps["torch"], 3) if "torch" in gbps else None,
                     "packed_ms": round(best[f"packed:{isa}"] * 1e3, 3)}
                results.append(r)
                if not args.json:
                    print("  ".join(f"{key}={'-' if v is None else v}" for key, v in r.items()), flush=True)
    finally:
        torch.set_num_threads(torch_threads)
        if isa_before is not None:
            ft.set_isa(isa_before)
    if args.json:
        print(json.dumps(results[0] if len(results) == 1 else results))
    return 0
