"""Probe: the packed expert layer call's knobs that the decode and CPU-prefill rates hang on, timed
side by side on one bank, each case interleaved with the others over rounds (best round kept).

For each format (Qwen3-30B-A3B's expert shape, top-8, a bank of random valid blocks far larger than
the caches, consecutive calls on fresh experts) and each thread count, on the CPU's SIMD path:
- chunk rows: the rows of a work chunk a pool thread takes at a time (`ft.set_chunk_rows`), at batch 1;
- prefetch: the kernels' software prefetch off (`ft.set_prefetch_bytes(0)`), at batch 1;
- batch: tokens per call (1 = decode; more = the CPU share of a prefill chunk), at the default chunk;
next to `read`, the pool's plain read of the same bytes (the bound). GB/s counts the packed bytes.

    python3 -m evals.native.chunk_probe [--formats q8_0,q4_k] [--threads 8,16] [--chunks 16,64]
        [--batches 1,16] [--bank-gb 2] [--seconds 0.3] [--rounds 2]

Prints one JSON object per case, then a table. It answers what no CI run can: whether a bigger chunk
(fewer hand-offs, the kernels' two-tiles-ahead prefetch inside more of a thread's rows; the driver
prefetches a chunk's first tiles and the next expert's rows itself) pays on a many-core host, and what
the software prefetch is worth there.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

import torch

from freetoken_agent.bench.timing import best_of

HIDDEN, INTER, TOP_K = 2048, 768, 8


def probe_format(ft: Any, fmt_name: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    from engine.moe.packed import native_moe_packed
    from engine.quant.formats import format_of

    fmt = format_of(fmt_name)
    kernel = native_moe_packed()
    assert kernel is not None, "the native extension is not built (python native/build.py)"
    per_expert = 2 * INTER * fmt.row_bytes(HIDDEN, "hidden") + HIDDEN * fmt.row_bytes(INTER, "inter")
    batches = [int(b) for b in args.batches.split(",")]
    rows = max(int(args.bank_gb * 1e9 // per_expert), 4 * TOP_K * max(batches))
    gen = torch.Generator().manual_seed(0)
    gate_up, down = fmt.random_rows((rows, 2 * INTER), HIDDEN, gen), fmt.random_rows((rows, HIDDEN), INTER, gen)
    perm = torch.randperm(rows, generator=gen)
    step = [0]

    def sets(T: int) -> list[torch.Tensor]:
        n = TOP_K * T
        return [perm[j * n:(j + 1) * n].reshape(T, TOP_K).to(torch.int32).contiguous() for j in range(rows // n)]

    def case(T: int, prefetch: int, chunk: int) -> Callable[[], None]:
        ids, x = sets(T), torch.randn(T, HIDDEN, generator=gen).to(torch.bfloat16)
        w, out = torch.rand(T, TOP_K, generator=gen), torch.zeros(T, HIDDEN)

        def one() -> None:
            ft.set_prefetch_bytes(prefetch)
            ft.set_chunk_rows(chunk)
            kernel(x, ids[step[0] % len(ids)], w, gate_up, fmt.name, down, fmt.name, None, out)
            step[0] += 1
        return one

    reads = [[(t[e].data_ptr(), t[e].numel()) for e in s.flatten().tolist() for t in (gate_up, down)] for s in sets(1)]

    def read() -> None:
        ft.read_ranges(reads[step[0] % len(reads)])
        step[0] += 1

    default_chunk, default_pf = ft.chunk_rows(), ft.prefetch_bytes()
    cases: dict[str, tuple[int, int, int]] = {}
    for chunk in sorted({default_chunk, *(int(c) for c in args.chunks.split(","))}):
        cases[f"chunk={chunk} T=1"] = (1, default_pf, chunk)
    cases[f"chunk={default_chunk} T=1 no prefetch"] = (1, 0, default_chunk)
    for T in batches:
        cases.setdefault(f"chunk={default_chunk} T={T}", (T, default_pf, default_chunk))
    fns = {name: case(*c) for name, c in cases.items()} | {"read": read}
    results = []
    for n in (int(t) for t in args.threads.split(",")):
        ft.set_num_threads(n)
        best = best_of(fns, args.rounds, args.seconds)
        bound = TOP_K * per_expert / best["read"] / 1e9
        for name, (T, prefetch, chunk) in cases.items():
            gbps = TOP_K * T * per_expert / best[name] / 1e9
            results.append({"format": fmt.name, "threads": n, "isa": ft.get_isa(), "prefetch": prefetch,
                            "chunk_rows": chunk, "batch": T,
                            "gbps": round(gbps, 2), "read_bound_gbps": round(bound, 2),
                            "of_bound": round(gbps / bound, 3), "ms": round(best[name] * 1e3, 3)})
            print(json.dumps(results[-1]), flush=True)
    ft.set_prefetch_bytes(default_pf)
    ft.set_chunk_rows(default_chunk)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default="q8_0,q4_k")
    ap.add_argument("--threads", default="8,16")
    ap.add_argument("--chunks", default="16,64", help="chunk rows to time at batch 1")
    ap.add_argument("--batches", default="1,16", help="tokens per call to time at the default chunk")
    ap.add_argument("--bank-gb", type=float, default=2.0)
    ap.add_argument("--seconds", type=float, default=0.3)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    from engine.moe.native import load_native

    ft = load_native()
    rows = [r for f in args.formats.split(",") for r in probe_format(ft, f, args)]
    print(f"{'format':7} {'thr':>3} {'isa':10} {'prefetch':>8} {'chunk':>5} {'batch':>5} {'GB/s':>7} {'bound':>7} "
          f"{'of bound':>8}")
    for r in rows:
        print(f"{r['format']:7} {r['threads']:>3} {r['isa']:10} {r['prefetch']:>8} {r['chunk_rows']:>5} {r['batch']:>5} "
              f"{r['gbps']:>7.2f} {r['read_bound_gbps']:>7.2f} {r['of_bound']:>8.2f}")


if __name__ == "__main__":
    main()
