"""Rotary scaling: `RopeScaling` parsing and engine/model/rope.py against transformers' initialisers.

Each rope type's (inv_freq, attention_scaling) must equal `ROPE_INIT_FUNCTIONS[type]` (the default
type: the model's own default initialiser) on the same parameters, partial rotary included; the
rotary tables must carry the attention scaling; unsupported types and bad factors are refused.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine.config import ModelConfig, RopeScaling
from engine.errors import ConfigError
from engine.model.ops import Rotary
from engine.model.rope import rope_frequencies, softmax_mscale

HEAD_DIM, MAX_POS = 48, 4096

CASES: list[dict[str, Any]] = [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "dynamic", "factor": 2.5},
    {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 1024},
    {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 16,
     "beta_slow": 2, "mscale": 0.707, "mscale_all_dim": 1.0},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512, "truncate": False},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "attention_factor": 1.3},
    {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 512},  # factor: 4096 / 512
]


def _hf(params: dict[str, Any], partial: float, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    rp = {"rope_theta": 50_000.0, "partial_rotary_factor": partial, **params}
    cfg = transformers.LlamaConfig(hidden_size=96, num_attention_heads=2, head_dim=HEAD_DIM,
                                   max_position_embeddings=MAX_POS, rope_parameters=rp)
    if params["rope_type"] == "default":  # each model's own initialiser; GLM-4.5's takes partial rotary
        from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeRotaryEmbedding

        cfg = transformers.Glm4MoeConfig(hidden_size=96, num_attention_heads=2, head_dim=HEAD_DIM,
                                         max_position_embeddings=MAX_POS, rope_parameters=rp)
        inv, scale = Glm4MoeRotaryEmbedding.compute_default_rope_parameters(cfg)
        return inv, scale
    inv, scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](cfg, "cpu", seq_len=seq_len)
    return inv, float(scale)


def _ours(params: dict[str, Any], partial: float, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    raw = {"rope_parameters": {"rope_theta": 50_000.0, "partial_rotary_factor": partial, **params},
           "max_position_embeddings": MAX_POS}
    from engine.config import _rope

    theta, part, scaling = _rope(raw, "t", 1.0)
    return rope_frequencies(scaling, int(HEAD_DIM * part), theta, MAX_POS, seq_len)


@pytest.mark.parametrize("partial", [1.0, 0.5])
@pytest.mark.parametrize("params", [{"rope_type": "default"}, *CASES], ids=lambda p: str(p)[:60])
def test_frequencies_match_transformers(params: dict[str, Any], partial: float) -> None:
    inv, scale = _ours(params, partial)
    ref_inv, ref_scale = _hf(params, partial)
    assert inv.shape == ref_inv.shape == (int(HEAD_DIM * partial) // 2,)
    torch.testing.assert_close(inv, ref_inv.float(), rtol=1e-6, atol=0)
    assert scale == pytest.approx(ref_scale, rel=1e-12)


def test_dynamic_grows_past_the_context() -> None:
    params = {"rope_type": "dynamic", "factor": 2.0}
    inv, _ = _ours(params, 1.0, seq_len=3 * MAX_POS)
    ref, _ = _hf(params, 1.0, seq_len=3 * MAX_POS)
    torch.testing.assert_close(inv, ref, rtol=1e-6, atol=0)
    default, _ = _ours({"rope_type": "default"}, 1.0)
    assert not torch.allclose(inv, default)  # the check above could tell the two apart
    torch.testing.assert_close(_ours(params, 1.0)[0], default, rtol=1e-6, atol=0)  # within the context: default


def test_yarn_scales_the_tables_and_the_softmax() -> None:
    s = RopeScaling(rope_type="yarn", factor=40.0, original_max_position_embeddings=4096, mscale=1.0,
                    mscale_all_dim=0.707)
    rot = Rotary(16, 10_000.0, s, 163_840)
    assert rot.attention_scaling == pytest.approx((0.1 * math.log(40) + 1) / (0.0707 * math.log(40) + 1))
    rot.prepare(8, torch.device("cpu"), torch.float32)
    assert rot._cos is not None
    # position 0: cos = 1 scaled
    torch.testing.assert_close(rot._cos[0], torch.full((16,), rot.attention_scaling))
    assert softmax_mscale(s) == pytest.approx(0.0707 * math.log(40) + 1)
    assert softmax_mscale(RopeScaling()) == 1.0
    assert softmax_mscale(RopeScaling(rope_type="yarn", factor=4.0)) == 1.0  # no mscale_all_dim


def _qwen(rope: dict[str, Any]) -> dict[str, Any]:
    return {"model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 1,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "num_experts": 4,
            "num_experts_per_tok": 2, "moe_intermediate_size": 8, "max_position_embeddings": 2048,
            "rope_scaling": rope, "rope_theta": 1e6}


def test_config_parses_rope_scaling() -> None:
    cfg = ModelConfig.from_dict(_qwen({"rope_type": "yarn", "factor": 4.0}))
    assert cfg.rope_theta == 1e6
    # original_max_position_embeddings falls back to max_position_embeddings, as transformers does
    assert cfg.rope_scaling == RopeScaling(rope_type="yarn", factor=4.0, original_max_position_embeddings=2048)
    assert ModelConfig.from_dict(_qwen({"type": "linear", "factor": 2})).rope_scaling.rope_type == "linear"
    assert ModelConfig.from_dict(_qwen({})).rope_scaling == RopeScaling()


@pytest.mark.parametrize("rope, message", [
    ({"rope_type": "longrope", "factor": 2.0}, "rope_type 'longrope' is not supported"),
    ({"rope_type": "linear"}, "needs a 'factor'"),
    ({"rope_type": "linear", "factor": -1}, "must be positive"),
    ({"rope_type": "yarn", "factor": "big"}, "must be a number"),
])
def test_config_refuses_bad_rope(rope: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict(_qwen(rope))
