"""The split-K ("flash decoding") pieces the decode attention kernels share.

Contract: a split kernel gives each program a share of one query row's keys; it keeps, per row, a
running max, sum and unnormalized output in float32 (`online_softmax_step` per block of keys,
every product and sum float32, no TF32) and writes them with `store_share` into a `SplitShares`
(flat index (token * heads + head) * splits + split). `SplitShares.merge` then combines each
row's shares into one normalized row in the output's dtype; a split that saw no key (max -inf)
counts for nothing; with sinks [heads], each head's denominator also counts exp(sink).
`splits_for(tokens, programs)` is the split count that fills a large GPU at batch 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


def splits_for(tokens: int, kv_heads: int) -> int:
    """Programs per (token, KV head) (MLA: per block of heads): enough in all to cover the SMs of a
    large GPU at batch 1."""
    return max(1, min(64, triton.next_power_of_2(max(1, 128 // (tokens * kv_heads)))))


@triton.jit
def online_softmax_step(s, v, m_i, l_i, acc):
    """One block of keys into a split's running state: scores `s` [rows, keys] (masked keys -inf),
    values `v` [keys, width]; returns the new (max, sum, unnormalized output)."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    acc = acc * alpha[:, None] + tl.dot(p, v, out_dtype=tl.float32, input_precision="ieee")
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc


@triton.jit
def store_share(m_ptr, l_ptr, acc_ptr, part, mask, m_i, l_i, acc, cols, WIDTH: tl.constexpr):
    """A split's final state into `SplitShares` at flat indices `part` [rows] (rows where `mask`)."""
    tl.store(m_ptr + part, m_i, mask=mask)
    tl.store(l_ptr + part, l_i, mask=mask)
    tl.store(acc_ptr + part[:, None] * WIDTH + cols[None, :], acc, mask=mask[:, None])


@triton.jit
def _merge_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, sink_ptr, HEADS: tl.constexpr, D: tl.constexpr,
                  SPLITS: tl.constexpr, HAS_SINK: tl.constexpr):
    row = tl.program_id(0)  # token * heads + head
    s = tl.arange(0, SPLITS)
    d = tl.arange(0, D)
    m = tl.load(m_ptr + row * SPLITS + s)
    l_ = tl.load(l_ptr + row * SPLITS + s)
    acc = tl.load(acc_ptr + (row * SPLITS + s)[:, None] * D + d[None, :])
    top = tl.max(m, axis=0)
    if HAS_SINK:
        sink = tl.load(sink_ptr + row % HEADS).to(tl.float32)
        top = tl.maximum(top, sink)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - top))
    total = tl.sum(w * l_, axis=0)
    if HAS_SINK:
        total += tl.exp(sink - top)
    out = tl.sum(acc * w[:, None], axis=0) / total
    tl.store(out_ptr + row * D + d, out.to(out_ptr.dtype.element_ty))


@dataclass(frozen=True)
class SplitShares:
    """The float32 shares of a split-K pass: per (token, head, split) a running max (`maxes`), a
    sum (`sums`) and an unnormalized output row `acc` of `width` values; `merge` combines each
    (token, head)'s splits into one normalized row."""

    maxes: torch.Tensor  # [rows * splits]
    sums: torch.Tensor  # [rows * splits]
    acc: torch.Tensor  # [rows * splits, width]
    splits: int

    @classmethod
    def empty(cls, rows: int, splits: int, width: int, device: torch.device) -> SplitShares:
        """Shares for `rows` (token, head) pairs."""
        maxes = torch.empty(rows * splits, dtype=torch.float32, device=device)
        acc = torch.empty(rows * splits, width, dtype=torch.float32, device=device)
        return cls(maxes, torch.empty_like(maxes), acc, splits)

    def merge(self, out: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Writes every (token, head)'s merged row into `out` [n, heads, width] (with `sinks` [heads],
        each head's denominator also counts exp(sink)) and returns it."""
        n, heads, width = out.shape
        sink_ptr = self.maxes if sinks is None else sinks  # read only with HAS_SINK
        _merge_kernel[(n * heads,)](self.maxes, self.sums, self.acc, out, sink_ptr, HEADS=heads, D=width,
                                    SPLITS=self.splits, HAS_SINK=sinks is not None, num_warps=4)
        return out
