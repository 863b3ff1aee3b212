"""MLA's absorbed attention for decode-sized batches on CUDA, every length read on the device.

Contract: `mla_decode(q, rows, cache, meta, scale, latent_dim)`: q [n, heads, D] the absorbed
queries (q_nope W_UK, then the rotated q_pe; D = kv_lora_rank + qk_rope_head_dim), rows [n, 1, D]
the new tokens' latent rows, cache [slots, 1, D] the latent KV pool of the layer, `meta` the
pass's engine/model/decode_attention.py `DecodeMeta` (slot table and lengths on the device).
Writes the new rows into their slots and returns every query's causal attention over its
sequence's rows with the rows' first `latent_dim` values as the values: [n, heads, latent_dim]
(the caller applies W_UV). It takes kv_lora_rank a power of two >= 16 (every released MLA model:
512; engine/model/mla.py `decode_kernel_serves`).

Like the GQA decode kernel it is split-K: each program takes one token, a block of 16 heads and a
share of the keys, keeps a running max and sum in float32, and a second kernel merges the shares;
the scores sum the dot products over chunks of 64 dims (D is 576 in the released models, not a
power of two). Operands are widened to float32, no TF32. Nothing depends on a host value that
changes between steps, so it is captured in the decode pass's CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.model.decode_attention import DecodeMeta
from engine.model.split_k import SplitShares, online_softmax_step, splits_for, store_share

_BLOCK_N = 32  # keys per inner step
_HEADS = 16  # heads per program
_CHUNK = 64  # dims per score chunk


@triton.jit
def _split_kernel(q_ptr, c_ptr, table_ptr, len_ptr, m_ptr, l_ptr, acc_ptr, table_stride, scale,
                  HEADS: tl.constexpr, D: tl.constexpr, C: tl.constexpr, HB: tl.constexpr, CHUNK: tl.constexpr,
                  D_PAD: tl.constexpr, SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    t = tl.program_id(0)
    hb = tl.program_id(1)
    sid = tl.program_id(2)
    h = hb * HB + tl.arange(0, HB)
    hmask = h < HEADS
    length = tl.load(len_ptr + t)
    chunk = tl.cdiv(tl.cdiv(length, SPLITS), BLOCK_N) * BLOCK_N
    lo = sid * chunk
    hi = tl.minimum(lo + chunk, length)
    m_i = tl.full([HB], float("-inf"), tl.float32)
    l_i = tl.zeros([HB], tl.float32)
    cv = tl.arange(0, C)
    acc = tl.zeros([HB, C], tl.float32)
    start = lo
    while start < hi:  # a while loop: the interpreter's loaded scalars cannot drive range()
        n = start + tl.arange(0, BLOCK_N)
        nmask = n < hi
        slot = tl.load(table_ptr + t * table_stride + n, mask=nmask, other=0).to(tl.int64)
        s = tl.zeros([HB, BLOCK_N], tl.float32)
        for d0 in tl.static_range(0, D_PAD, CHUNK):
            d = d0 + tl.arange(0, CHUNK)
            dmask = d < D
            q = tl.load(q_ptr + (t * HEADS + h)[:, None] * D + d[None, :], mask=hmask[:, None] & dmask[None, :],
                        other=0.0).to(tl.float32)
            k = tl.load(c_ptr + slot[:, None] * D + d[None, :], mask=nmask[:, None] & dmask[None, :],
                        other=0.0).to(tl.float32)
            s += tl.dot(q, tl.trans(k), out_dtype=tl.float32, input_precision="ieee")
        s = tl.where(nmask[None, :], s * scale, float("-inf"))
        v = tl.load(c_ptr + slot[:, None] * D + cv[None, :], mask=nmask[:, None], other=0.0).to(tl.float32)
        m_i, l_i, acc = online_softmax_step(s, v, m_i, l_i, acc)
        start += BLOCK_N
    store_share(m_ptr, l_ptr, acc_ptr, (t * HEADS + h) * SPLITS + sid, hmask, m_i, l_i, acc, cv, C)


def mla_decode(q: torch.Tensor, rows: torch.Tensor, cache: torch.Tensor, meta: DecodeMeta, scale: float,
               latent_dim: int) -> torch.Tensor:
    n, heads, dim = q.shape
    c = latent_dim
    if c < 16 or c & (c - 1) or rows.shape[-1] != dim or cache.shape[1:] != (1, dim):
        raise ValueError(f"MLA decode needs a power-of-two latent >= 16 and rows / cache of {dim} dims, got latent "
                         f"{c}, rows {tuple(rows.shape)}, cache {tuple(cache.shape)}")
    cache.index_copy_(0, meta.new_slots, rows.to(cache.dtype))
    blocks = triton.cdiv(heads, _HEADS)
    splits = splits_for(n, blocks)
    shares = SplitShares.empty(n * heads, splits, c, q.device)
    _split_kernel[(n, blocks, splits)](
        q.contiguous(), cache, meta.table, meta.lengths, shares.maxes, shares.sums, shares.acc,
        meta.table.stride(0), scale, HEADS=heads, D=dim, C=c, HB=_HEADS, CHUNK=_CHUNK,
        D_PAD=triton.cdiv(dim, _CHUNK) * _CHUNK, SPLITS=splits, BLOCK_N=_BLOCK_N, num_warps=4)
    return shares.merge(torch.empty(n, heads, c, dtype=q.dtype, device=q.device))
