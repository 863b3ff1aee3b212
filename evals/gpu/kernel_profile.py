"""Where a decode token's time goes, kernel by kernel: one engine on random weights of a real shape
(the `bench decode` model flags), a warm-up generation (graphs captured, kernels compiled), then
`--tokens` decode tokens under torch.profiler. Prints the CUDA kernels by time per token, with
launches per token, their sum, and the wall time per token next to it, so the gap between the two
(launch gaps, host waits) shows too. Kernels replayed from CUDA graphs are traced like any other
(CUPTI sees every kernel, whichever thread launched it). `--zero-experts` skips the routed experts
(bench decode's dense time). CUDA only.

Usage: python -m evals.gpu.kernel_profile --shape qwen3-30b-a3b --layers 24 --dummy
           --gpu-memory 12GiB --cpu-threads 8 [--zero-experts] [--tokens 32] [--top 30] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from freetoken_agent.bench.decode import WARMUP_TOKENS, ZeroExperts
from freetoken_agent.bench.model_bench import ModelBench, add_model_arguments


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m evals.gpu.kernel_profile", description=__doc__.split("\n\n")[0])
    add_model_arguments(p)
    p.add_argument("--tokens", type=int, default=32, help="profiled decode tokens")
    p.add_argument("--prompt-tokens", type=int, default=64, help="the warm-up request's prompt")
    p.add_argument("--top", type=int, default=30, help="rows printed")
    p.add_argument("--zero-experts", action="store_true", help="skip the routed experts (dense time only)")
    p.add_argument("--out", type=Path, default=None, help="also write the rows as JSON here")
    args = p.parse_args(argv)
    if args.tokens < 2:
        p.error("--tokens must be >= 2")
    return args


def kernel_rows(prof: Any, tokens: int) -> list[dict[str, Any]]:
    """One row per CUDA kernel (or copy) name: us per token, calls per token; longest first."""
    rows = []
    for e in prof.key_averages():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue  # CPU-side ops: their device time repeats their kernels'
        us = e.self_device_time_total / tokens
        if us > 0:
            rows.append({"name": e.key, "us_per_token": us, "calls_per_token": e.count / tokens})
    return sorted(rows, key=lambda r: -r["us_per_token"])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    if not torch.cuda.is_available():
        raise SystemExit("kernel_profile needs a CUDA device")
    bench = ModelBench(args, kv_tokens=args.prompt_tokens + WARMUP_TOKENS + args.tokens + 64, prefill_chunk=512)
    try:
        if args.zero_experts:
            bench.engine.decoder.executor = ZeroExperts()
        bench.timed_request(bench.random_prompt(args.prompt_tokens, -1), WARMUP_TOKENS)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            # a 4-token prompt: its prefill is one decode-sized step, not a streamed chunk
            timing = bench.timed_request(bench.random_prompt(4, 0), args.tokens + 1)
            wall = time.perf_counter() - t0
        title = bench.title()
    finally:
        bench.close()
    # the profile spans the 4-token prompt's step too: per-token figures divide by the decode
    # tokens, so they overstate decode by about one step in `--tokens`
    rows = kernel_rows(prof, args.tokens)
    decode_ms = (timing.last - timing.first) / (timing.tokens - 1) * 1e3
    result = {"title": title, "zero_experts": args.zero_experts, "tokens": args.tokens,
              "decode_ms_per_token": decode_ms, "profiled_wall_s": wall,
              "kernel_ms_per_token": sum(r["us_per_token"] for r in rows) / 1e3, "rows": rows}
    print(f"{title}; {'routed experts skipped' if args.zero_experts else 'routed experts run'}")
    print(f"decode {decode_ms:.2f} ms/token (wall, profiled); kernels {result['kernel_ms_per_token']:.2f} ms/token "
          "(sum of kernel time)")
    print(f"{'us/token':>10} {'calls/token':>12}  name")
    for r in rows[:args.top]:
        print(f"{r['us_per_token']:10.1f} {r['calls_per_token']:12.1f}  {r['name'][:110]}")
    if args.out is not None:
        args.out.write_text(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
