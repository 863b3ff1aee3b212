"""Attention for decode-sized batches on CUDA, with every length read on the device.

Contract: `DecodeMeta.build(batch, capacity, device)` lays out, for the batch's n query tokens, the
KV slot of each new token (`new_slots` [n]), each token's sequence's KV slots in position order
(`table` [n, capacity] int32) and how many keys each token attends (`lengths` [n] int32: its
position + 1). `decode_attention(q, k, v, k_cache, v_cache, meta, window, scale, sinks=None,
ring=0)` writes the new keys and values into the cache slots and returns every query's causal
attention over its sequence's keys (GQA; with `window`, only the last `window` keys; with `sinks`
[heads], each head's softmax denominator also counts exp(sink)) as [n, heads * head_dim].

Nothing in `decode_attention` depends on a host value that changes between steps (the grid is fixed
by n, the heads and the split count; the kernel loops up to the lengths it loads), so it can be
captured once in a CUDA graph and replayed for any context length (engine/model/decode_graph.py);
`DecodeMeta.fill` rewrites the same buffers eagerly before each replay.

Sliding-window layers keep each sequence's keys in a ring of R rows (engine/cache/pools.py): with
`ring` = R the kernel reads position p at `table[t, p % R]`, and `DecodeMeta.for_ring(positions,
state_slots, R)` builds that table from each token's state slot with device ops only (row slot * R
+ i), so the captured pass derives it from its position and state-slot buffers. The new keys are
written before the window is read, so R must cover the window plus the sequence's other new
tokens in the pass.

The kernel is split-K ("flash decoding"): each of SPLITS programs per (token, KV head) takes a share
of the keys, keeps a running max and sum in float32 (online softmax), and a second kernel merges the
shares (engine/model/split_k.py, shared with MLA's decode kernel). Operands are widened to float32
and every product and sum is float32 (no TF32), so the only rounding to q's dtype is the output's.
`DecodeMeta.fill` reads the lengths from host integers with a blocking copy: it runs at the start of
a step, when the device has finished the last one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.model.batch import ForwardBatch
from engine.model.split_k import SplitShares, online_softmax_step, splits_for, store_share

_BLOCK_N = 32  # keys per inner step
_NO_WINDOW = 1 << 30


@triton.jit
def _split_kernel(q_ptr, kc_ptr, vc_ptr, table_ptr, len_ptr, m_ptr, l_ptr, acc_ptr,
                  table_stride, scale, window, ring,
                  KV_HEADS: tl.constexpr, GROUPS: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                  SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    t = tl.program_id(0)
    kvh = tl.program_id(1)
    sid = tl.program_id(2)
    heads = KV_HEADS * GROUPS
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D)
    gmask = g < GROUPS
    head = kvh * GROUPS + g
    q = tl.load(q_ptr + (t * heads + head)[:, None] * D + d[None, :], mask=gmask[:, None], other=0.0)
    q = q.to(tl.float32)
    length = tl.load(len_ptr + t)
    first = tl.maximum(length - window, 0)  # window is huge without a sliding window
    span = length - first
    chunk = tl.cdiv(tl.cdiv(span, SPLITS), BLOCK_N) * BLOCK_N
    lo = first + sid * chunk
    hi = tl.minimum(lo + chunk, length)
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    # a while loop, not range(lo, hi): under TRITON_INTERPRET (the CPU tests of this kernel) a
    # loaded scalar is a one-element array, which range() cannot take
    start = lo
    while start < hi:
        n = start + tl.arange(0, BLOCK_N)
        nmask = n < hi
        slot = tl.load(table_ptr + t * table_stride + n % ring, mask=nmask, other=0).to(tl.int64)
        kv_off = (slot * KV_HEADS + kvh)[:, None] * D + d[None, :]
        k = tl.load(kc_ptr + kv_off, mask=nmask[:, None], other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), out_dtype=tl.float32, input_precision="ieee") * scale
        s = tl.where(nmask[None, :], s, float("-inf"))
        v = tl.load(vc_ptr + kv_off, mask=nmask[:, None], other=0.0).to(tl.float32)
        m_i, l_i, acc = online_softmax_step(s, v, m_i, l_i, acc)
        start += BLOCK_N
    store_share(m_ptr, l_ptr, acc_ptr, (t * heads + head) * SPLITS + sid, gmask, m_i, l_i, acc, d, D)


@dataclass
class DecodeMeta:
    new_slots: torch.Tensor  # [n] long
    table: torch.Tensor  # [n, capacity] int32
    lengths: torch.Tensor  # [n] int32

    @classmethod
    def empty(cls, tokens: int, capacity: int, device: torch.device) -> DecodeMeta:
        return cls(torch.zeros(tokens, dtype=torch.long, device=device),
                   torch.zeros(tokens, capacity, dtype=torch.int32, device=device),
                   torch.ones(tokens, dtype=torch.int32, device=device))

    @classmethod
    def for_ring(cls, positions: torch.Tensor, state_slots: torch.Tensor, ring: int) -> DecodeMeta:
        """The table of ring layers for tokens at `positions` [n] whose sequences own `state_slots`
        [n] (device ops only: capturable)."""
        base = state_slots.long() * ring
        table = (base[:, None] + torch.arange(ring, device=base.device)).to(torch.int32)
        return cls(base + positions % ring, table, (positions + 1).to(torch.int32))

    @classmethod
    def build(cls, batch: ForwardBatch, device: torch.device) -> DecodeMeta:
        meta = cls.empty(batch.num_tokens, batch.position_limit, device)
        meta.fill(batch)
        return meta

    def fill(self, batch: ForwardBatch) -> None:
        """Rewrites the buffers for `batch` (queued device ops only: no host-to-device copy)."""
        if batch.num_tokens != self.new_slots.shape[0]:
            raise ValueError(f"decode metadata for {self.new_slots.shape[0]} tokens, the batch has {batch.num_tokens}")
        if batch.position_limit > self.table.shape[1]:
            raise ValueError(f"a sequence of {batch.position_limit} tokens exceeds the table's {self.table.shape[1]}")
        for s in batch.seqs:
            total = s.cached_len + s.length
            self.new_slots[s.start:s.end].copy_(s.kv_slots[s.cached_len:total])
            self.table[s.start:s.end, :total].copy_(s.kv_slots[:total].expand(s.length, total))
        # a token at position p sees p + 1 tokens (the scheduler numbers a sequence's new tokens
        # from its cached length): a device op, not a host list copied over
        torch.add(batch.positions, 1, out=self.lengths)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     meta: DecodeMeta, window: int | None, scale: float,
                     sinks: torch.Tensor | None = None, ring: int = 0) -> torch.Tensor:
    """q [n, heads, D], k / v [n, kv_heads, D]; caches [slots, kv_heads, D] (ring rows with `ring`).
    Returns [n, heads * D]."""
    n, heads, dim = q.shape
    kv_heads = k.shape[1]
    if heads % kv_heads or dim & (dim - 1) or dim < 16:
        raise ValueError(f"decode attention needs heads divisible by KV heads and a power-of-two head dim >= 16, "
                         f"got {heads} heads, {kv_heads} KV heads, head dim {dim}")
    k_cache.index_copy_(0, meta.new_slots, k.to(k_cache.dtype))
    v_cache.index_copy_(0, meta.new_slots, v.to(v_cache.dtype))
    groups = heads // kv_heads
    splits = splits_for(n, kv_heads)
    shares = SplitShares.empty(n * heads, splits, dim, q.device)
    _split_kernel[(n, kv_heads, splits)](
        q.contiguous(), k_cache, v_cache, meta.table, meta.lengths, shares.maxes, shares.sums, shares.acc,
        meta.table.stride(0), scale, window or _NO_WINDOW, ring or _NO_WINDOW, KV_HEADS=kv_heads, GROUPS=groups,
        G_PAD=max(16, triton.next_power_of_2(groups)), D=dim, SPLITS=splits, BLOCK_N=_BLOCK_N, num_warps=4)
    out = shares.merge(torch.empty(n, heads, dim, dtype=q.dtype, device=q.device), sinks)
    return out.reshape(n, heads * dim)
