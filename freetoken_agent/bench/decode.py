"""`freetoken-agent bench decode`: batch-1 greedy decode speed of the engine on dummy (random)
weights of a real shape, with the expert cache's hit rate and the bound of docs/benchmarks.md.

Method:
- model: engine/weights/dummy.py (fixed seed; random routers route almost uniformly, the worst
  case for an expert cache: read the hit rate next to the speed);
- one short warm-up request, then `--reps` times: cold caches (prefix cache emptied, and the
  expert cache when the executor has one), a fresh random prompt of `--prompt-tokens` ids, greedy
  generation of `--tokens` tokens (a dummy model has no EOS: always that many);
- speed: tok/s = (tokens - 1) / (time of the last token - time of the first token), both taken on
  the engine thread as the tokens are emitted, so prefill and the first token are excluded;
  tok_s and ms_per_token are medians over the reps (tok_s_reps lists each rep); distinct_tokens
  (distinct ids / generated ids, median) flags a generation stuck in a loop, whose repeated
  routing would flatter an expert cache;
- cache counters: the executor's `stats` (CacheStats) read on the engine thread at the first
  token and at the end, so the delta covers exactly the tokens - 1 timed decode steps; per token
  = delta / (tokens - 1); CPU misses = misses - fetched (a split expert, split_per_token, runs
  partly on each side and counts here: FREETOKEN_SPLIT_EXPERT). Without an expert cache (no
  --gpu-memory) there is no hit rate (null) and every routed expert is a miss (top_k x MoE
  layers per token): fetched on CUDA (the torch executor copies each one), on the CPU otherwise;
- dense_ms: the same generation with the routed experts replaced by `ZeroExperts` (returns
  zeros_like(x)) on the same device, median over as many reps as the real runs (dense_ms_reps):
  router, shared expert, attention, norms and LM head all still run; it is what a token costs when
  no expert weight moves or multiplies;
- bound: ms/token >= dense_ms + misses/token x expert_bytes / (B_P' + B_C'), B_P' and B_C' the
  contended PCIe-copy and CPU-expert rates of the calibration stored for this machine
  (`freetoken-agent calibrate`); a CPU engine has no PCIe path and uses B_C alone. Nothing stored:
  bound_ms is null and bound_note says "unknown: ..." (never a guessed bandwidth).
  measured_over_bound = measured ms/token / bound_ms (>= 1; near 1 is at the bound).
- cpu_branch_ms_per_token: the wall time the native CPU branch spent inside its host tasks per
  timed token (GPU decode steps hand their CPU misses over as host tasks), measured in situ, while
  the PCIe fetches run beside it: set against ms_per_token it says how much of a token the CPU
  side holds the critical path; 0 where no step hands work to the host.
- layer_timeline (null where no decode step served the doorbell): per served request, i.e. per
  MoE layer of a timed step, from the native poller's clock: cpu_us (doorbell seen -> answer
  written: the CPU experts and the hand-off to the copier), gpu_gap_us (an answer -> the next
  layer's doorbell: the GPU alone, i.e. the wait for the answer, the combine, the fetched experts'
  GEMVs if the copies came last, the next layer's attention, router, plan and hand-off), fetch_us
  (doorbell -> the host-issued copies landed; null with the fetch kernel) and fetch_late_share
  (fetches that landed after the CPU's answer), layers_per_token, gaps_per_token (a layer fewer: gaps
  within a step). A token is layers_per_token x cpu_us + gaps_per_token x gpu_gap_us plus what runs
  between the last MoE layer's answer and the next step's first doorbell (step_rest_ms: the LM head,
  sampling, the host's turn, the first layer's dense part): set gpu_gap_us against dense_ms / layers
  to see the hand-offs' cost.

JSON keys (one object): the facts of `ModelBench.facts()` (weights, seed, routing, shape, family,
layers, experts, top_k, hidden, expert_inter, dtype, device, gpu, cpu, cpu_threads, torch_threads,
executor, gpu_memory, gpu_budget, peak_gpu_bytes, expert_bytes, expert_bank_bytes, dense_bytes,
load_s, calibration) plus bench="decode", prompt_tokens, tokens, reps, temperature, tok_s, tok_s_reps,
ms_per_token, distinct_tokens, hit_rate, hits_per_token, misses_per_token, fetched_per_token,
split_per_token, cpu_misses_per_token, cpu_branch_ms_per_token, layer_timeline, step_rest_ms, dense_ms, dense_ms_reps, bound_ms,
bandwidth_gbps, measured_over_bound, bound_note.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from engine.errors import ConfigError
from freetoken_agent.argtypes import non_negative_float, positive_int
from freetoken_agent.bench.model_bench import (
    ModelBench,
    Timing,
    add_model_arguments,
    delta,
    median,
    print_table,
)

# enough decode steps that every layer's CUDA graph is captured (eager, capture, replay) and the
# kernels are compiled before the timed reps; the first H200 run's first rep (4 warm-up tokens) ran
# at a third of the others' speed
WARMUP_TOKENS = 16


def __getattr__(name: str) -> Any:
    """`ZeroExperts` lives in `zero_experts.py`: it subclasses the engine's executor (torch), which
    defining the command's parser must not import."""
    if name == "ZeroExperts":
        from freetoken_agent.bench.zero_experts import ZeroExperts

        return ZeroExperts
    raise AttributeError(name)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("decode", help="batch-1 decode tok/s on dummy weights of a real shape, with hit rate and bound")
    add_model_arguments(p)
    p.add_argument("--tokens", type=positive_int, default=256, help="generated tokens per rep (>= 2)")
    p.add_argument("--reps", type=positive_int, default=3, help="generations; the median is reported")
    p.add_argument("--prompt-tokens", type=positive_int, default=64, help="random prompt length")
    p.add_argument("--temperature", type=non_negative_float, default=0.0,
                   help="sampling temperature of the generations (default 0: greedy). A checkpoint of random "
                        "weights tends to repeat a few tokens under greedy decoding, which routes every step "
                        "to the same experts (a hit rate no real model has; see distinct_tokens); a high "
                        "temperature samples near-uniform tokens, as llama-bench's generation feeds random ones")


