"""Softmax attention over the paged KV cache: GQA, q/k norm, partial rotary, output gate, sinks.

Contract: `full_attention(x, w, cfg, rotary, meta, k_cache, v_cache, window, ring)` writes the new
tokens' keys and values into the cache, attends each sequence's new queries over all its cached and
new keys (causal; with `window`, only the last `window` keys, the query's own included), and
returns the o_proj output [N, H]. The cache is the KV pool's layer, addressed by each sequence's KV
slots, or with `ring` > 0 (sliding-window layers) the state pool's rings of that many rows,
addressed by each sequence's state slot and the position (`cache_rows`). With sinks (`w.sinks`, one
logit per head) each head's softmax also counts exp(sink) in its denominator, as if over one more
key whose value is zero. It is three parts: `attention_inputs` (projections, norms, rotary), the mix
across tokens, `attention_output` (gate, o_proj). The mix is the split-K decode kernel when the
pass meta carries its device-side lengths (`meta.decode`, and `meta.ring` for ring layers:
decode-sized passes on CUDA, captured or not, so a step computes the same either way), else
`attention_core`, which walks `meta.batch`'s sequences.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from engine.config import ModelConfig
from engine.model.batch import ForwardBatch, PassMeta, SeqEntry
from engine.model.kernel_limits import DECODE_ATTENTION_TOKENS as DECODE_ATTENTION_TOKENS
from engine.model.ops import Rotary, rms_norm
from engine.weights.layout import AttentionWeights


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
                   sinks: torch.Tensor | None = None, ring: int = 0) -> torch.Tensor:
    """The mix across tokens, per sequence: attends each sequence's queries over its cached keys
    (only the window's, with `window`) and its new ones, then writes the new keys/values into the
    cache (into the ring, with `ring`: only the last `ring` of them); returns [n, heads * hd]."""
    n, hd = q.shape[0], cfg.head_dim
    out = torch.empty(n, cfg.num_heads, hd, dtype=q.dtype, device=q.device)
    groups = cfg.num_heads // cfg.num_kv_heads
    for s in batch.seqs:
        cached, total = s.cached_len, s.cached_len + s.length
        lo = 0 if window is None else max(0, cached - window + 1)
        old = cache_rows(s, lo, cached, ring)
        keys = torch.cat([k_cache[old], k[s.start:s.end].to(k_cache.dtype)])
        vals = torch.cat([v_cache[old], v[s.start:s.end].to(v_cache.dtype)])
        skip = max(s.length - ring, 0) if ring else 0  # a chunk longer than the ring keeps its tail
        new = cache_rows(s, cached + skip, total, ring)
        k_cache[new] = k[s.start + skip:s.end].to(k_cache.dtype)
        v_cache[new] = v[s.start + skip:s.end].to(v_cache.dtype)
        qs = q[s.start:s.end]
        if window is None:
            if sinks is None:
                out[s.start:s.end] = _causal(qs, keys, vals, groups, hd**-0.5)
            else:
                qs, keys, vals = _sink_as_key(qs, keys.repeat_interleave(groups, dim=1),
                                              vals.repeat_interleave(groups, dim=1), sinks, hd**-0.5)
                out[s.start:s.end] = _causal(qs, keys, vals, 1, hd**-0.5)[..., :hd]
            continue
        keys, vals = keys.repeat_interleave(groups, dim=1), vals.repeat_interleave(groups, dim=1)
        qpos = torch.arange(cached, total, device=q.device)[:, None]
        kpos = torch.arange(lo, total, device=q.device)[None, :]
        mask = (kpos <= qpos) & (kpos > qpos - window)
        if sinks is not None:
            qs, keys, vals = _sink_as_key(qs, keys, vals, sinks, hd**-0.5)
            mask = torch.cat([torch.ones(mask.shape[0], 1, dtype=torch.bool, device=mask.device), mask], dim=1)
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


def _causal(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, groups: int, scale: float) -> torch.Tensor:
    """Causal attention of the chunk's L queries [L, heads, hd] over S >= L keys and values
    [S, kv_heads, hd], the queries being the last L positions (a lower-right causal mask, never
    materialised on CUDA: SDPA's flash or memory-efficient kernel applies it), [L, heads, hd] out.
    The keys and values are expanded to every query head once, [1, heads, S, hd] contiguous."""
    length, total = q.shape[0], keys.shape[0]
    kx = keys.transpose(0, 1).repeat_interleave(groups, dim=0)[None]
    vx = vals.transpose(0, 1).repeat_interleave(groups, dim=0)[None]
    o = F.scaled_dot_product_attention(q.transpose(0, 1).contiguous()[None], kx, vx,
                                       attn_mask=causal_lower_right(length, total), scale=scale)
    return o[0].transpose(0, 1)


def cache_rows(s: SeqEntry, lo: int, hi: int, ring: int = 0) -> torch.Tensor:
    """The cache rows of positions [lo, hi) of sequence `s`: its KV slots, or (`ring` > 0) the rows
    of its state slot's ring (engine/cache/pools.py: slot * ring + position % ring)."""
    if not ring:
        return s.kv_slots[lo:hi]
    assert s.state_slot >= 0, "a sliding-window layer needs the sequence's state slot (its ring)"
    return s.state_slot * ring + torch.arange(lo, hi, device=s.kv_slots.device) % ring


def _sink_as_key(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, sinks: torch.Tensor,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sinks as one more key that every query sees, placed first (so a lower-right causal mask over
    the S + 1 keys still lets each query see it), with score sink[h] and a zero value, so the same
    SDPA kernels run: the head dim grows by 8 (zeros but one: 1 in the queries, sink / scale in that
    key); the caller drops the extra output dims. q [L, heads, hd], keys / vals [S, heads, hd]."""
    heads, hd = q.shape[1], q.shape[2]
    qx = F.pad(q, (0, 8))
    qx[..., hd] = 1
    sink_key = torch.zeros(1, heads, hd + 8, dtype=keys.dtype, device=keys.device)
    sink_key[0, :, hd] = sinks.to(keys.dtype) / scale
    kx = torch.cat([sink_key, F.pad(keys, (0, 8))])
    vx = torch.cat([torch.zeros_like(sink_key), F.pad(vals, (0, 8))])
    return qx, kx, vx


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
    ring: int = 0,
) -> torch.Tensor:
    q, k, v, gate = attention_inputs(x, w, cfg, rotary, meta.positions, meta.limit)
    if meta.decode is not None:
        from engine.model.decode_attention import decode_attention  # triton: CUDA only

        table = meta.ring if ring else meta.decode
        assert table is not None, "a sliding-window layer through the decode kernel needs the ring's table"
        o = decode_attention(q, k, v, k_cache, v_cache, table, window, cfg.head_dim**-0.5, w.sinks, ring)
    else:
        assert meta.batch is not None
        o = attention_core(q, k, v, cfg, meta.batch, k_cache, v_cache, window, w.sinks, ring)
    return attention_output(o, gate, w)
