"""Softmax attention over the paged KV cache: GQA, q/k norm, partial rotary, output gate, sinks.

Contract: `full_attention(x, w, cfg, rotary, meta, k_cache, v_cache, window)` writes the new tokens'
keys and values into their cache slots, attends each sequence's new queries over all its cached and
new keys (causal; with `window`, only the last `window` keys, the query's own included), and
returns the o_proj output [N, H]. With sinks (`w.sinks`, one logit per head) each head's softmax
also counts exp(sink) in its denominator, as if over one more key whose value is zero. It is three parts:
`attention_inputs` (projections, norms, rotary), the mix across tokens, `attention_output` (gate,
o_proj). The mix is the split-K decode kernel when the pass meta carries its device-side lengths
(`meta.decode`: decode-sized passes on CUDA, captured or not, so a step computes the same either
way), else `attention_core`, which walks `meta.batch`'s sequences.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.config import ModelConfig
from engine.model.batch import ForwardBatch, PassMeta
from engine.model.ops import Rotary, rms_norm
from engine.weights.layout import AttentionWeights

DECODE_ATTENTION_TOKENS = 8  # passes up to this size attend with engine/model/decode_attention.py on CUDA


def attention_inputs(x: torch.Tensor, w: AttentionWeights, cfg: ModelConfig, rotary: Rotary, positions: torch.Tensor,
                     limit: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per-token part before the mix: q [n, heads, hd], k, v [n, kv_heads, hd] (normed, rotated)
    and the output gate [n, heads * hd] (None without one)."""
    n, hd = x.shape[0], cfg.head_dim
    q = F.linear(x, w.q_proj, w.q_bias)
    gate = None
    if cfg.attn_output_gate:
        q, gate = q.view(n, cfg.num_heads, 2 * hd).chunk(2, dim=-1)
        gate = gate.reshape(n, cfg.num_heads * hd)
    q = q.reshape(n, cfg.num_heads, hd)
    k = F.linear(x, w.k_proj, w.k_bias).view(n, cfg.num_kv_heads, hd)
    if w.q_norm is not None and w.k_norm is not None:
        q = rms_norm(q, w.q_norm, cfg.rms_norm_eps, cfg.norm_zero_centered)
        k = rms_norm(k, w.k_norm, cfg.rms_norm_eps, cfg.norm_zero_centered)
    v = F.linear(x, w.v_proj, w.v_bias).view(n, cfg.num_kv_heads, hd)
    return rotary.apply(q, positions, limit), rotary.apply(k, positions, limit), v, gate


def attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: ModelConfig, batch: ForwardBatch,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, window: int | None = None,
                   sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The mix across tokens, per sequence: writes the new keys/values into the cache and attends
    each sequence's queries over its cached and new keys; returns [n, heads * hd]."""
    n, hd = q.shape[0], cfg.head_dim
    out = torch.empty(n, cfg.num_heads, hd, dtype=q.dtype, device=q.device)
    groups = cfg.num_heads // cfg.num_kv_heads
    for s in batch.seqs:
        new_slots = s.kv_slots[s.cached_len:]
        k_cache[new_slots] = k[s.start:s.end]
        v_cache[new_slots] = v[s.start:s.end]
        keys = k_cache[s.kv_slots].repeat_interleave(groups, dim=1)  # [S, heads, hd]
        vals = v_cache[s.kv_slots].repeat_interleave(groups, dim=1)
        total = s.cached_len + s.length
        qpos = torch.arange(s.cached_len, total, device=q.device)[:, None]
        kpos = torch.arange(total, device=q.device)[None, :]
        mask = kpos <= qpos
        if window is not None:
            mask &= kpos > qpos - window
        qs = q[s.start:s.end]
        if sinks is not None:
            qs, keys, vals, mask = _sink_as_key(qs, keys, vals, mask, sinks, hd**-0.5)
        if q.is_cuda:
            # an additive mask and contiguous [1, heads, L, hd] operands let SDPA pick its
            # memory-efficient kernel on long prompts; a bool mask sent it to the math path, which
            # materialises heads x L x L scores (gigabytes at 8k tokens, over any --gpu-memory cap)
            bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
            o = F.scaled_dot_product_attention(
                qs.transpose(0, 1).contiguous()[None], keys.transpose(0, 1).contiguous()[None],
                vals.transpose(0, 1).contiguous()[None], attn_mask=bias[None, None], scale=hd**-0.5,
            )[0]
        else:
            o = F.scaled_dot_product_attention(
                qs.transpose(0, 1), keys.transpose(0, 1), vals.transpose(0, 1),
                attn_mask=mask, scale=hd**-0.5,
            )
        out[s.start:s.end] = o.transpose(0, 1)[..., :hd]
    return out.reshape(n, cfg.num_heads * hd)


def _sink_as_key(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sinks as one more key that every query sees, with score sink[h] and a zero value, so the
    same SDPA kernels run: the head dim grows by 8 (zeros but one: 1 in the queries, sink / scale
    in that key); the caller drops the extra output dims. q [L, heads, hd], keys / vals [S, heads, hd]."""
    length, heads, hd = q.shape
    qx = F.pad(q, (0, 8))
    qx[..., hd] = 1
    sink_key = torch.zeros(1, heads, hd + 8, dtype=keys.dtype, device=keys.device)
    sink_key[0, :, hd] = sinks.to(keys.dtype) / scale
    kx = torch.cat([F.pad(keys, (0, 8)), sink_key])
    vx = torch.cat([F.pad(vals, (0, 8)), torch.zeros_like(sink_key)])
    mx = torch.cat([mask, torch.ones(length, 1, dtype=torch.bool, device=mask.device)], dim=1)
    return qx, kx, vx, mx


def attention_output(o: torch.Tensor, gate: torch.Tensor | None, w: AttentionWeights) -> torch.Tensor:
    if gate is not None:
        o = o * torch.sigmoid(gate)
    return F.linear(o, w.o_proj, w.o_bias)


def full_attention(
    x: torch.Tensor,
    w: AttentionWeights,
    cfg: ModelConfig,
    rotary: Rotary,
    meta: PassMeta,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    window: int | None = None,
) -> torch.Tensor:
    q, k, v, gate = attention_inputs(x, w, cfg, rotary, meta.positions, meta.limit)
    if meta.decode is not None:
        from engine.model.decode_attention import decode_attention  # triton: CUDA only

        o = decode_attention(q, k, v, k_cache, v_cache, meta.decode, window, cfg.head_dim**-0.5, w.sinks)
    else:
        assert meta.batch is not None
        o = attention_core(q, k, v, cfg, meta.batch, k_cache, v_cache, window, w.sinks)
    return attention_output(o, gate, w)
