"""Decode-step routed experts over packed slots (1..8 tokens): the packed counterpart of
engine/gpu/kernels.py's `expert_rows` / `slot_experts`, same plan contract, the CPU kernel's
arithmetic (native/packed.py: f32 accumulation, h = act(g, u) kept f32, no activation quantisation).

Contract:
- `packed_expert_rows(x [N, H] bf16/f16/f32, slot_ids [N, k], weights [N, k], slots: PackedSlots,
  fmt: ExpertFormat (the layer's), copy_dst=None, between=None, *, activation="silu", alpha=1.702,
  limit=7.0) -> [N * k, H] float32`: entry e's weight * (down h + b_down), h = act(gate x + b_gate,
  up x + b_up), gate / up / down the slot's packed rows dequantised in registers (times the slot's
  gscale), the biases the slot's `slots.bias` row (none when the slots have no bias block), act
  engine/moe/packed.py's `activate`: "silu" silu(g) * u, or "swiglu_clamped" (gpt-oss) g clamped
  above at limit, u to [-limit, limit], (u + 1) * g * sigmoid(alpha g); zeros for entries without a
  slot (slot id < 0); ValueError for another activation. With
  `copy_dst` (the slots a fetch is filling, -1 padded) and `between` (what waits for it), the
  entries in other slots run first, then `between()`, then the fetched ones (engine/gpu/kernels.py's
  `_phase_slot`, shared): hits compute while the copies fly. The rows do not depend on which slot
  holds an expert.
- `packed_slot_experts(x, ids, slot_ids, weights, slots, fmt, cpu=None, *, activation="silu",
  alpha=1.702, limit=7.0) -> [N, H] float32`: those rows summed per token in ascending expert id
  (`combine_experts`, shared), plus the CPU branch's part.

How: one program per (entry, tile of 16 output rows; 128 under the interpreter): gate_up's programs
take gate or up rows (written f32 [N * k, 2I], biases added), down's apply act(gate, up) as they read them.
Each walks K (H for gate_up, I for down) 256 values a step through engine/gpu/quant/dot.py's
`dot_step` (per-format tiles: a block's bytes read contiguously, each decoded once); the f32
products accumulate in the tile, reduced once after the loop (the bf16 kernel's measured choice). A slot's gate_up rows start
at its first byte, its down rows `fmt.gate_up_bytes` later (slots are `slots.stride` bytes apart).
The expert split (scratch slot) is not supported: the executor enables it for bf16 / f32 banks only.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from engine.gpu.kernels import _phase_slot, combine_experts
from engine.gpu.quant.dot import activation_code, dot_step, dot_total, dot_zeros
from engine.gpu.quant.formats import packed_format
from engine.gpu.quant.slots import ExpertFormat, PackedSlots
from engine.options import triton_interpreted

# rows per program (gate_up: of I; down: of H) and values per step along K (whole blocks: NB = this
# // B blocks a step, at least one). Triton's interpreter (the CPU tests) runs a program's tile as
# one numpy array: there, more rows, fewer programs.
_ROWS = 128 if triton_interpreted() else 16
_STEP = 256


@triton.jit
def _gate_up_kernel(x_ptr, slot_ptr, w_ptr, gs_ptr, b_ptr, gu_ptr, dst_ptr, H: tl.constexpr, INTER: tl.constexpr,
                    K: tl.constexpr, FMT: tl.constexpr, QB: tl.constexpr, QBB: tl.constexpr,
                    RB: tl.constexpr, STRIDE: tl.constexpr, GU_OFF: tl.constexpr, BSTRIDE: tl.constexpr,
                    HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, NB: tl.constexpr, PHASE: tl.constexpr,
                    COPIES: tl.constexpr, COPIES_P: tl.constexpr):
    # rows of w13 (gate rows 0..I-1, then up rows): each program one matrix's tile, so one
    # accumulator (registers for more programs a multiprocessor)
    e = tl.program_id(0)
    rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    rmask = rows < 2 * INTER
    s, go = _phase_slot(slot_ptr, dst_ptr, e, PHASE, COPIES, COPIES_P)
    if go:
        if s < 0:
            tl.store(gu_ptr + e * 2 * INTER + rows, tl.zeros((ROWS,), dtype=tl.float32), mask=rmask)
        else:
            t = e // K
            gs = tl.where(rows < INTER, tl.load(gs_ptr + s * 3), tl.load(gs_ptr + s * 3 + 1))
            row_p = w_ptr + s.to(tl.int64) * STRIDE + rows.to(tl.int64) * RB
            tile = dot_zeros(ROWS, NB, QB, FMT)
            for b0 in range(0, H // QB, NB):
                tile = dot_step(tile, row_p, x_ptr + t * H, b0, rmask, gs, FMT, QB, QBB, NB, H // QB,
                                False, INTER, 0, 1.0, 1.0)
            acc = dot_total(tile, FMT)
            if HAS_BIAS:  # gate bias rows 0..I-1, up bias rows I..2I-1 of the slot's bias row
                acc += tl.load(b_ptr + s.to(tl.int64) * BSTRIDE + rows, mask=rmask, other=0.0)
            tl.store(gu_ptr + e * 2 * INTER + rows, acc, mask=rmask)


@triton.jit
def _down_kernel(gu_ptr, slot_ptr, w_ptr, gs_ptr, b_ptr, wt_ptr, y_ptr, dst_ptr, alpha, limit, H: tl.constexpr,
                 INTER: tl.constexpr, FMT: tl.constexpr, QB: tl.constexpr, QBB: tl.constexpr,
                 RB: tl.constexpr, STRIDE: tl.constexpr, GU_OFF: tl.constexpr, BSTRIDE: tl.constexpr,
                 HAS_BIAS: tl.constexpr, ACT: tl.constexpr, ROWS: tl.constexpr,
                 NB: tl.constexpr, PHASE: tl.constexpr, COPIES: tl.constexpr, COPIES_P: tl.constexpr):
    e = tl.program_id(0)
    rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    rmask = rows < H
    s, go = _phase_slot(slot_ptr, dst_ptr, e, PHASE, COPIES, COPIES_P)
    if go:
        if s < 0:
            tl.store(y_ptr + e * H + rows, tl.zeros((ROWS,), dtype=tl.float32), mask=rmask)
        else:
            gd = tl.zeros((ROWS,), dtype=tl.float32) + tl.load(gs_ptr + s * 3 + 2)
            row_p = w_ptr + s.to(tl.int64) * STRIDE + GU_OFF + rows.to(tl.int64) * RB
            tile = dot_zeros(ROWS, NB, QB, FMT)
            for b0 in range(0, INTER // QB, NB):  # h = act(g, u) read from this entry's gate_up row
                tile = dot_step(tile, row_p, gu_ptr + e * 2 * INTER, b0, rmask, gd, FMT, QB, QBB, NB,
                                INTER // QB, True, INTER, ACT, alpha, limit)
            y = dot_total(tile, FMT)
            if HAS_BIAS:  # the down bias after the gate and up biases in the slot's bias row
                y += tl.load(b_ptr + s.to(tl.int64) * BSTRIDE + 2 * INTER + rows, mask=rmask, other=0.0)
            y = y * tl.load(wt_ptr + e)
            tl.store(y_ptr + e * H + rows, y, mask=rmask)


def _check(x: torch.Tensor, slots: PackedSlots, fmt: ExpertFormat) -> None:
    slots.check(fmt)
    if x.shape[1] != fmt.hidden:
        raise ValueError(f"x: hidden size {x.shape[1]}, the experts have {fmt.hidden}")


def packed_expert_rows(x: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor, slots: PackedSlots,
                       fmt: ExpertFormat, copy_dst: torch.Tensor | None = None,
                       between: Callable[[], None] | None = None, *, activation: str = "silu",
                       alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """See the module docstring."""
    _check(x, slots, fmt)
    act = activation_code(activation)
    n, hidden = x.shape
    k = slot_ids.shape[1]
    inter = fmt.inter
    entries = n * k
    y = torch.empty(entries, hidden, dtype=torch.float32, device=x.device)
    if slots.slots == 0 or entries == 0:
        if between is not None:
            between()
        return y.zero_()
    fg, fd = packed_format(fmt.fmt_gu), packed_format(fmt.fmt_d)
    x = x.contiguous()
    slot_flat = slot_ids.reshape(-1).contiguous()
    w = weights.reshape(-1).to(torch.float32).contiguous()
    gu = torch.empty(entries, 2 * inter, dtype=torch.float32, device=x.device)
    phased = copy_dst is not None and between is not None
    dst = copy_dst.contiguous() if copy_dst is not None and phased else slot_flat  # unused in phase 0
    copies = dst.numel() if phased else 1
    bias = slots.bias if slots.bias is not None else slots.gscale  # not read without a bias block
    common = {"STRIDE": slots.stride, "GU_OFF": fmt.gate_up_bytes, "ROWS": _ROWS, "COPIES": copies,
              "BSTRIDE": bias.stride(0), "HAS_BIAS": slots.bias is not None,
              "COPIES_P": triton.next_power_of_2(copies), "num_warps": 8}
    for phase in ((1, 2) if phased else (0,)):
        if phase == 2:
            assert between is not None
            between()
        _gate_up_kernel[(entries, triton.cdiv(2 * inter, _ROWS))](
            x, slot_flat, slots.data, slots.gscale, bias, gu, dst, hidden, inter, K=k, FMT=fg.code, QB=fg.block,
            QBB=fg.block_bytes, RB=fmt.gu_row_bytes, NB=max(1, _STEP // fg.block), PHASE=phase, **common)
        _down_kernel[(entries, triton.cdiv(hidden, _ROWS))](
            gu, slot_flat, slots.data, slots.gscale, bias, w, y, dst, float(alpha), float(limit), hidden, inter,
            ACT=act, FMT=fd.code, QB=fd.block,
            QBB=fd.block_bytes, RB=fmt.d_row_bytes, NB=max(1, _STEP // fd.block), PHASE=phase, **common)
    return y


def packed_slot_experts(x: torch.Tensor, ids: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor,
                        slots: PackedSlots, fmt: ExpertFormat, cpu: torch.Tensor | None = None, *,
                        activation: str = "silu", alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """See the module docstring."""
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    rows = packed_expert_rows(x, slot_ids, weights, slots, fmt, activation=activation, alpha=alpha, limit=limit)
    combine_experts(rows, ids, out, cpu)
    return out
