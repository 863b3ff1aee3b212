"""Probe: the streamed prefill's two grouped-experts kernels over packed slots, tf32x3
(engine/gpu/quant/grouped.py's `packed_grouped_experts`: each weight tile dequantised to float32 and
multiplied with "tf32x3" dots) against bf16 (engine/gpu/quant/grouped_bf16.py: bf16 tensor-core
products of exact codes, the group scale factored out; the layer entry runs it for the format pairs
where this probe found it faster, `bf16_wins`), at one MoE layer's shape, on the same random slots
and routing.

Each case is a (gate_up, down) format pair: `experts` random valid experts in shuffled slots, `tokens`
tokens routed to `k` distinct experts each (random), x in `--dtype`; both kernels run on the same
precomputed layout (group_entries), timed with CUDA events (wall clock on the CPU) over `iters`
calls after a warm-up, the median of `rounds`. Prints one JSON line per case (ms, TFLOP/s counting
2 * 3 * H * I * tokens * k flops, and the max difference of the bf16 kernel's result from tf32x3's
relative to max |engine|), then a short table. Run on the GPU machine (defaults: Qwen3-30B-A3B's
experts, a 8192-token pass):
    python3 -m evals.gpu.packed_grouped_probe
    python3 -m evals.gpu.packed_grouped_probe --cases q4_k/q6_k --tokens 16384
`--device cpu` runs through Triton's interpreter (re-executed with TRITON_INTERPRET=1), for a tiny
shape only, e.g. --device cpu --tokens 8 --hidden 256 --inter 256 --experts 4 --k 2 --iters 1 --rounds 1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from engine.gpu.grouped import GroupedLayout, group_entries
from engine.gpu.quant.formats import packed_format
from engine.gpu.quant.slots import ExpertFormat, PackedSlots
from engine.options import triton_interpreted

DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python3 -m evals.gpu.packed_grouped_probe", description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="q4_k/q6_k,q8_0/q8_0,mxfp4/mxfp4", help="gate_up/down format pairs, comma-separated")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--experts", type=int, default=128, help="routed experts, each in its own slot")
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="x's dtype (the model's)")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="cuda", help="cuda, or cpu (Triton's interpreter: tiny shapes only)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    a.pairs = [tuple(c.split("/")) for c in a.cases.split(",")]
    for pair in a.pairs:
        if len(pair) != 2:
            p.error(f"--cases: {'/'.join(pair)!r} is not a gate_up/down pair")
        for f in pair:
            if f not in _known():
                p.error(f"--cases: {f!r} is not a packed format")
    return a


def _known() -> set[str]:
    from engine.gpu.quant.formats import FORMATS

    return {n for n, f in FORMATS.items() if f.code >= 0}


class Case:
    """One format pair's random slots, routing and x (module docstring)."""

    def __init__(self, fmt_gu: str, fmt_d: str, a: argparse.Namespace) -> None:
        from engine.quant.formats import FORMATS

        dev = torch.device(a.device)
        g = torch.Generator().manual_seed(a.seed)
        self.fmt = ExpertFormat(fmt_gu, fmt_d, a.hidden, a.inter)
        e = a.experts
        data = torch.empty(e + 1, self.fmt.nbytes, dtype=torch.uint8)
        data[:, :self.fmt.gate_up_bytes] = FORMATS[fmt_gu].random_rows((e + 1, 2 * a.inter), a.hidden, g,
                                                                        0.02).reshape(e + 1, -1)
        data[:, self.fmt.gate_up_bytes:] = FORMATS[fmt_d].random_rows((e + 1, a.hidden), a.inter, g,
                                                                       0.02).reshape(e + 1, -1)
        gs = torch.ones(e + 1, 3)
        if packed_format(fmt_gu).has_global:
            gs[:, :2] = torch.rand(e + 1, 2, generator=g) + 0.5
        if packed_format(fmt_d).has_global:
            gs[:, 2] = torch.rand(e + 1, generator=g) + 0.5
        self.slots = PackedSlots(data.to(dev), gs.to(dev))
        self.slot_of = torch.randperm(e + 1, generator=g)[:e].to(dev)  # one slot holds no routed expert
        self.ids = torch.rand(a.tokens, e, generator=g).topk(a.k, dim=1).indices.to(dev)
        self.w = torch.rand(a.tokens, a.k, generator=g).to(dev)
        self.x = torch.randn(a.tokens, a.hidden, generator=g).to(DTYPES[a.dtype]).to(dev)
        self.layout: GroupedLayout = group_entries(self.ids, self.slot_of)

    def call(self, fn: Callable[..., torch.Tensor]) -> torch.Tensor:
        return fn(self.x, self.ids, self.w, self.slot_of, self.slots, self.fmt, self.layout)


