"""`freetoken-agent bench prefill`: time to first token and prefill tok/s of the engine on dummy
(random) weights of a real shape, cold, for several prompt lengths, against the bound of
docs/benchmarks.md.

Method:
- model: engine/weights/dummy.py (fixed seed, random routers); prompts are fresh random ids;
- one untimed warm-up request of each length (kernels compile and autotune per chunk shape: on the
  GPU machine a hybrid model's first 8192-token chunk took 10.7 s, 1.1 s once warm), then for each length in
  `--prompt-tokens`, `--reps` times: cold caches (prefix cache emptied, and the expert cache when
  the executor has one; with `--expert-cache warm` the expert cache is left as the previous
  request left it, as in a serving engine), submit, wait for the first token. TTFT = submit -> first token (taken on
  the engine thread as it is emitted); prefill tok/s = prompt tokens / TTFT; medians over reps;
- prompts go through in chunks of `--chunk` tokens (EngineOptions.prefill_chunk);
- bound: each chunk is one pass over the model that must stream every layer's routed experts
  once: bound_s = passes x expert_bank_bytes / B_P with passes = ceil(prompt / chunk) and B_P the
  PCIe expert-copy rate (alone) of the calibration stored for this machine; on a CPU engine the
  CPU reads them: B_C. Nothing stored: bound_s is null and bound_note says "unknown: ...".
  measured_over_bound = TTFT / bound_s. The bound counts expert bytes only (no dense time).
- hit_rate per length: the expert cache's hits / (hits + misses) over the prefill (null without
  a cache);
- streamed_experts per length: experts the streamed prefill copied into its layer buffers per
  request (0 when no chunk streamed), and streamed_unused_share: the share of them that no token of
  their chunk was routed to (the streamer copies a layer's experts before its routing is known).
  Near-uniform routers leave none unused at a few thousand tokens; a model that routes unevenly
  wastes that share of the streamed bytes (null when nothing was streamed).

JSON keys (one object): the facts of `ModelBench.facts()` (see decode.py) plus bench="prefill",
chunk, reps, expert_cache ("cold" / "warm"), bandwidth_gbps, bound_note, and runs: a list with one object per prompt length:
prompt_tokens, ttft_s, ttft_s_reps, prefill_tok_s, passes, bound_s, measured_over_bound, hit_rate,
streamed_experts, streamed_unused_share.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from freetoken_agent.argtypes import positive_int, positive_int_list
from freetoken_agent.bench.model_bench import ModelBench, add_model_arguments, delta, median, print_table


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("prefill", help="cold TTFT and prefill tok/s on dummy weights of a real shape, with bound")
    add_model_arguments(p)
    p.add_argument("--prompt-tokens", type=positive_int_list, default=[1024, 4096, 16384],
                   help="comma list of prompt lengths (default 1024,4096,16384)")
    p.add_argument("--chunk", type=positive_int, default=8192, help="prefill chunk, tokens per forward pass")
    p.add_argument("--reps", type=positive_int, default=1, help="runs per length; the median is reported")
    p.add_argument("--expert-cache", choices=("cold", "warm"), default="cold",
                   help="cold (default): the expert cache emptied before each timed request; warm: left as "
                        "the previous request left it (the prefix cache is emptied either way)")


def _hit_rate(deltas: list[dict[str, int] | None]) -> float | None:
    if any(d is None for d in deltas):
        return None
    hits = sum(d["hits"] for d in deltas if d is not None)
    seen = hits + sum(d["misses"] for d in deltas if d is not None)
    return hits / seen if seen else None


def measure(bench: ModelBench, args: argparse.Namespace) -> dict[str, Any]:
    lengths: list[int] = args.prompt_tokens
    for i, n in enumerate(sorted(set(lengths))):
        bench.cold()
        bench.timed_request(bench.random_prompt(n, -1 - i), 1)
    bandwidth, note = bench.calibration_bandwidth("stream")
    bank = bench.engine.decoder.weights.experts
    bank_bytes = bank.total_bytes
    runs = []
    index = 0
    from engine.gpu.executor import CachedExpertExecutor

    ex = bench.executor
    streamer = ex.streamer if isinstance(ex, CachedExpertExecutor) else None
    for n in lengths:
        ttfts, deltas = [], []
        streamed = unused = 0
        for _ in range(args.reps):
            bench.cold(experts=args.expert_cache == "cold")
            before = streamer.stats if streamer is not None else None
            t = bench.timed_request(bench.random_prompt(n, index), 1)
            if streamer is not None and before is not None:
                after = streamer.stats  # read once the request is done: a host sync outside the timing
                streamed += after.streamed - before.streamed
                unused += after.streamed_unused - before.streamed_unused
            index += 1
            ttfts.append(t.first - t.submitted)
            deltas.append(delta(t.stats_before, t.stats_first))
        ttft = median(ttfts)
        passes = math.ceil(n / args.chunk)
        bound_s = passes * bank_bytes / (bandwidth * 1e9) if bandwidth else None
        runs.append({"prompt_tokens": n, "ttft_s": ttft, "ttft_s_reps": ttfts, "prefill_tok_s": n / ttft,
                     "passes": passes, "bound_s": bound_s, "measured_over_bound": ttft / bound_s if bound_s else None,
                     "hit_rate": _hit_rate(deltas), "streamed_experts": streamed / args.reps,
                     "streamed_unused_share": unused / streamed if streamed else None})
        bench.note(f"{n} tokens: TTFT {ttft:.3f} s, {n / ttft:.0f} tok/s")
    return {"bench": "prefill", **bench.facts(), "chunk": args.chunk, "reps": args.reps, "expert_cache": args.expert_cache,
            "bandwidth_gbps": bandwidth, "bound_note": note, "runs": runs}


def run(args: argparse.Namespace) -> int:
    bench = ModelBench(args, kv_tokens=max(args.prompt_tokens) + 32, prefill_chunk=args.chunk)
    try:
        result = measure(bench, args)
        title = bench.title()
    finally:
        bench.close()
    if args.json:
        print(json.dumps(result))
        return 0
    print_table(f"prefill, {args.expert_cache} expert cache, chunk {args.chunk}: {title}",
                ["prompt tokens", "TTFT s", "prefill tok/s", "hit rate", "passes", "bound s", "measured/bound"],
                [[r["prompt_tokens"], r["ttft_s"], r["prefill_tok_s"], r["hit_rate"], r["passes"], r["bound_s"],
                  r["measured_over_bound"]] for r in result["runs"]])
    print(f"bound: {result['bound_note']}" if result["bandwidth_gbps"] is None else
          f"bound: passes x {result['expert_bank_bytes'] / 1e9:.2f} GB of experts / "
          f"{result['bandwidth_gbps']:.1f} GB/s ({result['bound_note']})")
    return 0
