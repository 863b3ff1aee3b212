"""MLA's two forms and the family config maps' refusals.

The absorbed form (W_UK folded into the query, W_UV after the mix, attention over the latent rows)
and the expanded form (per-head keys and values from kv_b_proj) compute the same attention on
random inputs, under a causal mask with a cached prefix, in float64 to 1e-10; a wrong fold (W_UK
and W_UV exchanged) does not. Bad MLA / router sizes in a config raise ConfigError naming them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from engine.config import ModelConfig
from engine.errors import ConfigError
from engine.model.mla import absorbs, mla_core

RAW: dict[str, Any] = {
    "model_type": "deepseek_v3", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2,
    "num_attention_heads": 3, "n_routed_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
    "intermediate_size": 16, "kv_lora_rank": 12, "q_lora_rank": None, "qk_nope_head_dim": 6, "qk_rope_head_dim": 4,
    "v_head_dim": 10, "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1,
}


def test_absorbed_equals_expanded() -> None:
    cfg = ModelConfig.from_dict(RAW)
    g = torch.Generator().manual_seed(0)
    heads, nope, rope, v, c = 3, 6, 4, 10, 12
    kv_b = torch.randn(heads * (nope + v), c, generator=g, dtype=torch.float64)
    cached, new = 7, 4
    rows = torch.randn(cached + new, c + rope, generator=g, dtype=torch.float64)
    q_nope = torch.randn(new, heads, nope, generator=g, dtype=torch.float64)
    q_pe = torch.randn(new, heads, rope, generator=g, dtype=torch.float64)
    expanded = mla_core(q_nope, q_pe, rows, kv_b, cfg, absorbed=False)
    absorbed = mla_core(q_nope, q_pe, rows, kv_b, cfg, absorbed=True)
    assert expanded.shape == (new, heads * v)
    torch.testing.assert_close(absorbed, expanded, rtol=1e-10, atol=1e-10)
    # the check can fail: the value rows of kv_b_proj read as the key rows give other numbers
    w = kv_b.view(heads, nope + v, c)
    swapped = torch.cat((w[:, v:v + nope], w[:, :v]), dim=1) if v >= nope else w
    assert not torch.allclose(mla_core(q_nope, q_pe, rows, swapped.reshape(-1, c), cfg, absorbed=True),
                              expanded)


def test_form_choice_by_work() -> None:
    cfg = ModelConfig.from_dict(RAW)  # 2c - nope - v = 8, c (nope + v) = 192: absorbed below 24 tokens
    assert absorbs(cfg, 23) and not absorbs(cfg, 24)
    big = dataclasses.replace(cfg, kv_lora_rank=512, qk_nope_head_dim=128, v_head_dim=128)
    assert absorbs(big, 170) and not absorbs(big, 171)  # DeepSeek-V3


@pytest.mark.parametrize("change, message", [
    ({"kv_lora_rank": 0}, "MLA sizes must be positive"),
    ({"qk_rope_head_dim": None}, "missing field 'qk_rope_head_dim'"),
    ({"n_group": 4}, "not a multiple of n_group"),
    ({"topk_group": 3}, "topk_group 3 must be within"),
    ({"n_group": 6, "topk_group": 2}, "fewer than two of 6 experts per group"),
    ({"mlp_layer_types": ["dense"]}, "mlp_layer_types must list"),
    ({"scoring_func": "softmax"}, "scoring_func 'softmax' is not supported"),
    ({"model_type": "glm4_moe", "rope_parameters": {"rope_type": "longrope", "factor": 2.0}}, "not supported"),
])
def test_bad_family_configs(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict({**RAW, **change})


def test_family_maps() -> None:
    cfg = ModelConfig.from_dict({**RAW, "model_type": "kimi_k2"})
    assert cfg.family == "deepseek_v3" and cfg.moe_layers == (False, True) and cfg.shared_expert_intermediate_size == 8
    assert cfg.routed_scaling_factor == 2.5 and cfg.rope_interleave and cfg.kv_slot_shapes == ((1, 16), (1, 0))
    lite = ModelConfig.from_dict({**RAW, "model_type": "glm4_moe_lite", "n_group": 1, "topk_group": 1})
    assert lite.moe_layers == (False, True) and lite.routed_scaling_factor == 1.8
    glm = ModelConfig.from_dict({**RAW, "model_type": "glm4_moe", "head_dim": 16, "num_key_value_heads": 1,
                                 "use_qk_norm": True})
    assert glm.attention_kind == "gqa" and glm.rotary_dim == 8 and glm.qk_norm and not glm.shared_expert_gated
