"""Microbenchmark of one MoE layer over packed expert banks (native/packed.py), for
`freetoken-agent bench cpu-experts --format F`.

Contract: `bench_packed(fmt, ...)` builds a bank of random valid blocks of an expert shape (default
Qwen3-30B-A3B: hidden 2048, expert 768, top-8) far larger than any CPU cache, then times, over
`rounds` interleaved rounds of at least `seconds` each, (a) one `moe_packed` call per step on
consecutive expert sets without repeats (every call streams its experts from DRAM, as a decode
step does) and (b) the plain-read bound: the pool's multi-threaded read of exactly the same packed
bytes (native/src/read_bound.cpp). Returns a dict: bytes per call, best microseconds per call,
GB/s of packed bytes for both, and their ratio. `python -m native.packed_bench --format q4_k`
prints it as JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import torch

from native import ftnative as ft
from native import packed as pk


def _timed(fn: Callable[[], None], seconds: float) -> float:
    """Seconds per call, over at least `seconds` and 5 calls."""
    fn()
    n, t0 = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        dt = time.perf_counter() - t0
        if n >= 5 and dt >= seconds:
            return dt / n


def bench_packed(fmt: str, fmt_d: str | None = None, threads: int = 0, isa: str = "auto", batch: int = 1,
                 hidden: int = 2048, inter: int = 768, top_k: int = 8, bank_gb: float = 1.0,
                 seconds: float = 0.5, rounds: int = 3) -> dict[str, Any]:
    """See the module docstring. fmt_d: the down projection's format (default fmt); threads 0 = one
    per physical core."""
    fmt_d = fmt_d or fmt
    per_expert = 2 * inter * pk.row_bytes(fmt, hidden, "fmt") + hidden * pk.row_bytes(fmt_d, inter, "fmt_d")
    per_call = batch * top_k
    experts = max(int(bank_gb * 1e9 // per_expert), 4 * per_call)
    gen = torch.Generator().manual_seed(0)
    seed = 8  # distinct random experts, tiled over the bank (the bytes read are what matters)
    gu = pk.random_blocks(fmt, (seed, 2 * inter), hidden, gen).repeat(-(-experts // seed), 1, 1)[:experts].contiguous()
    dn = pk.random_blocks(fmt_d, (seed, hidden), inter, gen).repeat(-(-experts // seed), 1, 1)[:experts].contiguous()
    gscale = torch.ones(experts, 3)
    x = torch.randn(batch, hidden, generator=gen).to(torch.bfloat16)
    weights = torch.full((batch, top_k), 1.0 / top_k)
    out = torch.zeros(batch, hidden)
    n_sets = experts // per_call
    id_sets = [(torch.arange(per_call, dtype=torch.int32) + s * per_call).view(batch, top_k) for s in range(n_sets)]
    range_sets = [[r for e in ids.flatten().tolist()
                   for r in ((gu[e].data_ptr(), gu[e].numel()), (dn[e].data_ptr(), dn[e].numel()))]
                  for ids in id_sets]
    ft.set_num_threads(threads)
    ft.set_isa(isa)
    step = [0]

    def kernel() -> None:
        pk.moe_packed(x, id_sets[step[0] % n_sets], weights, gu, fmt, dn, fmt_d, gscale, out)
        step[0] += 1

    def read() -> None:
        ft.read_ranges(range_sets[step[0] % n_sets])
        step[0] += 1

    best = {"kernel": float("inf"), "read": float("inf")}
    try:
        for _ in range(rounds):
            best["kernel"] = min(best["kernel"], _timed(kernel, seconds))
            best["read"] = min(best["read"], _timed(read, seconds))
    finally:
        ft.set_isa("auto")
    nbytes = per_call * per_expert
    return {
        "format": fmt, "format_down": fmt_d, "isa": ft.get_isa() if isa == "auto" else isa,
        "threads": ft.num_threads(), "batch": batch, "hidden": hidden, "inter": inter, "top_k": top_k,
        "bank_gb": round(experts * per_expert / 1e9, 2), "bytes_per_call": nbytes,
        "us_per_call": round(best["kernel"] * 1e6, 1), "gbps": round(nbytes / best["kernel"] / 1e9, 2),
        "read_us": round(best["read"] * 1e6, 1), "read_gbps": round(nbytes / best["read"] / 1e9, 2),
        "of_read_bound": round(best["read"] / best["kernel"], 3),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--format", default="q4_k", choices=sorted(pk.FORMATS))
    ap.add_argument("--format-down", default=None, choices=sorted(pk.FORMATS))
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--isa", default="auto")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--bank-gb", type=float, default=1.0)
    ap.add_argument("--seconds", type=float, default=0.5)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    print(json.dumps(bench_packed(a.format, a.format_down, a.threads, a.isa, a.batch, bank_gb=a.bank_gb,
                                  seconds=a.seconds, rounds=a.rounds)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
