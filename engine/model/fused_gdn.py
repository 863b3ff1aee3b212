"""The Gated DeltaNet decode step (one new token per sequence) in two Triton kernels, for the
decode pass's CUDA graphs: ~40 torch launches per layer (conv window, silu, l2 norms, head
repeat, decay, delta rule, state gathers and scatters) become two.

Contract: `decode_core(mixed, b, a, w, cfg, slots, conv_state, ssm_state)` takes the four input
projections of N tokens (mixed [N, conv_dim], b and a [N, v_heads], in the model's dtype), the
state slots [N] (a device tensor) and the layer's conv windows [slots, conv_dim, K-1] and SSM
states [slots, Hv, dk, dv] (float32); it updates both in place for the named slots and returns the
recurrence's output [N, Hv * dv] in the model's dtype, before the gated output norm. The same
function as `engine.model.linear_attention.gated_deltanet_decode`'s torch ops, with the same
rounding points (conv output and its silu, sigmoid(b), the output, in the model's dtype; all else
float32); the float32 reductions (the conv's K products, the l2 norms, the two dk-long dots) run in
another order, so results agree to float32 rounding, not bit for bit.

1. `_conv_kernel`, grid (N, channel blocks): the causal conv's new output per channel, silu, and
   the window shifted by one in place (each channel has one owner: no program reads a window
   another one writes).
2. `_recurrent_kernel`, grid (N, Hv, dv blocks): q and k of the value head's key head l2-normalised
   (q scaled by dk^-0.5), beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias), then
   S <- S * exp(g); S <- S + k (beta (v - k S)); out = q S on a [dk, block] tile of the state.

Windows of up to 3 past inputs (conv kernel size <= 4, as Qwen3.5 / Qwen3.6 have) are served;
`fits(cfg)` says so. Imports triton: import where CUDA or the Triton interpreter runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.config import ModelConfig
from engine.weights.layout import LinearAttentionWeights

MAX_WINDOW = 3  # past inputs a conv window holds (kernel size - 1)


def fits(cfg: ModelConfig) -> bool:
    return 1 <= cfg.linear_conv_kernel_dim <= MAX_WINDOW + 1


@triton.jit
def _conv_kernel(mixed_ptr, state_ptr, w_ptr, slots_ptr, out_ptr, channels, slot_stride,
                 KM1: tl.constexpr, BLOCK: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < channels
    dtype = mixed_ptr.dtype.element_ty
    slot = tl.load(slots_ptr + n).to(tl.int64)
    win = state_ptr + slot * slot_stride + c * KM1  # [C, K-1] rows of this slot's window
    wrow = w_ptr + c * (KM1 + 1)
    x = tl.load(mixed_ptr + n * channels + c, mask=mask, other=0.0)
    # the window's past inputs, read before any is overwritten (in x's dtype, as torch casts them)
    s0 = tl.zeros([BLOCK], dtype=dtype)
    s1 = tl.zeros([BLOCK], dtype=dtype)
    s2 = tl.zeros([BLOCK], dtype=dtype)
    if KM1 > 0:
        s0 = tl.load(win, mask=mask, other=0.0).to(dtype)
    if KM1 > 1:
        s1 = tl.load(win + 1, mask=mask, other=0.0).to(dtype)
    if KM1 > 2:
        s2 = tl.load(win + 2, mask=mask, other=0.0).to(dtype)
    # torch: (window.float() * weight.float()).sum(-1): float32 products, summed oldest first
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    if KM1 > 0:
        acc += s0.to(tl.float32) * tl.load(wrow, mask=mask, other=0.0).to(tl.float32)
    if KM1 > 1:
        acc += s1.to(tl.float32) * tl.load(wrow + 1, mask=mask, other=0.0).to(tl.float32)
    if KM1 > 2:
        acc += s2.to(tl.float32) * tl.load(wrow + 2, mask=mask, other=0.0).to(tl.float32)
    acc += x.to(tl.float32) * tl.load(wrow + KM1, mask=mask, other=0.0).to(tl.float32)
    y = acc.to(dtype).to(tl.float32)  # the conv output rounds to x's dtype, then silu rounds again
    tl.store(out_ptr + n * channels + c, (y / (1.0 + tl.exp(-y))).to(dtype), mask=mask)
    sdt = state_ptr.dtype.element_ty
    if KM1 == 1:
        tl.store(win, x.to(sdt), mask=mask)
    if KM1 == 2:
        tl.store(win, s1.to(sdt), mask=mask)
        tl.store(win + 1, x.to(sdt), mask=mask)
    if KM1 == 3:
        tl.store(win, s1.to(sdt), mask=mask)
        tl.store(win + 1, s2.to(sdt), mask=mask)
        tl.store(win + 2, x.to(sdt), mask=mask)


@triton.jit
def _recurrent_kernel(conv_ptr, b_ptr, a_ptr, a_log_ptr, dt_bias_ptr, slots_ptr, ssm_ptr, out_ptr, channels,
                      slot_stride, scale,
                      HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr,
                      BV: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    kh = h // (HV // HK)  # value heads share key heads in order (repeat_interleave)
    dk = tl.arange(0, BK)
    kmask = dk < DK
    cols = tl.program_id(2) * BV + tl.arange(0, BV)
    vmask = cols < DV
    dtype = conv_ptr.dtype.element_ty
    row = conv_ptr + n * channels
    q = tl.load(row + kh * DK + dk, mask=kmask, other=0.0).to(tl.float32)
    k = tl.load(row + HK * DK + kh * DK + dk, mask=kmask, other=0.0).to(tl.float32)
    v = tl.load(row + 2 * HK * DK + h * DV + cols, mask=vmask, other=0.0).to(tl.float32)
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
    b = tl.load(b_ptr + n * HV + h).to(tl.float32)
    beta = (1.0 / (1.0 + tl.exp(-b))).to(dtype).to(tl.float32)  # sigmoid in the model's dtype
    a = tl.load(a_ptr + n * HV + h).to(tl.float32) + tl.load(dt_bias_ptr + h).to(tl.float32)
    softplus = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(a)))  # torch's threshold 20
    g = -tl.exp(tl.load(a_log_ptr + h).to(tl.float32)) * softplus
    slot = tl.load(slots_ptr + n).to(tl.int64)
    tile = ssm_ptr + slot * slot_stride + h * DK * DV + dk[:, None] * DV + cols[None, :]
    tmask = kmask[:, None] & vmask[None, :]
    s = tl.load(tile, mask=tmask, other=0.0) * tl.exp(g)
    delta = (v - tl.sum(k[:, None] * s, axis=0)) * beta
    s = s + k[:, None] * delta[None, :]
    tl.store(tile, s, mask=tmask)
    out = tl.sum(q[:, None] * s, axis=0)
    tl.store(out_ptr + n * (HV * DV) + h * DV + cols, out.to(dtype), mask=vmask)


def decode_core(mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, w: LinearAttentionWeights, cfg: ModelConfig,
                slots: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor) -> torch.Tensor:
    """The conv and the delta rule of one token per sequence; see the module docstring."""
    n, channels = mixed.shape
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    km1 = cfg.linear_conv_kernel_dim - 1
    if not fits(cfg) or channels != cfg.linear_conv_dim:
        raise ValueError(f"fused Gated DeltaNet decode serves conv kernels of 1..{MAX_WINDOW + 1} taps over "
                         f"{cfg.linear_conv_dim} channels, got {cfg.linear_conv_kernel_dim} and {channels}")
    if ssm_state.dtype != torch.float32 or not (conv_state.is_contiguous() and ssm_state.is_contiguous()):
        raise ValueError("the recurrent states must be contiguous, the SSM state float32")
    mixed, b, a = mixed.contiguous(), b.contiguous(), a.contiguous()
    conv_out = torch.empty_like(mixed)
    block = min(1024, triton.next_power_of_2(channels))
    _conv_kernel[(n, triton.cdiv(channels, block))](
        mixed, conv_state, w.conv.contiguous(), slots, conv_out, channels, conv_state.stride(0), KM1=km1,
        BLOCK=block, num_warps=4, enable_fp_fusion=False)  # products and sums round apart, as torch's
    out = torch.empty(n, hv * dv, dtype=mixed.dtype, device=mixed.device)
    bk = triton.next_power_of_2(dk)
    bv = min(32, triton.next_power_of_2(dv))
    _recurrent_kernel[(n, hv, triton.cdiv(dv, bv))](
        conv_out, b, a, w.a_log, w.dt_bias, slots, ssm_state, out, channels, ssm_state.stride(0), dk**-0.5,
        HK=hk, HV=hv, DK=dk, DV=dv, BK=bk, BV=bv, num_warps=4, enable_fp_fusion=False)
    return out
