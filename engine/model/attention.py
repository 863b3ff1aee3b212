"""Full (softmax) attention over the paged KV cache: GQA, q/k norm, partial rotary, output gate.

Contract: `full_attention(x, w, cfg, rotary, batch, k_cache, v_cache)` writes the new tokens' keys
and values into the cache slots named by the batch, attends each sequence's new queries over all
its cached and new keys (causal, optional sliding window), and returns the o_proj output [N, H].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.config import ModelConfig
from engine.model.batch import ForwardBatch
from engine.model.ops import Rotary, rms_norm
from engine.weights.layout import AttentionWeights


def full_attention(
    x: torch.Tensor,
    w: AttentionWeights,
    cfg: ModelConfig,
    rotary: Rotary,
    batch: ForwardBatch,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> torch.Tensor:
    n, hd = x.shape[0], cfg.head_dim
    q = F.linear(x, w.q_proj, w.q_bias)
    gate = None
    if cfg.attn_output_gate:
        q, gate = q.view(n, cfg.num_heads, 2 * hd).chunk(2, dim=-1)
        gate = gate.reshape(n, cfg.num_heads * hd)
    q = rms_norm(q.reshape(n, cfg.num_heads, hd), w.q_norm, cfg.rms_norm_eps, cfg.norm_zero_centered)
    k = rms_norm(F.linear(x, w.k_proj, w.k_bias).view(n, cfg.num_kv_heads, hd), w.k_norm, cfg.rms_norm_eps,
                 cfg.norm_zero_centered)
    v = F.linear(x, w.v_proj, w.v_bias).view(n, cfg.num_kv_heads, hd)
    q = rotary.apply(q, batch.positions)
    k = rotary.apply(k, batch.positions)
    out = torch.empty(n, cfg.num_heads, hd, dtype=x.dtype, device=x.device)
    groups = cfg.num_heads // cfg.num_kv_heads
    for s in batch.seqs:
        new_slots = s.kv_slots[s.cached_len:]
        k_cache[new_slots] = k[s.start:s.end]
        v_cache[new_slots] = v[s.start:s.end]
        keys = k_cache[s.kv_slots].repeat_interleave(groups, dim=1)  # [S, heads, hd]
        vals = v_cache[s.kv_slots].repeat_interleave(groups, dim=1)
        total = s.cached_len + s.length
        qpos = torch.arange(s.cached_len, total, device=x.device)[:, None]
        kpos = torch.arange(total, device=x.device)[None, :]
        mask = kpos <= qpos
        if cfg.sliding_window is not None:
            mask &= kpos > qpos - cfg.sliding_window
        o = F.scaled_dot_product_attention(
            q[s.start:s.end].transpose(0, 1), keys.transpose(0, 1), vals.transpose(0, 1),
            attn_mask=mask, scale=hd**-0.5,
        )
        out[s.start:s.end] = o.transpose(0, 1)
    o = out.reshape(n, cfg.num_heads * hd)
    if gate is not None:
        o = o * torch.sigmoid(gate)
    return F.linear(o, w.o_proj, w.o_bias)
