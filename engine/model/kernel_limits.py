"""The sizes the fused Triton kernels (engine/model/fused_ops.py) take, importable without triton.

Contract: `FUSED_NORM_MAX_DIM` is the widest row a fused norm holds in one program;
`fused_router_serves(experts, top_k)` says whether the fused router (`fused_ops.route_topk`)
takes these sizes. engine/model/ops.py dispatches to a kernel only within them.
`DECODE_ATTENTION_TOKENS`: passes of up to this many tokens attend with the split-K decode kernel
(engine/model/decode_attention.py) on CUDA; it also sizes the sliding-window rings
(engine/cache/pools.py), which that kernel writes before it reads.
"""

from __future__ import annotations

DECODE_ATTENTION_TOKENS = 8
FUSED_NORM_MAX_DIM = 8192  # a norm row is held by one program
FUSED_ROUTER_MAX_EXPERTS = 4096  # a router row is held by one program


def fused_router_serves(experts: int, top_k: int) -> bool:
    """Whether `fused_ops.route_topk` takes these sizes (top_k a power of two: the kernel's
    selected-entry vector)."""
    return experts <= FUSED_ROUTER_MAX_EXPERTS and 0 < top_k <= experts and not top_k & (top_k - 1)
