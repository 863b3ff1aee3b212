"""Gated DeltaNet layer (Qwen3.5 / Qwen3-Next linear attention) over per-sequence recurrent state.

Contract: `gated_deltanet(x, w, cfg, meta, conv_state, ssm_state)` runs each sequence's new
tokens from its state slot (conv window [slots, C, K-1], SSM state [slots, Hv, dk, dv] float32),
updates that slot in place, and returns out_proj output [N, H]. Passes where every sequence has
exactly one new token (decode: the pass meta names each token's state slot, `meta.state_slots`)
take `gated_deltanet_decode`: all sequences at once, state slots named by a device tensor, no
host read, so a captured pass (engine/model/decode_graph.py) holds it; the recurrence and the
conv's dot are float32. On CUDA the same step runs as three Triton kernels
(engine/model/fused_gdn.py; the option kernels.fused_gdn off keeps the torch ops). Longer chunks: for
bf16/fp16 models on CUDA, when fla-core imports, the whole batch goes through fla's chunked Triton
kernel as one varlen call (one per round of pieces when a sequence has cuts: `SeqEntry.cuts`,
whose slots receive the conv window and the SSM state at each cut); float32 models (whose promise
is the reference's logits to 1e-4) and other devices use the torch ops in `gdn_ops` per sequence
(per piece). The option kernels.gdn (torch | fla)
forces either path for those chunks.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from engine.config import ModelConfig
from engine.model import gdn_ops
from engine.model.batch import ForwardBatch, PassMeta
from engine.model.ops import fused_gdn_enabled, gated_rms_norm, kernel_options
from engine.weights.layout import LinearAttentionWeights


def _fla(x: torch.Tensor) -> Any | None:
    """fla's kernels for x, or None for the torch ops. fla's Triton dots run in TF32, so float32
    models keep the exact torch path unless kernels.gdn = fla forces the kernels."""
    choice = kernel_options().gdn
    if choice == "torch" or not x.is_cuda or (choice != "fla" and x.dtype == torch.float32):
        return None
    return _import_fla()


@functools.cache
def _import_fla() -> Any | None:
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception:  # fla needs triton and a GPU; absent on CPU-only machines
        return None
    return chunk_gated_delta_rule


def gated_deltanet(
    x: torch.Tensor,
    w: LinearAttentionWeights,
    cfg: ModelConfig,
    meta: PassMeta,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
) -> torch.Tensor:
    if meta.state_slots is not None:
        return gated_deltanet_decode(x, w, cfg, meta.state_slots, conv_state, ssm_state)
    batch = meta.batch
    assert batch is not None
    n = x.shape[0]
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    mixed, z, beta, g = _projections(x, w)
    conv_out = torch.empty_like(mixed)
    for s in batch.seqs:
        for a, b, save in s.pieces():
            conv_out[a:b], conv_state[s.state_slot] = gdn_ops.causal_conv1d(mixed[a:b], conv_state[s.state_slot],
                                                                           w.conv)
            if save >= 0:
                conv_state[save] = conv_state[s.state_slot]
    q, k, v = torch.split(conv_out, [cfg.linear_key_dim, cfg.linear_key_dim, cfg.linear_value_dim], dim=-1)
    q, k, v = q.reshape(n, hk, dk), k.reshape(n, hk, dk), v.reshape(n, hv, dv)
    kernels = _fla(x)
    if kernels is not None:
        core = _fla_pieces(kernels, q, k, v, g, beta, batch, ssm_state).to(x.dtype)
    else:
        core = torch.empty(n, hv, dv, dtype=x.dtype, device=x.device)
        rep = hv // hk
        for s in batch.seqs:
            for a, b, save in s.pieces():
                o, ssm_state[s.state_slot] = gdn_ops.gated_delta_rule(
                    q[a:b].repeat_interleave(rep, dim=1), k[a:b].repeat_interleave(rep, dim=1), v[a:b], g[a:b],
                    beta[a:b], ssm_state[s.state_slot])
                core[a:b] = o.to(x.dtype)
                if save >= 0:
                    ssm_state[save] = ssm_state[s.state_slot]
    core = gated_rms_norm(core.reshape(n * hv, dv), z.reshape(n * hv, dv), w.norm, cfg.rms_norm_eps)
    return F.linear(core.reshape(n, hv * dv), w.out_proj)


def _projections(x: torch.Tensor, w: LinearAttentionWeights
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The conv input, the output gate z, beta and the log decay g (float32) of every token."""
    mixed = F.linear(x, w.in_proj_qkv)
    z = F.linear(x, w.in_proj_z)
    beta = torch.sigmoid(F.linear(x, w.in_proj_b))
    g = -w.a_log.float().exp() * F.softplus(F.linear(x, w.in_proj_a).float() + w.dt_bias)
    return mixed, z, beta, g


