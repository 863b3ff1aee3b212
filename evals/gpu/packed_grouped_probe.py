"""Probe: the streamed prefill's grouped experts over packed slots (engine/gpu/quant/grouped.py's
`packed_grouped_experts`, bf16 tensor-core products of exact codes with the group scale factored
out) against the kernels it replaced (copied below: each weight tile dequantised to float32 and
multiplied with "tf32x3" dots), at one MoE layer's shape, on the same random slots and routing.

Each case is a (gate_up, down) format pair: `experts` random valid experts in shuffled slots, `tokens`
tokens routed to `k` distinct experts each (random), x in `--dtype`; both versions run on the same
precomputed layout (group_entries), timed with CUDA events (wall clock on the CPU) over `iters`
calls after a warm-up, the median of `rounds`. Prints one JSON line per case (ms, TFLOP/s counting
2 * 3 * H * I * tokens * k flops, and the max difference of new from old relative to max |old|),
then a short table. Run on the GPU machine (defaults: Qwen3-30B-A3B's experts, a 8192-token pass):
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
import triton
import triton.language as tl

from engine.gpu.grouped import GroupedLayout, group_entries
from engine.gpu.quant.dequant import dequant_at
from engine.gpu.quant.dot import activate, activation_code
from engine.gpu.quant.formats import packed_format
from engine.gpu.quant.slots import ExpertFormat, PackedSlots
from engine.options import triton_interpreted

# ---- the replaced kernels (engine/gpu/quant/grouped.py before the bf16 rewrite), as they were ----

_OLD_PRECISION = "ieee" if triton_interpreted() else "tf32x3"
# I-tile (each of gate and up) and H step; H-tile and I step; 8 warps. The dequantised weight tile
# lives in registers: with 64-value steps or 4 warps, ptxas spills (sm_90, every format); with
# these, none (255 registers at most). Untuned for speed.
_OLD_GATE_UP_N, _OLD_GATE_UP_K = 64, 32
_OLD_DOWN_N, _OLD_DOWN_K = 128, 32
_OLD_WARPS, _OLD_STAGES = 8, 3


@triton.jit
def _old_weight_tile(row_p, k0, m, g, FMT: tl.constexpr, QB: tl.constexpr, QBB: tl.constexpr, K: tl.constexpr,
                     BLOCK_K: tl.constexpr):
    """[BLOCK_K, BLOCK_N] values k0.. of the rows starting at row_p [1, BLOCK_N] (mask m [1, BLOCK_N]):
    one block per step when blocks are at least BLOCK_K values (k0 is a multiple of BLOCK_K), else
    BLOCK_K / QB whole blocks as a [blocks, QB, BLOCK_N] tile; either way a block's scale fields
    are read once per row."""
    if QB >= BLOCK_K:
        v = dequant_at(row_p + (k0 // QB) * QBB, k0 % QB + tl.arange(0, BLOCK_K)[:, None], m, g, FMT)
    else:
        blk = k0 // QB + tl.arange(0, BLOCK_K // QB)[:, None, None]
        v = dequant_at(row_p[None, :, :] + blk * QBB, tl.arange(0, QB)[None, :, None],
                       m[None, :, :] & (blk < K // QB), g, FMT)
        v = tl.reshape(v, (BLOCK_K, v.shape[2]))
    return v


@triton.jit
def _old_gate_up_kernel(x_ptr, w_ptr, gs_ptr, b_ptr, row_entry_ptr, block_slot_ptr, h_ptr, K, alpha, limit,
                    H: tl.constexpr, INTER: tl.constexpr, FMT: tl.constexpr, QB: tl.constexpr, QBB: tl.constexpr,
                    RB: tl.constexpr, STRIDE: tl.constexpr, GU_OFF: tl.constexpr, BSTRIDE: tl.constexpr,
                    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(INTER, BLOCK_N)
    blk = pid // n_tiles
    s = tl.load(block_slot_ptr + blk)
    if s >= 0:
        rows = blk * BLOCK_M + tl.arange(0, BLOCK_M)
        entry = tl.load(row_entry_ptr + rows)
        rmask = entry >= 0
        token = tl.where(rmask, entry // K, 0)
        cols = (pid % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < INTER
        row_g = (w_ptr + s.to(tl.int64) * STRIDE + cols.to(tl.int64) * RB)[None, :]
        row_u = row_g + INTER * RB
        gg = tl.load(gs_ptr + s * 3)
        gu = tl.load(gs_ptr + s * 3 + 1)
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            kmask = kk < H
            xt = tl.load(x_ptr + token.to(tl.int64)[:, None] * H + kk[None, :],
                         mask=rmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
            wg = _old_weight_tile(row_g, k0, cmask[None, :], gg, FMT, QB, QBB, H, BLOCK_K)  # [BLOCK_K, BLOCK_N]
            wu = _old_weight_tile(row_u, k0, cmask[None, :], gu, FMT, QB, QBB, H, BLOCK_K)
            acc_g = tl.dot(xt, wg, acc_g, input_precision=PRECISION)
            acc_u = tl.dot(xt, wu, acc_u, input_precision=PRECISION)
        if HAS_BIAS:  # the slot's bias row: gate [I], up [I], down [H]
            b_row = b_ptr + s.to(tl.int64) * BSTRIDE
            acc_g += tl.load(b_row + cols, mask=cmask, other=0.0)[None, :]
            acc_u += tl.load(b_row + INTER + cols, mask=cmask, other=0.0)[None, :]
        tl.store(h_ptr + rows.to(tl.int64)[:, None] * INTER + cols[None, :], activate(acc_g, acc_u, ACT, alpha, limit),
                 mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _old_down_kernel(h_ptr, w_ptr, gs_ptr, b_ptr, weight_ptr, row_entry_ptr, block_slot_ptr, y_ptr,
                 H: tl.constexpr, INTER: tl.constexpr, FMT: tl.constexpr, QB: tl.constexpr, QBB: tl.constexpr,
                 RB: tl.constexpr, STRIDE: tl.constexpr, GU_OFF: tl.constexpr, BSTRIDE: tl.constexpr,
                 HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(H, BLOCK_N)
    blk = pid // n_tiles
    s = tl.load(block_slot_ptr + blk)
    if s >= 0:
        rows = blk * BLOCK_M + tl.arange(0, BLOCK_M)
        entry = tl.load(row_entry_ptr + rows)
        rmask = entry >= 0
        cols = (pid % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < H
        row_d = (w_ptr + s.to(tl.int64) * STRIDE + GU_OFF + cols.to(tl.int64) * RB)[None, :]
        gd = tl.load(gs_ptr + s * 3 + 2)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, INTER, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            kmask = kk < INTER
            ht = tl.load(h_ptr + rows.to(tl.int64)[:, None] * INTER + kk[None, :],
                         mask=rmask[:, None] & kmask[None, :], other=0.0)
            wt = _old_weight_tile(row_d, k0, cmask[None, :], gd, FMT, QB, QBB, INTER, BLOCK_K)
            acc = tl.dot(ht, wt, acc, input_precision=PRECISION)
        if HAS_BIAS:
            acc += tl.load(b_ptr + s.to(tl.int64) * BSTRIDE + 2 * INTER + cols, mask=cmask, other=0.0)[None, :]
        e = tl.where(rmask, entry, 0)
        wgt = tl.load(weight_ptr + e, mask=rmask, other=0.0)
        tl.store(y_ptr + e.to(tl.int64)[:, None] * H + cols[None, :], acc * wgt[:, None],
                 mask=rmask[:, None] & cmask[None, :])


def old_packed_grouped_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, slot_of: torch.Tensor,
                           slots: PackedSlots, fmt: ExpertFormat, layout: GroupedLayout | None = None, *,
                           activation: str = "silu", alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """engine/gpu/quant/grouped.py's packed_grouped_experts before the bf16 rewrite (same contract)."""
    slots.check(fmt)
    act = activation_code(activation)
    n, hidden = x.shape
    k = ids.shape[1]
    inter = fmt.inter
    if hidden != fmt.hidden:
        raise ValueError(f"x: hidden size {hidden}, the experts have {fmt.hidden}")
    if n == 0 or k == 0:
        return torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    row_entry, block_slot, block = layout if layout is not None else group_entries(ids, slot_of)
    blocks = block_slot.shape[0]
    fg, fd = packed_format(fmt.fmt_gu), packed_format(fmt.fmt_d)
    x = x.contiguous()
    flat_w = weights.reshape(-1).to(torch.float32).contiguous()
    h = torch.empty(row_entry.shape[0], inter, dtype=torch.float32, device=x.device)
    bias = slots.bias if slots.bias is not None else slots.gscale  # not read without a bias block
    common = {"STRIDE": slots.stride, "GU_OFF": fmt.gate_up_bytes, "BLOCK_M": block, "PRECISION": _OLD_PRECISION,
              "BSTRIDE": bias.stride(0), "HAS_BIAS": slots.bias is not None, "num_warps": _OLD_WARPS,
              "num_stages": _OLD_STAGES}
    _old_gate_up_kernel[(blocks * triton.cdiv(inter, _OLD_GATE_UP_N),)](
        x, slots.data, slots.gscale, bias, row_entry, block_slot, h, k, float(alpha), float(limit), H=hidden,
        INTER=inter, ACT=act, FMT=fg.code,
        QB=fg.block, QBB=fg.block_bytes, RB=fmt.gu_row_bytes, BLOCK_N=_OLD_GATE_UP_N, BLOCK_K=_OLD_GATE_UP_K, **common)
    y = torch.empty(n * k, hidden, dtype=torch.float32, device=x.device)
    _old_down_kernel[(blocks * triton.cdiv(hidden, _OLD_DOWN_N),)](
        h, slots.data, slots.gscale, bias, flat_w, row_entry, block_slot, y, H=hidden, INTER=inter, FMT=fd.code,
        QB=fd.block, QBB=fd.block_bytes, RB=fmt.d_row_bytes, BLOCK_N=_OLD_DOWN_N, BLOCK_K=_OLD_DOWN_K, **common)
    return y.view(n, k, hidden).sum(dim=1)


