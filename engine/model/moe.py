"""Sparse MoE block: softmax top-k router, routed experts through an executor, optional shared expert.

Contract: `moe_block(x, w, cfg, executor, moe_index)` -> [N, H], numerically the reference's
(router softmax in float32, top-k, optional renormalisation, weights cast back to x's dtype).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.config import ModelConfig
from engine.model.ops import swiglu_mlp
from engine.moe.executor import ExpertExecutor
from engine.weights.layout import MoeWeights


def route(x: torch.Tensor, router: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    logits = F.linear(x, router)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    top_w, top_i = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    return top_i, top_w.to(logits.dtype)


def moe_block(x: torch.Tensor, w: MoeWeights, cfg: ModelConfig, executor: ExpertExecutor, moe_index: int) -> torch.Tensor:
    ids, weights = route(x, w.router, cfg.top_k, cfg.norm_topk_prob)
    out = executor(x, ids, weights, moe_index)
    if w.shared is not None:
        shared = swiglu_mlp(x, w.shared.gate_proj, w.shared.up_proj, w.shared.down_proj)
        assert w.shared_gate is not None
        out = out + torch.sigmoid(F.linear(x, w.shared_gate)) * shared
    return out
