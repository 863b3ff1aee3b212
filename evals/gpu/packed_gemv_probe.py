"""Probe: the decode-step expert GEMVs over packed slots (engine/gpu/quant/gemv.py) against the bf16
slots' (engine/gpu/kernels.py) on one expert shape, GB/s of weight bytes read per call.

Each call runs the k routed experts of `tokens` tokens from a pool of `slots` random slots (a fresh
random choice per call, so the L2 holds little of it); timed with CUDA events over `iters` calls
after a warm-up, the median of `rounds`. Prints one JSON line per format. Run on the GPU machine:
    python3 -m evals.gpu.packed_gemv_probe --formats q4_k,q6_k,q8_0 --hidden 2048 --inter 768 --k 8
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch


def _time(fn, iters: int, rounds: int) -> float:  # type: ignore[no-untyped-def]
    for _ in range(3):
        fn(0)
    times = []
    for r in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(iters):
            fn(r * iters + i)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--formats", default="q4_k,q6_k,q8_0")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--slots", type=int, default=256)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    from engine.gpu import kernels
    from engine.gpu.quant.gemv import packed_expert_rows
    from engine.gpu.quant.slots import ExpertFormat, PackedSlots
    from engine.quant.formats import FORMATS

    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    choices = [torch.stack([torch.randperm(a.slots, generator=g)[:a.k] for _ in range(a.tokens)]).to(dev)
               for _ in range(64)]
    x = torch.randn(a.tokens, a.hidden, device=dev, dtype=torch.bfloat16)
    w = torch.rand(a.tokens, a.k, device=dev)
    for name in ["bf16", *a.formats.split(",")]:
        if name == "bf16":
            w13 = torch.randn(a.slots, 2 * a.inter, a.hidden, device=dev, dtype=torch.bfloat16) * 0.02
            w2 = torch.randn(a.slots, a.hidden, a.inter, device=dev, dtype=torch.bfloat16) * 0.02
            per_expert = (w13[0].numel() + w2[0].numel()) * 2

            def run(i: int, w13: torch.Tensor = w13, w2: torch.Tensor = w2) -> None:
                kernels.expert_rows(x, choices[i % 64], w, w13, w2)
        else:
            fmt = ExpertFormat(name, name, a.hidden, a.inter)
            f = FORMATS[name]
            data = torch.empty(a.slots, fmt.nbytes, dtype=torch.uint8)
            data[:, :fmt.gate_up_bytes] = f.random_rows((a.slots, 2 * a.inter), a.hidden, g, 0.02).reshape(a.slots, -1)
            data[:, fmt.gate_up_bytes:] = f.random_rows((a.slots, a.hidden), a.inter, g, 0.02).reshape(a.slots, -1)
            slots = PackedSlots(data.to(dev), torch.ones(a.slots, 3, device=dev))
            per_expert = fmt.nbytes

            def run(i: int, slots: PackedSlots = slots, fmt: ExpertFormat = fmt) -> None:
                packed_expert_rows(x, choices[i % 64], w, slots, fmt)
        ms = _time(run, a.iters, a.rounds)
        bytes_read = len({*choices[0].reshape(-1).tolist()}) * per_expert
        print(json.dumps({"format": name, "tokens": a.tokens, "k": a.k, "ms": round(ms, 4),
                          "expert_mb": round(per_expert / 1e6, 3), "gbps": round(bytes_read / ms / 1e6, 1)}))
        del run


if __name__ == "__main__":
    main()
