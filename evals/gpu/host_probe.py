"""Where a decode step's host time goes: one engine on random weights of a real shape (the `bench
decode` model flags), a warm-up generation (graphs captured), then `--tokens` decode tokens with the
engine thread's calls timed by wall clock (the scheduler step, its admission and KV allocation, the
decode pass's rotary check, input copies, metadata fill and graph launch, the LM head, the wait in
the executor's check, the sampler, the emission to the listener). The GPU
is idle from the end of one step's wait to the next graph launch: that interval, split by call,
is printed per token with the step time next to it (off CUDA nothing is replayed: no idle time).
With the overlapped decode on (FREETOKEN_OVERLAP_DECODE=1, engine/decode_pipeline.py; off by
default) the next pass is replayed before this one's check, so "check returned -> next replay" is
host work beside a busy GPU, not idle time: the probe says how many passes were overlapped.

Usage: python -m evals.gpu.host_probe --shape qwen3-30b-a3b --layers 24 --dummy --gpu-memory 16GiB
           --cpu-threads 8 [--tokens 64] [--zero-experts] [--out PATH]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from freetoken_agent.bench.decode import WARMUP_TOKENS, ZeroExperts
from freetoken_agent.bench.model_bench import ModelBench, add_model_arguments


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m evals.gpu.host_probe", description=__doc__.split("\n\n")[0])
    add_model_arguments(p)
    p.add_argument("--tokens", type=int, default=64, help="timed decode tokens")
    p.add_argument("--zero-experts", action="store_true", help="skip the routed experts (dense time only)")
    p.add_argument("--out", type=Path, default=None, help="also write the result as JSON here")
    return p.parse_args(argv)


class Marks:
    """(label, perf_counter_ns) in call order, from the engine thread only."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []
        self.on = False

    def wrap(self, obj: Any, name: str, label: str) -> None:
        fn = getattr(obj, name)

        @functools.wraps(fn)
        def timed(*a: Any, **k: Any) -> Any:
            if not self.on:
                return fn(*a, **k)
            self.events.append((label + ">", time.perf_counter_ns()))
            try:
                return fn(*a, **k)
            finally:
                self.events.append((label + "<", time.perf_counter_ns()))

        setattr(obj, name, timed)


def intervals(events: list[tuple[str, int]], steps: int) -> dict[str, float]:
    """Mean us per step between consecutive marks, keyed 'a -> b'."""
    acc: dict[str, float] = defaultdict(float)
    for (a, ta), (b, tb) in itertools.pairwise(events):
        acc[f"{a} -> {b}"] += (tb - ta) / 1e3
    return {k: v / steps for k, v in sorted(acc.items(), key=lambda kv: -kv[1])}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    bench = ModelBench(args, kv_tokens=WARMUP_TOKENS + args.tokens + 128, prefill_chunk=512)
    marks = Marks()
    try:
        eng = bench.engine
        if args.zero_experts:
            eng.decoder.executor = ZeroExperts()
        sched, dec = eng.scheduler, eng.decoder
        marks.wrap(sched, "step", "step")
        marks.wrap(dec, "forward", "forward")
        marks.wrap(dec, "logits", "logits")
        marks.wrap(torch.cuda.CUDAGraph, "replay", "replay")
        marks.wrap(dec.executor, "check", "check")
        import engine.scheduler as sched_mod

        marks.wrap(sched_mod, "sample", "sample")
        marks.wrap(eng, "_refresh_cache_stats", "refresh")
        # finer marks inside the batch build and the pass's inputs (the tenth session's 206 / 208 us)
        marks.wrap(sched, "_admit", "admit")
        marks.wrap(sched, "_alloc_kv", "alloc")
        marks.wrap(dec.rotary, "prepare", "rotary")
        from engine.request import RequestHandle

        marks.wrap(RequestHandle, "_emit", "emit")
        if torch.cuda.is_available():
            from engine.model.decode_attention import DecodeMeta  # triton: CUDA only

            marks.wrap(DecodeMeta, "fill", "fill")
        bench.timed_request(bench.random_prompt(4, -1), WARMUP_TOKENS)
        staged_before = eng.scheduler.staged_passes
        marks.on = True
        timing = bench.timed_request(bench.random_prompt(4, 0), args.tokens + 1)
        marks.on = False
        overlapped = eng.scheduler.staged_passes - staged_before
        title = bench.title()
    finally:
        bench.close()
    # the decode steps only: drop the prompt's step (the first 'step>' .. 'step<')
    ev = marks.events
    starts = [i for i, (lab, _) in enumerate(ev) if lab == "step>"]
    ev = ev[starts[1]:] if len(starts) > 1 else ev
    steps = sum(1 for lab, _ in ev if lab == "step>")
    wall_us = (timing.last - timing.first) / (timing.tokens - 1) * 1e6
    # GPU idle: from a check's return (the step's work is done) to the next replay call
    idle = []
    last_check = None
    for lab, t in ev:
        if lab == "check<":
            last_check = t
        elif lab == "replay>" and last_check is not None:
            idle.append((t - last_check) / 1e3)
            last_check = None
    result = {"title": title, "zero_experts": args.zero_experts, "steps": steps, "overlapped_passes": overlapped, "wall_us_per_token": wall_us,
              "idle_us_per_token": sum(idle) / len(idle) if idle else None, "intervals_us": intervals(ev, steps)}
    print(f"{title}; {'routed experts skipped' if args.zero_experts else 'routed experts run'}")
    print(f"decode {wall_us:.0f} us/token; host-only (check returned -> next replay) "
          f"{result['idle_us_per_token'] or 0:.0f} us/token over {steps} steps; {overlapped} passes overlapped "
          f"(then that interval is not idle time)")
    for k, v in list(result["intervals_us"].items())[:16]:
        print(f"{v:9.1f} us  {k}")
    if args.out is not None:
        args.out.write_text(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
