"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2, GLM-4.7-Flash) over a latent KV cache.

Contract: `mla_attention(x, w, cfg, rotary, meta, cache)` writes each new token's latent row into
its KV slot and returns the o_proj output [N, H]. A latent row is the normed KV latent c
[kv_lora_rank] followed by the rotated rope key [qk_rope_head_dim], shared by every head, so a
token costs kv_lora_rank + qk_rope_head_dim values per layer (`cache` is [slots, 1, that]). Per
head the query is [q_nope, q_pe] and the key is [k_nope, k_pe] with k_nope, v from kv_b_proj(c).
Each sequence's new queries attend over its cached and new rows (causal) in one of two forms of the
same function (`mla_core`):
- expanded (prefill): k_nope and v are computed for every key, then ordinary attention over
  heads of qk_nope + qk_rope dims with values of v_head_dim;
- absorbed (decode): W_UK is folded into the query (q_nope W_UK: a query in the latent space) and
  W_UV applied after the mix, so the heads attend over the latent rows themselves as one shared
  key / value head (MQA over kv_lora_rank + qk_rope_head_dim) and nothing is expanded.
On CUDA a decode-sized pass (its meta carries the device-side `decode` form) runs the absorbed form
through the split-K kernel of engine/model/mla_decode.py instead, so the pass can be captured in a
CUDA graph; `decode_kernel_serves(cfg)` says when it can (kv_lora_rank a power of two >= 16).
`absorbs(cfg, new_tokens)` picks the form with fewer multiply-adds per head: absorbed while
new_tokens x (2 kv_lora - nope - v) < kv_lora x (nope + v) (DeepSeek-V3: under 171 tokens).
The softmax scale is (nope + rope)^-0.5 times YaRN's mscale(factor, mscale_all_dim) squared when the
rotary type is scaled (engine/model/rope.py `softmax_mscale`); the rotary tables carry the
attention factor. DeepSeek stores rope dims as interleaved pairs (`cfg.rope_interleave`): they are
de-interleaved before the rotation, which is the same map as rotating the pairs in place.
q_a_layernorm and kv_a_layernorm use eps 1e-6, as the reference modules do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from engine.config import ModelConfig
from engine.model.batch import ForwardBatch, PassMeta
from engine.model.ops import Rotary, rms_norm
from engine.model.rope import softmax_mscale
from engine.weights.layout import MlaWeights

LATENT_NORM_EPS = 1e-6  # the reference's q_a_layernorm / kv_a_layernorm keep their default eps


