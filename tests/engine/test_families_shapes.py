"""Bench shapes of GLM-4.7-Flash, DeepSeek-V3 and Qwen3-Next-80B-A3B, and dummy weights of an MLA shape.

Each shape's config dict is what transformers' own config class reads to the same sizes, parses to
the family's ModelConfig, and reports the KV bytes per token its attention kind stores (MLA: the
latent, kv_lora_rank + qk_rope_head_dim per layer). A tiny MLA shape's random decoder runs a
prefill and a decode step with finite logits, and its decode step equals the full pass's row.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from families import Runner

from engine.cache.pools import KVPool
from engine.weights.dummy import dummy_config, dummy_decoder, shape_config_dict
from engine.weights.shapes import MODEL_SHAPES, SHAPES

HF = {"glm4_moe_lite": tf.Glm4MoeLiteConfig, "deepseek_v3": tf.DeepseekV3Config, "qwen3_next": tf.Qwen3NextConfig}


@pytest.mark.parametrize("name, kv_per_token", [
    ("glm-4.7-flash", 47 * (512 + 64) * 2),
    ("deepseek-v3", 61 * (512 + 64) * 2),
    ("qwen3-next-80b-a3b", 12 * 2 * 2 * 256 * 2),  # 12 full-attention layers of 2 KV heads x 256
])
def test_real_shapes(name: str, kv_per_token: int) -> None:
    shape = SHAPES[name]
    assert name in MODEL_SHAPES
    raw = shape_config_dict(shape)
    cfg = dummy_config(shape)
    ref = HF[shape.family](**{k: v for k, v in raw.items() if k not in ("model_type", "architectures")})
    assert cfg.family == shape.family and cfg.num_layers == ref.num_hidden_layers == shape.layers
    assert cfg.num_experts == shape.experts and cfg.top_k == ref.num_experts_per_tok
    assert KVPool.bytes_per_slot(cfg, torch.bfloat16) == kv_per_token
    if shape.kv_lora:
        assert (cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.v_head_dim) == (ref.kv_lora_rank, ref.qk_rope_head_dim,
                                                                             ref.v_head_dim)
        assert cfg.moe_layers.index(True) == shape.first_dense
        assert cfg.shared_expert_intermediate_size == ref.moe_intermediate_size * ref.n_shared_experts
        assert (cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor) == (ref.n_group, ref.topk_group,
                                                                          ref.routed_scaling_factor)
    if name == "deepseek-v3":
        assert cfg.rope_scaling.rope_type == "yarn" and cfg.rope_scaling.factor == 40.0
    if name == "qwen3-next-80b-a3b":
        assert cfg.is_hybrid and len(cfg.full_attention_layer_ids) == 12 and cfg.top_k == 10


def test_tiny_mla_dummy_decoder_runs() -> None:
    cfg = dummy_config("tiny-mla")
    assert cfg.attention_kind == "mla" and cfg.router_kind == "sigmoid_grouped" and cfg.q_lora_rank == 32
    dec = dummy_decoder(cfg, "cpu", torch.float32, seed=3, executor="torch", threads=1)
    ids = [5, 9, 2, 77, 3, 1]
    full = Runner(dec).step([(ids, 0, torch.arange(6), 0)])
    run = Runner(dec)
    run.step([(ids[:5], 0, torch.arange(5), 0)])
    last = run.step([(ids[5:], 5, torch.arange(6), 0)])
    assert torch.isfinite(full).all() and full.std() > 0
    torch.testing.assert_close(last, full[5:], rtol=1e-4, atol=1e-4 * float(full.abs().max()))
