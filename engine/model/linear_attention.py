"""Gated DeltaNet layer (Qwen3.5 / Qwen3-Next linear attention) over per-sequence recurrent state.

Contract: `gated_deltanet(x, w, cfg, batch, conv_state, ssm_state)` runs each sequence's new
tokens from its state slot (conv window [slots, C, K-1], SSM state [slots, Hv, dk, dv] float32),
updates that slot in place, and returns out_proj output [N, H]. On CUDA with fla-core installed
the chunked / fused-recurrent Triton kernels are used; otherwise the torch ops in `gdn_ops`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.config import ModelConfig
from engine.model import gdn_ops
from engine.model.batch import ForwardBatch
from engine.model.ops import gated_rms_norm
from engine.weights.layout import LinearAttentionWeights


def gated_deltanet(
    x: torch.Tensor,
    w: LinearAttentionWeights,
    cfg: ModelConfig,
    batch: ForwardBatch,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
) -> torch.Tensor:
    n = x.shape[0]
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    mixed = F.linear(x, w.in_proj_qkv)
    z = F.linear(x, w.in_proj_z)
    beta = torch.sigmoid(F.linear(x, w.in_proj_b))
    g = -w.a_log.float().exp() * F.softplus(F.linear(x, w.in_proj_a).float() + w.dt_bias)
    core = torch.empty(n, hv, dv, dtype=x.dtype, device=x.device)
    rep = hv // hk
    for s in batch.seqs:
        sl = slice(s.start, s.end)
        conv_out, conv_state[s.state_slot] = gdn_ops.causal_conv1d(mixed[sl], conv_state[s.state_slot], w.conv)
        q, k, v = torch.split(conv_out, [cfg.linear_key_dim, cfg.linear_key_dim, cfg.linear_value_dim], dim=-1)
        q = q.reshape(s.length, hk, dk).repeat_interleave(rep, dim=1)
        k = k.reshape(s.length, hk, dk).repeat_interleave(rep, dim=1)
        v = v.reshape(s.length, hv, dv)
        o, ssm_state[s.state_slot] = gdn_ops.gated_delta_rule(q, k, v, g[sl], beta[sl], ssm_state[s.state_slot])
        core[sl] = o.to(x.dtype)
    core = gated_rms_norm(core.reshape(n * hv, dv), z.reshape(n * hv, dv), w.norm, cfg.rms_norm_eps)
    return F.linear(core.reshape(n, hv * dv), w.out_proj)
