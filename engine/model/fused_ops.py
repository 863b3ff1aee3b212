"""RMSNorm and rotary embedding as one Triton kernel launch each (for the decode pass's CUDA graphs).

Contract: `rms_norm(x, weight, eps, zero_centered)`, `gated_rms_norm(x, gate, weight, eps)` and
`apply_rotary(x, cos_table, sin_table, positions, rotary_dim)` compute the same functions as
`engine.model.ops.rms_norm`, `engine.model.ops.gated_rms_norm` and `engine.model.ops.Rotary.apply`,
with the same rounding points, in one launch instead of ~7, ~10 and ~8 torch kernels (and
`route_topk(logits, top_k, renormalize)` the router's softmax, top-k and renormalisation, ~6):

- rms_norm: float32 math, r = rsqrt(mean(x^2) + eps), y = x * r; zero-centered: (y * (1 + w)) rounded
  once to x's dtype; plain: w * y with y first rounded to x's dtype and the product computed in
  float32 of the two rounded operands and rounded once (as torch's bf16 / fp16 multiply does). Only
  the sum of squares is accumulated in another order than torch's, so a bf16 output can differ from
  torch's by one rounding on a small fraction of elements; float32 agrees to a few ulps.
- apply_rotary: each product (x * cos, rotated * sin) rounded to x's dtype, then their sum rounded
  (torch's three elementwise kernels), so the result is bit-identical to `Rotary.apply`; float32 too,
  because the kernel is compiled without multiply-add contraction. Dims past rotary_dim are copied.

Both read every length from shapes and every position on the device (no host sync, no allocation
that depends on data), so they can be captured in a CUDA graph. The module imports triton: import it
only where CUDA or Triton's interpreter (TRITON_INTERPRET=1, CPU tensors) runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.model.kernel_limits import FUSED_NORM_MAX_DIM as MAX_NORM_DIM
from engine.model.kernel_limits import FUSED_ROUTER_MAX_EXPERTS, fused_router_serves


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, gate_ptr, out_ptr, row_stride, gate_stride, dim, eps,
                     ZERO_CENTERED: tl.constexpr, GATED: tl.constexpr, ROUND_NORM: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    x = tl.load(x_ptr + row * row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, axis=0) / dim + eps)
    y = x * r
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    # plain: the product of the two operands rounded to x's dtype, rounded once (torch's bf16 multiply)
    out = y * (1.0 + w) if ZERO_CENTERED else w * y.to(x_ptr.dtype.element_ty).to(tl.float32)
    if GATED:  # times silu(gate) in float32
        z = tl.load(gate_ptr + row * gate_stride + cols, mask=mask, other=0.0).to(tl.float32)
        if ROUND_NORM:  # the norm's product is in x's dtype when the weight is (torch's promotion)
            out = out.to(out_ptr.dtype.element_ty).to(tl.float32)
        out = out * (z / (1.0 + tl.exp(-z)))
    tl.store(out_ptr + row * dim + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, pos_ptr, out_ptr, token_stride, head_stride, table_stride,
                   HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, ROT: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK)
    in_head = d < HEAD_DIM
    rot = d < ROT
    first_half = d < ROT // 2
    src = x_ptr + t * token_stride + h * head_stride
    x = tl.load(src + d, mask=in_head, other=0.0)
    # rotated = cat(-x2, x1): dim d < half takes -x[d + half], dim d >= half takes x[d - half]
    partner = tl.load(src + tl.where(first_half, d + ROT // 2, d - ROT // 2), mask=rot, other=0.0).to(tl.float32)
    rotated = tl.where(first_half, -partner, partner)
    row = tl.load(pos_ptr + t).to(tl.int64) * table_stride
    cos = tl.load(cos_ptr + row + d, mask=rot, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + row + d, mask=rot, other=0.0).to(tl.float32)
    dtype = x_ptr.dtype.element_ty
    a = (x.to(tl.float32) * cos).to(dtype).to(tl.float32)
    b = (rotated * sin).to(dtype).to(tl.float32)
    out = tl.where(rot, (a + b).to(dtype), x)
    tl.store(out_ptr + (t * HEADS + h) * HEAD_DIM + d, out, mask=in_head)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    """RMSNorm over the last dim of x [..., D] (D <= MAX_NORM_DIM) with weight [D]; a new tensor of
    x's shape and dtype (for the plain norm, torch's promotion of x's and weight's dtypes, as
    `weight * y` gives; the same when weight is in x's dtype, as the engine stores it)."""
    dim = x.shape[-1]
    if dim > MAX_NORM_DIM or weight.shape != (dim,):
        raise ValueError(f"rms_norm takes a last dim up to {MAX_NORM_DIM} and a weight of that size, "
                         f"got x {tuple(x.shape)} and weight {tuple(weight.shape)}")
    out_dtype = x.dtype if zero_centered else torch.promote_types(x.dtype, weight.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    rows = x.reshape(-1, dim)  # a view where the strides allow it
    if rows.shape[0] == 0:
        return out
    _norm_rows(rows, weight, None, out, eps, zero_centered, round_norm=False)
    return out


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`engine.model.ops.gated_rms_norm` in one launch: rows of x and gate [R, D] (D <= MAX_NORM_DIM,
    unit stride in the last dim), weight [D] -> [R, D] in x's dtype: the plain norm as `rms_norm`
    rounds it (in the promoted dtype of x and weight), times silu(gate) in float32, rounded once."""
    dim = x.shape[-1]
    if x.dim() != 2 or gate.shape != x.shape or dim > MAX_NORM_DIM or weight.shape != (dim,):
        raise ValueError(f"gated_rms_norm takes x and gate [rows, D <= {MAX_NORM_DIM}] and a weight [D], "
                         f"got x {tuple(x.shape)}, gate {tuple(gate.shape)}, weight {tuple(weight.shape)}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.shape[0]:
        _norm_rows(x, weight, gate, out, eps, False, round_norm=torch.promote_types(x.dtype, weight.dtype) == x.dtype)
    return out


def _norm_rows(rows: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor | None, out: torch.Tensor, eps: float,
               zero_centered: bool, round_norm: bool) -> None:
    """One program per row of rows [R, D] (and gate [R, D] when gated) into out [R, D] contiguous."""
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if gate is not None and gate.stride(-1) != 1:
        gate = gate.contiguous()
    dim = rows.shape[-1]
    block = triton.next_power_of_2(dim)
    _rms_norm_kernel[(rows.shape[0],)](
        rows, weight.contiguous(), rows if gate is None else gate, out, rows.stride(0),
        0 if gate is None else gate.stride(0), dim, eps, ZERO_CENTERED=zero_centered, GATED=gate is not None,
        ROUND_NORM=round_norm, BLOCK=block, num_warps=max(1, min(16, block // 256)))


def apply_rotary(x: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor, positions: torch.Tensor,
                 rotary_dim: int) -> torch.Tensor:
    """x [T, heads, head_dim] (any strides but a unit last one), tables [P, rotary_dim] in x's dtype
    (cat(freqs, freqs) per row, as `Rotary` builds them), positions [T] integers below P on x's
    device -> rotated x as a new contiguous [T, heads, head_dim]. Positions are not checked (that
    would read them on the host): the caller sizes the tables (`Rotary.prepare`)."""
    tokens, heads, head_dim = x.shape
    tables_fit = (cos_table.dim() == 2 and cos_table.shape[1] == rotary_dim and sin_table.shape == cos_table.shape
                  and cos_table.dtype == sin_table.dtype == x.dtype)
    if rotary_dim % 2 or rotary_dim > head_dim or not tables_fit:
        raise ValueError(f"rotary over {rotary_dim} of {head_dim} dims needs even rotary_dim <= head_dim and "
                         f"cos / sin tables [P, {rotary_dim}] in {x.dtype}, got {tuple(cos_table.shape)} "
                         f"{cos_table.dtype} and {tuple(sin_table.shape)} {sin_table.dtype}")
    out = torch.empty(tokens, heads, head_dim, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos_table, sin_table = cos_table.contiguous(), sin_table.contiguous()
    block = triton.next_power_of_2(head_dim)
    _rotary_kernel[(tokens, heads)](
        x, cos_table, sin_table, positions, out, x.stride(0), x.stride(1), rotary_dim, HEADS=heads,
        HEAD_DIM=head_dim, ROT=rotary_dim, BLOCK=block, num_warps=max(1, min(4, block // 128)),
        enable_fp_fusion=False)  # a float32 x*cos + rotated*sin must not become a fused multiply-add
    return out


@triton.jit
def _topk_kernel(logits_ptr, ids_ptr, w_ptr, experts, row_stride,
                 K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < experts
    logits = tl.load(logits_ptr + row * row_stride + cols, mask=mask, other=float("-inf")).to(tl.float32)
    e = tl.exp(logits - tl.max(logits, axis=0))
    probs = tl.where(mask, e / tl.sum(e, axis=0), -1.0)
    ks = tl.arange(0, K)
    top_w = tl.zeros([K], dtype=tl.float32)
    top_i = tl.zeros([K], dtype=tl.int64)
    for j in tl.static_range(K):  # the largest left, the lowest index among equals
        best = tl.max(probs, axis=0)
        idx = tl.min(tl.where(probs == best, cols, BLOCK), axis=0)
        top_w = tl.where(ks == j, best, top_w)
        top_i = tl.where(ks == j, idx.to(tl.int64), top_i)
        probs = tl.where(cols == idx, -1.0, probs)
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, axis=0)
    tl.store(ids_ptr + row * K + ks, top_i)
    tl.store(w_ptr + row * K + ks, top_w.to(w_ptr.dtype.element_ty))


def route_topk(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`engine.model.router.softmax_topk` after its router matmul, in one launch: logits [T, E] (the sizes
    `kernel_limits.fused_router_serves` accepts: E <= 4096, top_k a power of two <= E) -> (ids
    int64 [T, top_k], weights [T, top_k] in logits' dtype): the float32 softmax's top_k in descending order (the lowest index first among equal ones; torch.topk
    leaves that order open), renormalised to sum to one if asked. Only the softmax's and the
    renormalisation's float32 sums run in another order than torch's."""
    tokens, experts = logits.shape
    if not fused_router_serves(experts, top_k):
        raise ValueError(f"route_topk serves up to {FUSED_ROUTER_MAX_EXPERTS} experts and a power-of-two top_k, "
                         f"got {experts} and {top_k}")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(tokens, top_k, dtype=logits.dtype, device=logits.device)
    if tokens:
        block = triton.next_power_of_2(experts)
        _topk_kernel[(tokens,)](logits, ids, weights, experts, logits.stride(0), K=top_k, RENORMALIZE=renormalize,
                                BLOCK=block, num_warps=max(1, min(8, block // 128)))
    return ids, weights


@triton.jit
def _gated_add_kernel(out_ptr, x_ptr, gate_ptr, shared_ptr, y_ptr, dim, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    ty = y_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * dim + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gate_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    # the torch ops' rounding points: F.linear's output, sigmoid, the product, the sum
    logit = tl.sum(x * g, axis=0).to(ty).to(tl.float32)
    gate = (1.0 / (1.0 + tl.exp(-logit))).to(ty).to(tl.float32)
    shared = tl.load(shared_ptr + row * dim + cols, mask=mask, other=0.0).to(tl.float32)
    part = (gate * shared).to(ty).to(tl.float32)
    out = tl.load(out_ptr + row * dim + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * dim + cols, (out + part).to(ty), mask=mask)


def shared_gated_add(out: torch.Tensor, x: torch.Tensor, gate: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """out + sigmoid(F.linear(x, gate)) * shared in one launch (a MoE block's shared-expert tail: a
    cuBLAS dot and its reduction, a sigmoid, a product and a sum before): out, x, shared [T, H]
    (H <= kernel_limits.FUSED_NORM_MAX_DIM), gate [1, H]; the same rounding points as the torch ops, only the
    dot product's float32 sum runs in another order."""
    tokens, dim = x.shape
    out, x, shared = out.contiguous(), x.contiguous(), shared.contiguous()
    y = torch.empty_like(out)
    if tokens:
        block = triton.next_power_of_2(dim)
        _gated_add_kernel[(tokens,)](out, x, gate.contiguous(), shared, y, dim, BLOCK=block,
                                     num_warps=max(1, min(8, block // 256)))
    return y