def _per_token(timings: list[Timing], bench: ModelBench) -> dict[str, Any]:
    steps = sum(t.tokens - 1 for t in timings)
    deltas = [delta(t.stats_first, t.stats_end) for t in timings]
    cpu_branch_ms = sum(t.host_ns_end - t.host_ns_first for t in timings) / steps / 1e6
    if any(d is None for d in deltas):
        routed = bench.cfg.top_k * bench.cfg.num_moe_layers
        fetched = routed if bench.device.type == "cuda" else 0
        return {"hit_rate": None, "hits_per_token": 0.0, "misses_per_token": float(routed),
                "fetched_per_token": float(fetched), "split_per_token": 0.0, "cpu_misses_per_token": float(routed - fetched),
                "cpu_branch_ms_per_token": cpu_branch_ms, "layer_timeline": None}
    total = {k: sum(d[k] for d in deltas if d is not None) for k in ("hits", "misses", "fetched", "split")}
    seen = total["hits"] + total["misses"]
    return {"hit_rate": total["hits"] / seen if seen else None, "hits_per_token": total["hits"] / steps,
            "misses_per_token": total["misses"] / steps, "fetched_per_token": total["fetched"] / steps,
            "split_per_token": total["split"] / steps,
            "cpu_misses_per_token": (total["misses"] - total["fetched"]) / steps,
            "cpu_branch_ms_per_token": cpu_branch_ms, "layer_timeline": _timeline(timings, steps)}


def _timeline(timings: list[Timing], steps: int) -> dict[str, float | None] | None:
    """Per served doorbell request (one MoE layer of one decode step) over the timed tokens: the
    poller's share, the GPU's part alone between consecutive layers and the host-issued fetches'
    latency (native poll_timeline); None where no step served the doorbell."""
    pairs = [(a, b) for a, b in ((t.timeline_first, t.timeline_end) for t in timings) if a is not None and b is not None]
    if len(pairs) < len(timings) or not pairs:
        return None
    d = {k: sum(b[k] - a[k] for a, b in pairs) for k in pairs[0][0]}
    if not d["served"]:
        return None
    return {"layers_per_token": d["served"] / steps, "gaps_per_token": d["gaps"] / steps,
            "cpu_us": d["cpu_ns"] / d["served"] / 1e3,
            "gpu_gap_us": d["gap_ns"] / d["gaps"] / 1e3 if d["gaps"] else None,
            "fetch_us": d["fetch_ns"] / d["fetches"] / 1e3 if d["fetches"] else None,
            "fetch_late_share": d["fetch_late"] / d["fetches"] if d["fetches"] else None}


def _decode_s(t: Timing) -> float:
    return (t.last - t.first) / (t.tokens - 1)