# ---- the probe ----
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

    c = Case(fmt_gu, fmt_d, a)
    cuda = c.x.is_cuda
    old = c.call(old_packed_grouped_experts)
    new = c.call(packed_grouped_experts)
    scale = float(old.abs().max())
    diff = float((new - old).abs().max())
    old_ms = _time(lambda: c.call(old_packed_grouped_experts), a.iters, a.rounds, cuda)
    new_ms = _time(lambda: c.call(packed_grouped_experts), a.iters, a.rounds, cuda)
    flops = 2 * 3 * a.hidden * a.inter * a.tokens * a.k
    return {"case": f"{fmt_gu}/{fmt_d}", "dtype": a.dtype, "tokens": a.tokens, "k": a.k, "hidden": a.hidden,
            "inter": a.inter, "experts": a.experts, "block_m": c.layout.block, "device": str(c.x.device),
            "old_ms": round(old_ms, 3), "new_ms": round(new_ms, 3),
            "old_tflops": round(flops / old_ms / 1e9, 2), "new_tflops": round(flops / new_ms / 1e9, 2),
            "speedup": round(old_ms / new_ms, 2), "max_rel_diff": diff / scale if scale else diff,
            "finite": bool(torch.isfinite(new).all())}


def table(rows: Sequence[dict[str, Any]]) -> str:
    lines = [f"{'case':<14}{'old ms':>10}{'new ms':>10}{'old TF/s':>10}{'new TF/s':>10}{'speedup':>9}{'rel diff':>11}"]
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