def _time(fn: Callable[[], Any], iters: int, rounds: int, cuda: bool) -> float:
    """Median over rounds of the mean ms per call, after one warm-up call (it compiles)."""
    fn()
    times = []
    for _ in range(rounds):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / iters)
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            times.append((time.perf_counter() - t0) * 1e3 / iters)
    return statistics.median(times)


def run_case(fmt_gu: str, fmt_d: str, a: argparse.Namespace) -> dict[str, Any]:
    from engine.gpu.quant.grouped import packed_grouped_experts
    from engine.gpu.quant.grouped_bf16 import bf16_packed_grouped_experts

    c = Case(fmt_gu, fmt_d, a)
    cuda = c.x.is_cuda
    old = c.call(packed_grouped_experts)
    new = c.call(bf16_packed_grouped_experts)
    scale = float(old.abs().max())
    diff = float((new - old).abs().max())
    old_ms = _time(lambda: c.call(packed_grouped_experts), a.iters, a.rounds, cuda)
    new_ms = _time(lambda: c.call(bf16_packed_grouped_experts), a.iters, a.rounds, cuda)
    flops = 2 * 3 * a.hidden * a.inter * a.tokens * a.k
    return {"case": f"{fmt_gu}/{fmt_d}", "dtype": a.dtype, "tokens": a.tokens, "k": a.k, "hidden": a.hidden,
            "inter": a.inter, "experts": a.experts, "block_m": c.layout.block, "device": str(c.x.device),
            "old_ms": round(old_ms, 3), "new_ms": round(new_ms, 3),
            "old_tflops": round(flops / old_ms / 1e9, 2), "new_tflops": round(flops / new_ms / 1e9, 2),
            "speedup": round(old_ms / new_ms, 2), "max_rel_diff": diff / scale if scale else diff,
            "finite": bool(torch.isfinite(new).all())}


def table(rows: Sequence[dict[str, Any]]) -> str:
    lines = [f"{'case':<14}{'tf32x3 ms':>10}{'bf16 ms':>10}{'tf32 TF/s':>10}{'bf16 TF/s':>10}{'speedup':>9}{'rel diff':>11}"]
    for r in rows:
        lines.append(f"{r['case']:<14}{r['old_ms']:>10.3f}{r['new_ms']:>10.3f}{r['old_tflops']:>10.2f}"
                     f"{r['new_tflops']:>10.2f}{r['speedup']:>9.2f}{r['max_rel_diff']:>11.2e}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    a = parse(argv)
    if a.device == "cpu" and not triton_interpreted():  # kernels are made interpreted when defined
        args = list(sys.argv[1:] if argv is None else argv)
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        subprocess.run([sys.executable, "-m", "evals.gpu.packed_grouped_probe", *args], env=env, check=True)
        return []
    rows = []
    for fmt_gu, fmt_d in a.pairs:
        r = run_case(fmt_gu, fmt_d, a)
        print(json.dumps(r), flush=True)
        rows.append(r)
        if a.device.startswith("cuda"):
            torch.cuda.empty_cache()
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
