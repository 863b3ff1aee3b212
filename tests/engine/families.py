"""Tiny random checkpoints of the DeepSeek-V3 / GLM / Qwen3-Next families, and the engine's passes on them.

`FAMILY_SPECS` holds odd shapes per family (q_lora_rank set and unset, uneven expert groups, dense
first layers, a non-zero correction bias, YaRN with mscale, interleaved and plain rope layouts).
`build_family(spec, dest)` builds the transformers model from a fixed seed, re-initialises it with a
large spread (`checkpoints.reinit_`), draws the routers' correction biases, and saves it in float32;
`engine_pass` runs one forward pass of the engine's decoder over sequences given as (new tokens,
cached length, KV slots, state slot).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from checkpoints import FULL, LIN, reinit_

from engine.cache.pools import KVPool, StatePool
from engine.model.batch import ForwardBatch, SeqEntry
from engine.model.decoder import Decoder


@dataclass(frozen=True)
class FamilySpec:
    name: str
    cls: str  # transformers config class; the model class swaps Config for ForCausalLM
    kw: dict[str, Any] = field(default_factory=dict)
    seed: int = 0

    def __repr__(self) -> str:
        return self.name


_BASE = dict(vocab_size=96, hidden_size=32, num_attention_heads=4, max_position_embeddings=512,
             eos_token_id=None, pad_token_id=None, bos_token_id=None, tie_word_embeddings=False)
_MLA = dict(_BASE, num_hidden_layers=3, num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=8,
            qk_rope_head_dim=8, v_head_dim=12, intermediate_size=40, moe_intermediate_size=16)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8}

FAMILY_SPECS = [
    FamilySpec("deepseek_v3_qlora_yarn", "DeepseekV3Config", dict(
        _MLA, q_lora_rank=24, n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=3,
        n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        rope_interleave=True, rope_parameters=YARN)),
    FamilySpec("deepseek_v3_plain_q", "DeepseekV3Config", dict(
        _MLA, q_lora_rank=None, n_routed_experts=12, n_group=3, topk_group=1, num_experts_per_tok=2,
        n_shared_experts=2, first_k_dense_replace=2, routed_scaling_factor=1.5, norm_topk_prob=False,
        rope_interleave=False, attention_bias=True, rope_parameters={"rope_type": "default", "rope_theta": 5e4}),
        seed=1),
    FamilySpec("glm4_moe_lite", "Glm4MoeLiteConfig", dict(
        _MLA, q_lora_rank=16, n_routed_experts=8, n_group=1, topk_group=1, num_experts_per_tok=2,
        n_shared_experts=1, routed_scaling_factor=1.8, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
        seed=2),
    FamilySpec("glm4_moe", "Glm4MoeConfig", dict(
        _BASE, num_hidden_layers=3, num_key_value_heads=2, head_dim=16, intermediate_size=40,
        moe_intermediate_size=16, n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.0, use_qk_norm=True,
        attention_bias=True, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                              "partial_rotary_factor": 0.5}), seed=3),
    FamilySpec("qwen3_next", "Qwen3NextConfig", dict(
        _BASE, num_hidden_layers=4, num_key_value_heads=2, head_dim=16, intermediate_size=40,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_conv_kernel_dim=4, moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts=8,
        num_experts_per_tok=2, mlp_only_layers=[2], layer_types=[LIN, FULL, LIN, FULL],
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25}), seed=4),
]


def make_family_model(spec: FamilySpec) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(spec.seed)
    cfg = getattr(tf, spec.cls)(**spec.kw)
    model = getattr(tf, spec.cls.replace("Config", "ForCausalLM"))(cfg).float().eval()
    reinit_(model, spec.seed, 0.3)
    g = torch.Generator().manual_seed(100 + spec.seed)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=g) * 0.3)
    return model


def build_family(spec: FamilySpec, dest: Path) -> tuple[Path, torch.nn.Module]:
    model = make_family_model(spec)
    model.save_pretrained(dest)
    return Path(dest), model


class Runner:
    """The engine's decoder over its own pools: `step(seqs)` runs one pass over sequences given as
    (new token ids, cached length, kv slots of every token so far, state slot) and returns the
    logits of every new token [N, V]."""

    def __init__(self, decoder: Decoder, slots: int = 128, states: int = 4) -> None:
        self.decoder = decoder
        cfg = decoder.cfg
        self.kv = KVPool(cfg, slots, torch.float32, torch.device("cpu"))
        self.states = StatePool(cfg, states, torch.float32, torch.device("cpu"))

    def step(self, seqs: list[tuple[list[int], int, torch.Tensor, int]]) -> torch.Tensor:
        ids: list[int] = []
        pos: list[int] = []
        entries = []
        for new, cached, slots, state in seqs:
            entries.append(SeqEntry(len(ids), len(new), cached, slots, state_slot=state))
            ids += new
            pos += list(range(cached, cached + len(new)))
        batch = ForwardBatch(torch.tensor(ids), torch.tensor(pos), entries)
        return self.decoder.logits(self.decoder.forward(batch, self.kv, self.states))
