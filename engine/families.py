"""Config maps of the DeepSeek-V3 / GLM families: a Hugging Face config dict -> ModelConfig fields.

Contract: `family_fields(family, d, common, source)` returns the family-specific keyword arguments
of `ModelConfig` (everything `engine/config.py` `_parse` does not already put in `common`) for
- deepseek_v3 (also Kimi-K2's `kimi_k2`) and glm4_moe_lite (GLM-4.7-Flash): MLA attention, sigmoid
  grouped router with correction bias, ungated shared experts, the first layers dense
  (`first_k_dense_replace`, or GLM-Lite's `mlp_layer_types`);
- glm4_moe (GLM-4.5 / 4.6 / 4.7): GQA with partial rotary (default 0.5), q/k/v biases, optional
  q/k norm (`use_qk_norm`), the same router, shared experts and dense first layers.
Defaults for absent keys are transformers' for the family. Inconsistent sizes raise `ConfigError`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine.config_fields import FULL_ATTENTION
from engine.config_fields import field_of as _get
from engine.config_fields import rope_fields as _rope
from engine.errors import ConfigError

# transformers' defaults where a config leaves a key out
_DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v3": {"first_k_dense_replace": 3, "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4,
                    "rope_interleave": True},
    "glm4_moe_lite": {"first_k_dense_replace": 1, "routed_scaling_factor": 1.8, "n_group": 1, "topk_group": 1,
                      "rope_interleave": True},
    "glm4_moe": {"first_k_dense_replace": 1, "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1},
}


def _moe_layers(d: dict[str, Any], n_layers: int, first_dense: int, source: str) -> tuple[bool, ...]:
    types = d.get("mlp_layer_types")
    if types:
        if len(types) != n_layers or any(t not in ("dense", "sparse") for t in types):
            raise ConfigError(f"{source}: mlp_layer_types must list 'dense' / 'sparse' for each of {n_layers} layers")
        return tuple(t == "sparse" for t in types)
    return tuple(i >= first_dense for i in range(n_layers))


def _router_fields(family: str, g: Callable[..., Any], common: dict[str, Any]) -> dict[str, Any]:
    dflt = _DEFAULTS[family]
    return dict(
        router_kind="sigmoid_grouped",
        n_group=int(g("n_group", dflt["n_group"])),
        topk_group=int(g("topk_group", dflt["topk_group"])),
        routed_scaling_factor=float(g("routed_scaling_factor", dflt["routed_scaling_factor"])),
        norm_topk_prob=bool(g("norm_topk_prob", True)),
        shared_expert_intermediate_size=common["moe_intermediate_size"] * int(g("n_shared_experts", 1) or 0),
        shared_expert_gated=False,
        attn_output_gate=False,
        norm_zero_centered=False,
        sliding_window=None,
    )


def family_fields(family: str, d: dict[str, Any], common: dict[str, Any], source: str) -> dict[str, Any]:
    g = lambda k, default=...: _get(d, k, source, default)  # noqa: E731
    scoring = g("scoring_func", "sigmoid")
    if scoring != "sigmoid":  # DeepSeek-V2's softmax routing shares these keys
        raise ConfigError(f"{source}: scoring_func {scoring!r} is not supported for {family} (only 'sigmoid')")
    n_layers = common["num_layers"]
    dflt = _DEFAULTS[family]
    moe = _moe_layers(d, n_layers, int(g("first_k_dense_replace", dflt["first_k_dense_replace"])), source)
    fields = dict(
        layer_types=(FULL_ATTENTION,) * n_layers,
        moe_layers=moe,
        dense_intermediate_size=int(g("intermediate_size")) if not all(moe) else 0,
        **_router_fields(family, g, common),
    )
    if family == "glm4_moe":
        theta, partial, scaling = _rope(d, source, 0.5)
        return dict(fields, rope_theta=theta, rope_scaling=scaling, rotary_dim=int(common["head_dim"] * partial),
                    qk_norm=bool(g("use_qk_norm", False)))
    # MLA: the rotary covers the rope part of each head; no partial factor
    nope, rope, v = int(g("qk_nope_head_dim")), int(g("qk_rope_head_dim")), int(g("v_head_dim"))
    kv_lora = int(g("kv_lora_rank"))
    q_lora = int(g("q_lora_rank", 0) or 0)
    if min(nope, rope, v, kv_lora) <= 0 or q_lora < 0:
        raise ConfigError(f"{source}: MLA sizes must be positive (qk_nope_head_dim {nope}, qk_rope_head_dim {rope}, "
                          f"v_head_dim {v}, kv_lora_rank {kv_lora})")
    theta, _, scaling = _rope(d, source, 1.0)
    return dict(
        fields,
        rope_theta=theta,
        rope_scaling=scaling,
        rotary_dim=rope,
        attention_kind="mla",
        qk_norm=False,
        head_dim=nope + rope,  # the query / key head size (what budgets count)
        num_kv_heads=common["num_heads"],
        q_lora_rank=q_lora,
        kv_lora_rank=kv_lora,
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=v,
        rope_interleave=bool(g("rope_interleave", dflt["rope_interleave"])),
    )
