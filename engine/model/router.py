"""MoE routers: which experts each token goes to, and with what weight.

Contract: `route(x, w, cfg)` -> (ids [N, top_k] int64, weights [N, top_k] in x's dtype), by
`cfg.router_kind` through `ROUTERS`, a table of one function per kind (the kinds are listed, with
what they compute, in engine/config.py `ROUTER_KINDS`). Each kind reads the router tensors it needs
from `MoeWeights`. Numerics follow the reference: scores in float32, weights cast back to x's dtype.
- softmax_topk: `softmax_topk(x, router, top_k, renormalize)`; on CUDA all but the router matmul
  in one Triton kernel (engine/model/fused_ops.py `route_topk`; kernels.fused_router off keeps
  the torch ops).
- sigmoid_grouped: float32 logits, sigmoid scores; the choice adds `e_score_correction_bias`, keeps
  the `topk_group` groups whose two best biased scores sum highest, and takes the top-k biased
  scores inside them; the weights are the unbiased scores of the chosen experts, renormalised
  (sum + 1e-20) when `norm_topk_prob`, times `routed_scaling_factor`.
- topk_softmax: logits x @ router^T + `router_bias` in x's dtype, the top-k logits, softmax over
  those k (in the logits' dtype, as the reference).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.config import ModelConfig
from engine.model.kernel_limits import fused_router_serves
from engine.model.ops import fused_router_enabled
from engine.weights.layout import MoeWeights

Router = Callable[[torch.Tensor, MoeWeights, ModelConfig], tuple[torch.Tensor, torch.Tensor]]


def softmax_topk(x: torch.Tensor, router: torch.Tensor, top_k: int,
                 renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    logits = F.linear(x, router)
    if logits.is_cuda and fused_router_enabled() and fused_router_serves(logits.shape[-1], top_k):
        from engine.model import fused_ops  # triton: imported where CUDA runs

        return fused_ops.route_topk(logits, top_k, renormalize)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    top_w, top_i = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    return top_i, top_w.to(logits.dtype)


def sigmoid_grouped(x: torch.Tensor, w: MoeWeights, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    scores = F.linear(x.float(), w.router.float()).sigmoid()  # [N, E]
    biased = scores if w.score_bias is None else scores + w.score_bias.float()
    n, experts = scores.shape
    if cfg.topk_group < cfg.n_group:
        grouped = biased.view(n, cfg.n_group, experts // cfg.n_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [N, groups]
        keep_groups = group_scores.topk(cfg.topk_group, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep_groups, True)
        keep = keep[:, :, None].expand_as(grouped).reshape(n, experts)
        biased = biased.masked_fill(~keep, float("-inf"))
    ids = biased.topk(cfg.top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, (weights * cfg.routed_scaling_factor).to(x.dtype)


def topk_softmax(x: torch.Tensor, w: MoeWeights, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    logits = F.linear(x, w.router, w.router_bias)
    top, ids = torch.topk(logits, cfg.top_k, dim=-1)
    return ids, torch.softmax(top, dim=-1).to(x.dtype)


def _softmax_topk(x: torch.Tensor, w: MoeWeights, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    return softmax_topk(x, w.router, cfg.top_k, cfg.norm_topk_prob)


ROUTERS: dict[str, Router] = {
    "softmax_topk": _softmax_topk,
    "sigmoid_grouped": sigmoid_grouped,
    "topk_softmax": topk_softmax,
}


def route(x: torch.Tensor, w: MoeWeights, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    return ROUTERS[cfg.router_kind](x, w, cfg)