def softmax_scale(cfg: ModelConfig) -> float:
    return (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5 * softmax_mscale(cfg.rope_scaling) ** 2


def absorbs(cfg: ModelConfig, new_tokens: int) -> bool:
    """Whether `new_tokens` queries of one sequence attend in the absorbed form."""
    c, nope, v = cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.v_head_dim
    return new_tokens * (2 * c - nope - v) < c * (nope + v)


def decode_kernel_serves(cfg: ModelConfig) -> bool:
    c = cfg.kv_lora_rank
    return cfg.attention_kind == "mla" and c >= 16 and not c & (c - 1)


def _absorbed_query(q_nope: torch.Tensor, q_pe: torch.Tensor, w_kv: torch.Tensor, nope: int) -> torch.Tensor:
    """[L, heads, c + rope]: q_nope W_UK (the query in the latent space), then q_pe."""
    return torch.cat((torch.einsum("lhn,hnc->lhc", q_nope, w_kv[:, :nope]), q_pe), dim=-1)


def _rotate(x: torch.Tensor, cfg: ModelConfig, rotary: Rotary, positions: torch.Tensor, limit: int) -> torch.Tensor:
    if cfg.rope_interleave:  # (x0, x1), (x2, x3), ... -> x0, x2, ..., x1, x3, ...
        x = x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
    return rotary.apply(x.contiguous(), positions, limit)


def mla_inputs(x: torch.Tensor, w: MlaWeights, cfg: ModelConfig, rotary: Rotary, positions: torch.Tensor,
               limit: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token part: q_nope [n, heads, nope], rotated q_pe [n, heads, rope], and the latent rows
    [n, 1, kv_lora + rope] the cache stores."""
    n, heads = x.shape[0], cfg.num_heads
    nope, rope, c = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    if w.q_proj is not None:
        q = F.linear(x, w.q_proj)
    else:
        assert w.q_a_proj is not None and w.q_a_norm is not None and w.q_b_proj is not None
        q_a = rms_norm(F.linear(x, w.q_a_proj, w.q_a_bias), w.q_a_norm, LATENT_NORM_EPS, False)
        q = F.linear(q_a, w.q_b_proj)
    q = q.view(n, heads, nope + rope)
    q_nope, q_pe = q[..., :nope], _rotate(q[..., nope:], cfg, rotary, positions, limit)
    kv = F.linear(x, w.kv_a_proj, w.kv_a_bias)
    latent = rms_norm(kv[:, :c], w.kv_a_norm, LATENT_NORM_EPS, False)
    k_pe = _rotate(kv[:, None, c:], cfg, rotary, positions, limit)
    return q_nope, q_pe, torch.cat((latent[:, None, :], k_pe), dim=-1)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of q [heads, L, d], the last L of S positions, over k [kh, S, d], v [kh, S, dv]
    (kh 1 or heads) -> [L, heads, dv]. With every head's own keys (the expanded form: long prompts)
    SDPA applies the lower-right causal bias in its flash or memory-efficient kernel, with no mask;
    the shared key head of the absorbed form (short chunks) takes a boolean [L, S] mask."""
    length, total = q.shape[1], k.shape[1]
    if k.shape[0] == q.shape[0]:
        o = F.scaled_dot_product_attention(q.contiguous()[None], k.contiguous()[None], v.contiguous()[None],
                                           attn_mask=causal_lower_right(length, total), scale=scale)[0]
    else:
        qpos = torch.arange(total - length, total, device=q.device)[:, None]
        mask = torch.arange(total, device=q.device)[None, :] <= qpos
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return o.transpose(0, 1)


def mla_core(q_nope: torch.Tensor, q_pe: torch.Tensor, rows: torch.Tensor, kv_b_proj: torch.Tensor,
             cfg: ModelConfig, absorbed: bool) -> torch.Tensor:
    """One sequence: queries q_nope [L, heads, nope], q_pe [L, heads, rope] at the last L of its S
    latent rows [S, kv_lora + rope], causal -> [L, heads * v] in either form."""
    heads, nope, v_dim, c = cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    scale = softmax_scale(cfg)
    w_kv = kv_b_proj.view(heads, nope + v_dim, c)
    if absorbed:
        q = _absorbed_query(q_nope, q_pe, w_kv, nope).transpose(0, 1)  # [heads, L, c + rope]
        o_latent = _sdpa(q, rows[None], rows[None, :, :c], scale)  # [L, heads, c]
        o = torch.einsum("lhc,hvc->lhv", o_latent, w_kv[:, nope:])  # W_UV after the mix
    else:
        kv = F.linear(rows[:, :c], kv_b_proj).view(-1, heads, nope + v_dim)  # [S, heads, nope + v]
        k_pe = rows[:, None, c:].expand(-1, heads, -1)
        k = torch.cat((kv[..., :nope], k_pe), dim=-1)
        q = torch.cat((q_nope, q_pe), dim=-1)
        o = _sdpa(q.transpose(0, 1), k.transpose(0, 1), kv[..., nope:].transpose(0, 1), scale)
    return o.reshape(o.shape[0], heads * v_dim)


def mla_mix(q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, kv_b_proj: torch.Tensor,
            cfg: ModelConfig, batch: ForwardBatch, cache: torch.Tensor) -> torch.Tensor:
    """The mix across tokens, per sequence: writes the new latent rows into the cache and attends
    each sequence's queries over all its rows; returns [n, heads * v]."""
    n = q_nope.shape[0]
    out = torch.empty(n, cfg.num_heads * cfg.v_head_dim, dtype=q_nope.dtype, device=q_nope.device)
    for s in batch.seqs:
        cache[s.kv_slots[s.cached_len:]] = latent[s.start:s.end]
        rows = cache[s.kv_slots][:, 0]  # [S, kv_lora + rope]
        out[s.start:s.end] = mla_core(q_nope[s.start:s.end], q_pe[s.start:s.end], rows, kv_b_proj, cfg,
                                      absorbs(cfg, s.length))
    return out


def mla_attention(x: torch.Tensor, w: MlaWeights, cfg: ModelConfig, rotary: Rotary, meta: PassMeta,
                  cache: torch.Tensor) -> torch.Tensor:
    q_nope, q_pe, latent = mla_inputs(x, w, cfg, rotary, meta.positions, meta.limit)
    if meta.decode is not None:
        from engine.model.mla_decode import mla_decode  # triton: CUDA only

        heads, nope, c = cfg.num_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank
        w_kv = w.kv_b_proj.view(heads, nope + cfg.v_head_dim, c)
        o_latent = mla_decode(_absorbed_query(q_nope, q_pe, w_kv, nope), latent, cache, meta.decode,
                              softmax_scale(cfg), c)
        o = torch.einsum("lhc,hvc->lhv", o_latent, w_kv[:, nope:]).reshape(x.shape[0], -1)
    else:
        assert meta.batch is not None
        o = mla_mix(q_nope, q_pe, latent, w.kv_b_proj, cfg, meta.batch, cache)
    return F.linear(o, w.o_proj, w.o_bias)