def gated_deltanet_decode(x: torch.Tensor, w: LinearAttentionWeights, cfg: ModelConfig, slots: torch.Tensor,
                          conv_state: torch.Tensor, ssm_state: torch.Tensor) -> torch.Tensor:
    """One new token per sequence: x [N, H], token i's state in slot slots[i] (a device tensor)."""
    if x.is_cuda and fused_gdn_enabled():
        from engine.model import fused_gdn  # triton: imported where CUDA runs

        if fused_gdn.fits(cfg):
            return gated_deltanet_decode_fused(x, w, cfg, slots, conv_state, ssm_state)
    n = x.shape[0]
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    mixed, z, beta, g = _projections(x, w)
    conv_out, window = gdn_ops.conv_step(mixed, conv_state.index_select(0, slots), w.conv)
    conv_state.index_copy_(0, slots, window)
    q, k, v = torch.split(conv_out, [cfg.linear_key_dim, cfg.linear_key_dim, cfg.linear_value_dim], dim=-1)
    q, k = gdn_ops.prep(q.reshape(n, hk, dk).repeat_interleave(hv // hk, dim=1),
                        k.reshape(n, hk, dk).repeat_interleave(hv // hk, dim=1))
    core, state = gdn_ops.recurrent_step(q, k, v.reshape(n, hv, dv).float(), g, beta.float(),
                                         ssm_state.index_select(0, slots).float())
    ssm_state.index_copy_(0, slots, state.to(ssm_state.dtype))
    core = gated_rms_norm(core.to(x.dtype).reshape(n * hv, dv), z.reshape(n * hv, dv), w.norm, cfg.rms_norm_eps)
    return F.linear(core.reshape(n, hv * dv), w.out_proj)


def gated_deltanet_decode_fused(x: torch.Tensor, w: LinearAttentionWeights, cfg: ModelConfig, slots: torch.Tensor,
                                conv_state: torch.Tensor, ssm_state: torch.Tensor) -> torch.Tensor:
    """`gated_deltanet_decode` with the conv, the delta rule and the gated norm as three Triton
    kernels (engine/model/fused_gdn.py, engine/model/fused_ops.py) around the same projections."""
    from engine.model import fused_gdn, fused_ops

    n, hv, dv = x.shape[0], cfg.linear_num_value_heads, cfg.linear_value_head_dim
    core = fused_gdn.decode_core(F.linear(x, w.in_proj_qkv), F.linear(x, w.in_proj_b), F.linear(x, w.in_proj_a),
                                 w, cfg, slots, conv_state, ssm_state)
    z = F.linear(x, w.in_proj_z)
    core = fused_ops.gated_rms_norm(core.view(n * hv, dv), z.view(n * hv, dv), w.norm, cfg.rms_norm_eps)
    return F.linear(core.view(n, hv * dv), w.out_proj)


def _fla_pieces(kernels: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor, batch: ForwardBatch, ssm_state: torch.Tensor) -> torch.Tensor:
    """fla's chunked rule over the batch: one varlen call when no sequence has cuts, else one call
    per round (the r-th piece of every sequence that has one), each piece starting from the state
    the previous left in the sequence's slot, the cuts' slots filled between rounds."""
    if not any(s.cuts for s in batch.seqs):
        return _fla_rule(kernels, q, k, v, g, beta, [(s.start, s.end, s.state_slot) for s in batch.seqs], ssm_state,
                         batch.state_slots(q.device))
    out = torch.empty(v.shape, dtype=q.dtype, device=v.device)
    pieces = [s.pieces() for s in batch.seqs]
    for r in range(max(len(p) for p in pieces)):
        now = [(s, p[r]) for s, p in zip(batch.seqs, pieces, strict=True) if r < len(p)]
        index = torch.cat([torch.arange(a, b) for _, (a, b, _) in now]).to(v.device)
        flat: list[tuple[int, int, int]] = []
        at = 0
        for s, (a, b, _) in now:
            flat.append((at, at + b - a, s.state_slot))
            at += b - a
        out[index] = _fla_rule(kernels, q[index], k[index], v[index], g[index], beta[index], flat, ssm_state)
        for s, (_, _, save) in now:
            if save >= 0:
                ssm_state[save] = ssm_state[s.state_slot]
    return out


def _fla_rule(kernels: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
              beta: torch.Tensor, seqs: list[tuple[int, int, int]], ssm_state: torch.Tensor,
              slots: torch.Tensor | None = None) -> torch.Tensor:
    """One varlen call over `seqs` ((start, end, state slot), contiguous from 0 in q's rows);
    `slots`: their state slots on q's device, when the caller has them."""
    chunk_rule = kernels
    if slots is None:
        slots = torch.tensor([slot for _, _, slot in seqs], dtype=torch.long).to(q.device)
    cu = torch.tensor([0, *[end for _, end, _ in seqs]], dtype=torch.long).to(q.device)
    out, final = chunk_rule(
        q=q[None], k=k[None], v=v[None], g=g[None], beta=beta.float()[None],
        initial_state=ssm_state[slots], output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
    )
    ssm_state[slots] = final.float()
    return out[0]
