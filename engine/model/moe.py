"""Sparse MoE block: router, routed experts through an executor, optional shared expert.

Contract: `moe_block(x, w, cfg, executor, moe_index, captured)` -> [N, H], numerically the reference's
(the router of `cfg.router_kind`, engine/model/router.py). The shared expert's gate, product and
sum run as one Triton kernel with kernels.fused_shared on (opt-in: no gain measured). In a captured pass (`captured`)
the routed experts run as the executor's graph step, and the shared expert is handed to its
`with_side_work`, which may queue it inside the routed step where the GPU would otherwise wait for
the CPU branch or the fetch: the same kernels on the same inputs, so the same numbers.
`feed_forward(h, mixed, lw, cfg, executor, captured)`: the rest of a decoder layer once its token
mixer gave `mixed`: residual, post-norm, the MoE block (or the dense MLP of a non-MoE layer), residual.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.config import ModelConfig
from engine.model.kernel_limits import FUSED_NORM_MAX_DIM
from engine.model.ops import fused_shared_enabled, rms_norm, swiglu_mlp
from engine.model.router import route
from engine.moe.base import ExpertExecutor
from engine.weights.layout import LayerWeights, MoeWeights


def moe_block(x: torch.Tensor, w: MoeWeights, cfg: ModelConfig, executor: ExpertExecutor, moe_index: int,
              captured: bool = False) -> torch.Tensor:
    ids, weights = route(x, w, cfg)
    if w.shared is None:
        return executor.graph_step(x, ids, weights, moe_index) if captured else executor(x, ids, weights, moe_index)
    sw, gate = w.shared, w.shared_gate
    assert gate is not None
    fused = x.is_cuda and fused_shared_enabled() and x.dim() == 2 and x.shape[-1] <= FUSED_NORM_MAX_DIM

    def shared_expert() -> torch.Tensor:
        shared = swiglu_mlp(x, sw.gate_proj, sw.up_proj, sw.down_proj)
        # unfused, the gated product needs only x as well: the same ops the sum below would run
        return shared if fused else torch.sigmoid(F.linear(x, gate)) * shared

    if captured:
        out, shared = executor.with_side_work(x, ids, weights, moe_index, shared_expert)
    else:
        out = executor(x, ids, weights, moe_index)
        shared = shared_expert()
    if fused:
        from engine.model import fused_ops  # triton: imported where CUDA runs

        return fused_ops.shared_gated_add(out, x, gate, shared)
    return out + shared


def feed_forward(h: torch.Tensor, mixed: torch.Tensor, lw: LayerWeights, cfg: ModelConfig,
                 executor: ExpertExecutor, captured: bool = False) -> torch.Tensor:
    h = h + mixed
    x = rms_norm(h, lw.post_norm, cfg.rms_norm_eps, cfg.norm_zero_centered)
    if lw.moe is not None:
        x = moe_block(x, lw.moe, cfg, executor, lw.moe_index, captured)
    else:
        assert lw.mlp is not None
        x = swiglu_mlp(x, lw.mlp.gate_proj, lw.mlp.up_proj, lw.mlp.down_proj)
    return h + x
