"""Router kinds (engine/model/router.py) against transformers' routers on random scores.

sigmoid_grouped against DeepSeek-V3's `DeepseekV3TopkRouter` (GLM-4.5's is the same function): the
same experts per token (as sets: both take top-k unsorted) and the same weights per expert, over
uneven group counts, a non-zero correction bias that changes the choice, renormalised or not.
softmax_topk against Qwen3-MoE's router. The table dispatch is keyed by `cfg.router_kind`.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from engine.config import ModelConfig
from engine.model.router import ROUTERS, route
from engine.weights.layout import MoeWeights

HIDDEN = 32


def _base(experts: int, top_k: int) -> ModelConfig:
    return ModelConfig.from_dict({
        "model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": HIDDEN, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "num_experts": experts,
        "num_experts_per_tok": top_k, "moe_intermediate_size": 8})


def _by_expert(ids: torch.Tensor, w: torch.Tensor, experts: int) -> torch.Tensor:
    dense = torch.zeros(ids.shape[0], experts, dtype=torch.float64)
    return dense.scatter_(1, ids.long(), w.double())


@pytest.mark.parametrize("experts, groups, topk_group, top_k, renorm, scale", [
    (16, 4, 2, 4, True, 2.5),
    (12, 3, 1, 3, False, 1.0),  # uneven: three groups of four, one kept
    (8, 1, 1, 2, True, 1.8),  # one group: plain top-k over biased scores
    (24, 8, 3, 6, True, 16.0),
])
def test_sigmoid_grouped_matches_deepseek(experts: int, groups: int, topk_group: int, top_k: int, renorm: bool,
                                          scale: float) -> None:
    g = torch.Generator().manual_seed(experts * 7 + groups)
    hf_cfg = transformers.DeepseekV3Config(hidden_size=HIDDEN, n_routed_experts=experts, num_experts_per_tok=top_k,
                                           n_group=groups, topk_group=topk_group, norm_topk_prob=renorm,
                                           routed_scaling_factor=scale)
    ref = DeepseekV3TopkRouter(hf_cfg)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(experts, HIDDEN, generator=g) * 0.3)
        ref.e_score_correction_bias.copy_(torch.randn(experts, generator=g) * 0.5)
    cfg = dataclasses.replace(_base(experts, top_k), router_kind="sigmoid_grouped", n_group=groups,
                              topk_group=topk_group, norm_topk_prob=renorm, routed_scaling_factor=scale)
    w = MoeWeights(router=ref.weight.detach().clone(), score_bias=ref.e_score_correction_bias.clone())
    x = torch.randn(40, HIDDEN, generator=g)
    ids, weights = route(x, w, cfg)
    _, ref_w, ref_ids = ref(x)
    assert ids.shape == (40, top_k) and weights.dtype == x.dtype
    torch.testing.assert_close(_by_expert(ids, weights, experts), _by_expert(ref_ids, ref_w, experts),
                               rtol=1e-6, atol=1e-7)
    # the bias changes the choice: without it some token picks other experts (so the check can fail)
    ids_nobias, _ = route(x, dataclasses.replace(w, score_bias=None), cfg)
    assert not torch.equal(ids_nobias.sort(-1).values, ids.sort(-1).values)


def test_softmax_topk_matches_qwen3() -> None:
    g = torch.Generator().manual_seed(3)
    ref = Qwen3MoeTopKRouter(transformers.Qwen3MoeConfig(hidden_size=HIDDEN, num_experts=8, num_experts_per_tok=2,
                                                         norm_topk_prob=True))
    with torch.no_grad():
        ref.weight.copy_(torch.randn(8, HIDDEN, generator=g))
    cfg = dataclasses.replace(_base(8, 2), norm_topk_prob=True)
    x = torch.randn(10, HIDDEN, generator=g)
    ids, weights = route(x, MoeWeights(router=ref.weight.detach().clone()), cfg)
    _, ref_w, ref_ids = ref(x)
    torch.testing.assert_close(_by_expert(ids, weights, 8), _by_expert(ref_ids, ref_w, 8), rtol=1e-6, atol=1e-7)


def test_dispatch_is_a_table_of_the_config_kinds() -> None:
    from engine.config import ROUTER_KINDS

    assert set(ROUTERS) == set(ROUTER_KINDS)