def measure(bench: ModelBench, args: argparse.Namespace) -> dict[str, Any]:
    bench.cold()
    bench.timed_request(bench.random_prompt(args.prompt_tokens, -1), WARMUP_TOKENS, args.temperature, 0)
    staged_before = bench.engine.scheduler.staged_passes
    timings = []
    for rep in range(args.reps):
        bench.cold()
        timings.append(bench.timed_request(bench.random_prompt(args.prompt_tokens, rep), args.tokens,
                                           args.temperature, rep))
        bench.note(f"rep {rep + 1}/{args.reps}: {1 / _decode_s(timings[-1]):.2f} tok/s")
    per_token = _per_token(timings, bench)
    # the share of timed passes queued before the previous pass's tokens were read (engine/decode_pipeline.py)
    overlapped = (bench.engine.scheduler.staged_passes - staged_before) / sum(t.tokens - 1 for t in timings)
    real = bench.engine.decoder.executor
    from freetoken_agent.bench.zero_experts import ZeroExperts

    bench.engine.decoder.executor = ZeroExperts()
    dense = []
    try:  # as many repetitions as the real runs: one dense run read up to 1 ms apart between runs (H200)
        for rep in range(args.reps):
            bench.cold()
            dense.append(bench.timed_request(bench.random_prompt(args.prompt_tokens, args.reps + rep), args.tokens,
                                             args.temperature, args.reps + rep))
    finally:
        bench.engine.decoder.executor = real
    dense_reps = [_decode_s(t) * 1e3 for t in dense]
    dense_ms = median(dense_reps)
    ms = median([_decode_s(t) for t in timings]) * 1e3
    rates = [1 / _decode_s(t) for t in timings]
    bandwidth, note = bench.calibration_bandwidth("both")
    bound_ms = None
    if bandwidth:
        expert_bytes = bench.engine.decoder.weights.experts.expert_bytes
        bound_ms = dense_ms + per_token["misses_per_token"] * expert_bytes / (bandwidth * 1e9) * 1e3
    lt = per_token["layer_timeline"]
    step_rest_ms = None
    if lt is not None and lt["gpu_gap_us"] is not None:
        # one gap fewer than layers per step: the step boundary (LM head, sampling, the host's turn,
        # the first layer's dense part) is what is left
        step_rest_ms = ms - (lt["layers_per_token"] * lt["cpu_us"] + lt["gaps_per_token"] * lt["gpu_gap_us"]) / 1e3
    return {
        "bench": "decode", **bench.facts(), "prompt_tokens": args.prompt_tokens, "tokens": args.tokens,
        "reps": args.reps, "temperature": args.temperature, "tok_s": median(rates), "tok_s_reps": rates,
        "ms_per_token": ms, "distinct_tokens": median([len(set(t.output)) / len(t.output) for t in timings]),
        **per_token, "step_rest_ms": step_rest_ms, "dense_ms": dense_ms, "dense_ms_reps": dense_reps, "bound_ms": bound_ms, "bandwidth_gbps": bandwidth,
        "measured_over_bound": ms / bound_ms if bound_ms else None, "bound_note": note,
        "overlapped_share": overlapped,
    }


def run(args: argparse.Namespace) -> int:
    if args.tokens < 2:
        raise ConfigError("--tokens must be >= 2: decode speed is timed from the first token to the last")
    bench = ModelBench(args, kv_tokens=args.prompt_tokens + args.tokens + 32,
                       prefill_chunk=min(max(args.prompt_tokens, 16), 2048))
    try:
        result = measure(bench, args)
        title = bench.title()
    finally:
        bench.close()
    if args.json:
        print(json.dumps(result))
        return 0
    r = result
    print_table(f"decode, batch 1: {title}",
                ["tok/s", "ms/token", "hit rate", "misses/tok", "fetched/tok", "CPU misses/tok", "dense ms",
                 "bound ms", "measured/bound"],
                [[r["tok_s"], r["ms_per_token"], r["hit_rate"], r["misses_per_token"], r["fetched_per_token"],
                  r["cpu_misses_per_token"], r["dense_ms"], r["bound_ms"], r["measured_over_bound"]]])
    if (lt := r["layer_timeline"]) is not None and lt["gpu_gap_us"] is not None:
        fetch = "" if lt["fetch_us"] is None else (f", copies landed {lt['fetch_us']:.0f} us after the doorbell "
                                                    f"({100 * lt['fetch_late_share']:.0f} % after the CPU's answer)")
        print(f"per MoE layer: CPU branch {lt['cpu_us']:.0f} us, then the GPU alone {lt['gpu_gap_us']:.0f} us{fetch}; "
              f"{r['step_rest_ms']:.2f} ms per token outside the layers' chain")
    if r["bound_ms"] is None:
        print(f"bound: {r['bound_note']}")
    else:
        print(f"bound: dense {r['dense_ms']:.2f} ms + {r['misses_per_token']:.1f} misses/token x "
              f"{r['expert_bytes'] / 2**20:.1f} MiB / {r['bandwidth_gbps']:.1f} GB/s ({r['bound_note']})")
    return 0
