"""Model configuration: one frozen dataclass read from a Hugging Face `config.json`.

Contract: `ModelConfig.from_dict(raw)` accepts the text-only config of each supported family and
the vision-language wrapper (`text_config`), and returns a complete, validated description of the
decoder: per-layer mixer kind (full attention, sliding-window attention or Gated DeltaNet), per-layer
MLP kind (routed MoE or dense), and every size the engine needs. Unknown families or missing fields raise `ConfigError`
naming the field. Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.config_fields import FULL_ATTENTION as FULL_ATTENTION
from engine.config_fields import LINEAR_ATTENTION as LINEAR_ATTENTION
from engine.config_fields import ROPE_TYPES as ROPE_TYPES
from engine.config_fields import SLIDING_ATTENTION as SLIDING_ATTENTION
from engine.config_fields import RopeScaling as RopeScaling
from engine.config_fields import field_of as _get
from engine.config_fields import rope_fields as _rope
from engine.errors import ConfigError
from engine.families import family_fields

# model_type -> family. The wrapper types carry a nested text_config.
_FAMILIES = {
    "qwen3_moe": "qwen3_moe",
    "qwen3_5_moe": "qwen3_5_moe",
    "qwen3_5_moe_text": "qwen3_5_moe",
    "qwen3_next": "qwen3_next",
    "deepseek_v3": "deepseek_v3",
    "kimi_k2": "deepseek_v3",
    "glm4_moe_lite": "glm4_moe_lite",
    "glm4_moe": "glm4_moe",
    "gpt_oss": "gpt_oss",
}
# Families whose config map lives in engine/families.py (MLA and the sigmoid-routed GLM / DeepSeek).
_MAPPED_FAMILIES = ("deepseek_v3", "glm4_moe_lite", "glm4_moe")
ATTENTION_KINDS = ("gqa", "mla")
SUPPORTED_MODEL_TYPES = tuple(sorted(_FAMILIES))

# How a MoE layer picks its experts (engine/model/router.py holds one function per kind):
# softmax_topk: softmax over the router logits, top-k, optional renormalisation (Qwen3 MoE).
# sigmoid_grouped: sigmoid scores, plus a correction bias for the choice only, top-2 sum per group,
#   the best `topk_group` groups, top-k inside them, optional renormalisation, times
#   `routed_scaling_factor` (DeepSeek-V3, GLM-4.5+).
# topk_softmax: top-k of the router logits (router bias added), softmax over the k chosen (gpt-oss).
ROUTER_KINDS = ("softmax_topk", "sigmoid_grouped", "topk_softmax")
# The gated activation of the experts: silu(gate) * up, or gpt-oss's clamped form
# (gate clamped above at `swiglu_limit`, up to +-limit, gate * sigmoid(alpha * gate) * (up + 1)).
EXPERT_ACTIVATIONS = ("silu", "swiglu_clamped")



@dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rotary_dim: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    # Per layer: "full_attention", "sliding_attention" (window `sliding_window`) or "linear_attention".
    layer_types: tuple[str, ...]
    # Per layer: True where the MLP is a routed MoE block.
    moe_layers: tuple[bool, ...]
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    dense_intermediate_size: int
    shared_expert_intermediate_size: int
    # Family traits, so the decoder needs no family branches.
    attn_output_gate: bool
    norm_zero_centered: bool
    sliding_window: int | None
    # Gated DeltaNet sizes (zero when the family has none).
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    # Router (ROUTER_KINDS); the grouped fields matter to "sigmoid_grouped" only.
    router_kind: str = "softmax_topk"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    # Shared experts: a sigmoid gate on their output (Qwen) or none (DeepSeek, GLM).
    shared_expert_gated: bool = True
    # Full-attention layers: "gqa" (q/k/v heads, engine/model/attention.py) or "mla" (latent KV,
    # engine/model/mla.py). qk_norm: per-head RMSNorm of q and k (GQA).
    attention_kind: str = "gqa"
    qk_norm: bool = True
    # MLA sizes (zero when the family has none); q_lora_rank 0: q straight from the hidden state.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # The rotary dims are stored as interleaved pairs (DeepSeek's layout), not as two halves.
    rope_interleave: bool = False
    # Attention traits: a learned sink logit per head (gpt-oss).
    attention_sinks: bool = False
    # Expert traits: biases on the expert projections, the gated activation (EXPERT_ACTIVATIONS),
    # and the checkpoint layout of the expert tensors ("auto": engine/weights/loader.py tells the
    # Qwen forms apart; "gpt_oss": fused gate_up [E, H, 2I] with gate/up interleaved by column,
    # down [E, I, H], biases, bf16 or MXFP4 `_blocks`/`_scales`).
    expert_bias: bool = False
    expert_activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    expert_layout: str = "auto"
    # RMSNorm weights kept in float32 whatever the model dtype (gpt-oss: scale in float32, round once).
    norm_float32: bool = False
    # Checkpoint prefix of the text decoder ("model." or "model.language_model.").
    weight_prefix: str = "model."
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    # ------------------------------------------------------------------ derived
    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        """Layer indices that hold routed experts, in order; the bank's layer axis."""
        return tuple(i for i, m in enumerate(self.moe_layers) if m)

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layers)

    @property
    def full_attention_layer_ids(self) -> tuple[int, ...]:
        """The layers whose KV cache holds every token (the KV pool's layer axis)."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION)

    @property
    def sliding_attention_layer_ids(self) -> tuple[int, ...]:
        """The sliding-window layers: each sequence keeps only a ring of its last keys and values
        (engine/cache/pools.py), part of its state."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == SLIDING_ATTENTION)

    def window_of(self, layer: int) -> int | None:
        """The attention window of `layer` (None: it attends every earlier key)."""
        return self.sliding_window if self.layer_types[layer] == SLIDING_ATTENTION else None

    @property
    def linear_attention_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION)

    @property
    def is_hybrid(self) -> bool:
        """True when some layers carry per-sequence state (recurrent layers, sliding-window rings),
        so prefix reuse needs a state snapshot."""
        return bool(self.linear_attention_layer_ids or self.sliding_attention_layer_ids)

    @property
    def kv_slot_shapes(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """Per full-attention layer and KV slot, the (heads, dim) of the key and the value entry.
        MLA keeps one latent row (the normed c_kv, then the rotated rope key) and no values."""
        if self.attention_kind == "mla":
            return (1, self.kv_lora_rank + self.qk_rope_head_dim), (1, 0)
        return (self.num_kv_heads, self.head_dim), (self.num_kv_heads, self.head_dim)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        return 2 * self.linear_key_dim + self.linear_value_dim

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_file(cls, path: Path) -> ModelConfig:
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: config.json not found") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
        cfg = cls.from_dict(raw, source=str(path))
        gen_path = path.parent / "generation_config.json"
        if gen_path.exists():
            try:
                extra = _eos(json.loads(gen_path.read_text()))
            except (json.JSONDecodeError, TypeError, ValueError):
                raise ConfigError(f"{gen_path}: not valid JSON") from None
            merged = tuple(dict.fromkeys(cfg.eos_token_ids + extra))
            if merged != cfg.eos_token_ids:
                cfg = dataclasses.replace(cfg, eos_token_ids=merged)
        return cfg

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type not in _FAMILIES:
            raise ConfigError(
                f"{source}: unknown model_type {model_type!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        family = _FAMILIES[model_type]
        prefix = "model."
        text = raw
        if "text_config" in raw and isinstance(raw["text_config"], dict):
            text = {**raw["text_config"]}
            prefix = "model.language_model."
            text.setdefault("tie_word_embeddings", raw.get("tie_word_embeddings", False))
            if "eos_token_id" not in text and "eos_token_id" in raw:
                text["eos_token_id"] = raw["eos_token_id"]
        return _parse(family, text, raw, prefix, source)



def _eos(d: dict[str, Any]) -> tuple[int, ...]:
    eos = d.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def _layer_types(d: dict[str, Any], source: str, n_layers: int, other: str, interval: int) -> tuple[str, ...]:
    """The config's `layer_types` (full attention or `other`, one per layer), else every
    `interval`-th layer full attention and the rest `other`."""
    layer_types = d.get("layer_types") or [other if (i + 1) % interval else FULL_ATTENTION for i in range(n_layers)]
    if len(layer_types) != n_layers:
        raise ConfigError(f"{source}: layer_types has {len(layer_types)} entries for {n_layers} layers")
    for t in layer_types:
        if t not in (FULL_ATTENTION, other):
            raise ConfigError(f"{source}: unknown layer type {t!r} in layer_types")
    return tuple(layer_types)


def _parse(family: str, d: dict[str, Any], outer: dict[str, Any], prefix: str, source: str) -> ModelConfig:
    g = lambda k, default=...: _get(d, k, source, default)  # noqa: E731
    hidden = int(g("hidden_size"))
    n_layers = int(g("num_hidden_layers"))
    n_heads = int(g("num_attention_heads"))
    n_kv = int(g("num_key_value_heads", n_heads))
    head_dim = int(g("head_dim", hidden // n_heads))
    if n_heads % n_kv:
        raise ConfigError(f"{source}: num_attention_heads {n_heads} is not a multiple of num_key_value_heads {n_kv}")
    # transformers 5 saves qwen3_moe's expert count as num_local_experts; releases say num_experts;
    # DeepSeek and GLM say n_routed_experts.
    experts_key = next((k for k in ("num_experts", "n_routed_experts", "num_local_experts") if d.get(k) is not None),
                       "num_experts")
    num_experts = int(g(experts_key))
    common: dict[str, Any] = dict(
        vocab_size=int(g("vocab_size")),
        hidden_size=hidden,
        num_layers=n_layers,
        num_heads=n_heads,
        num_kv_heads=n_kv,
        head_dim=head_dim,
        rms_norm_eps=float(g("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(g("max_position_embeddings", 32768)),
        tie_word_embeddings=bool(g("tie_word_embeddings", False)),
        attention_bias=bool(g("attention_bias", family == "gpt_oss")),
        num_experts=num_experts,
        top_k=int(g("num_experts_per_tok")),
        # gpt-oss names its expert size intermediate_size (it has no dense MLP)
        moe_intermediate_size=int(g("intermediate_size" if family == "gpt_oss" else "moe_intermediate_size")),
        eos_token_ids=_eos(d) or _eos(outer),
        torch_dtype=str(d.get("dtype") or d.get("torch_dtype") or outer.get("dtype") or "float32"),
        weight_prefix=prefix,
        raw=outer,
    )
    if family == "qwen3_moe":
        theta, partial, scaling = _rope(d, source, 1.0)
        step = int(g("decoder_sparse_step", 1))
        mlp_only = set(g("mlp_only_layers", []) or [])
        moe = tuple(
            (i not in mlp_only) and num_experts > 0 and (i + 1) % step == 0 for i in range(n_layers)
        )
        window = int(g("sliding_window")) if g("use_sliding_window", False) else None
        cfg = ModelConfig(
            family=family,
            rope_theta=theta,
            rope_scaling=scaling,
            rotary_dim=int(head_dim * partial),
            layer_types=(FULL_ATTENTION if window is None else SLIDING_ATTENTION,) * n_layers,
            moe_layers=moe,
            norm_topk_prob=bool(g("norm_topk_prob", False)),
            dense_intermediate_size=int(g("intermediate_size", 0)) if not all(moe) else 0,
            shared_expert_intermediate_size=0,
            attn_output_gate=False,
            norm_zero_centered=False,
            sliding_window=window,
            **common,
        )
    elif family in _MAPPED_FAMILIES:
        cfg = ModelConfig(family=family, **{**common, **family_fields(family, d, common, source)})
    elif family == "gpt_oss":
        theta, partial, scaling = _rope(d, source, 1.0)
        window = int(g("sliding_window", 128))
        layer_types = _layer_types(d, source, n_layers, SLIDING_ATTENTION, 2)
        cfg = ModelConfig(
            family=family,
            rope_theta=theta,
            rope_scaling=scaling,
            rotary_dim=int(head_dim * partial),
            layer_types=layer_types,
            moe_layers=(True,) * n_layers,
            norm_topk_prob=False,
            dense_intermediate_size=0,
            shared_expert_intermediate_size=0,
            attn_output_gate=False,
            norm_zero_centered=False,
            sliding_window=window,
            router_kind="topk_softmax",
            qk_norm=False,
            attention_sinks=True,
            expert_bias=True,
            expert_activation="swiglu_clamped",
            swiglu_alpha=float(g("swiglu_alpha", 1.702)),
            swiglu_limit=float(g("swiglu_limit", 7.0)),
            expert_layout="gpt_oss",
            norm_float32=True,
            **common,
        )
    else:  # the Gated DeltaNet hybrids: qwen3_5_moe, qwen3_next
        theta, partial, scaling = _rope(d, source, 0.25)
        interval = int(d.get("full_attention_interval", 4))
        layer_types = _layer_types(d, source, n_layers, LINEAR_ATTENTION, interval)
        step = int(g("decoder_sparse_step", 1))
        mlp_only = set(g("mlp_only_layers", []) or [])
        moe = tuple((i not in mlp_only) and (i + 1) % step == 0 for i in range(n_layers))
        cfg = ModelConfig(
            family=family,
            rope_theta=theta,
            rope_scaling=scaling,
            rotary_dim=int(head_dim * partial),
            layer_types=layer_types,
            moe_layers=moe,
            # Qwen3.5 always renormalises; Qwen3-Next reads norm_topk_prob
            norm_topk_prob=family == "qwen3_5_moe" or bool(g("norm_topk_prob", True)),
            dense_intermediate_size=int(g("intermediate_size", 0)) if not all(moe) else 0,
            shared_expert_intermediate_size=int(g("shared_expert_intermediate_size", 0)),
            attn_output_gate=True,
            norm_zero_centered=True,
            sliding_window=None,
            linear_num_key_heads=int(g("linear_num_key_heads")),
            linear_num_value_heads=int(g("linear_num_value_heads")),
            linear_key_head_dim=int(g("linear_key_head_dim")),
            linear_value_head_dim=int(g("linear_value_head_dim")),
            linear_conv_kernel_dim=int(g("linear_conv_kernel_dim", 4)),
            **common,
        )
        if cfg.linear_num_value_heads % cfg.linear_num_key_heads:
            raise ConfigError(f"{source}: linear_num_value_heads must be a multiple of linear_num_key_heads")
    if cfg.top_k > cfg.num_experts:
        raise ConfigError(f"{source}: num_experts_per_tok {cfg.top_k} > num_experts {cfg.num_experts}")
    if cfg.attention_kind not in ATTENTION_KINDS:
        raise ConfigError(f"{source}: attention kind {cfg.attention_kind!r} unknown")
    if cfg.router_kind not in ROUTER_KINDS:
        raise ConfigError(f"{source}: router kind {cfg.router_kind!r} unknown (known: {', '.join(ROUTER_KINDS)})")
    if cfg.router_kind == "sigmoid_grouped":
        if cfg.n_group < 1 or cfg.num_experts % cfg.n_group:
            raise ConfigError(f"{source}: n_routed_experts {cfg.num_experts} is not a multiple of n_group {cfg.n_group}")
        if not 1 <= cfg.topk_group <= cfg.n_group:
            raise ConfigError(f"{source}: topk_group {cfg.topk_group} must be within 1..n_group {cfg.n_group}")
        if cfg.topk_group < cfg.n_group and cfg.num_experts // cfg.n_group < 2:
            raise ConfigError(f"{source}: groups are scored by their two best experts: n_group {cfg.n_group} leaves "
                              f"fewer than two of {cfg.num_experts} experts per group")
        if cfg.top_k > cfg.topk_group * (cfg.num_experts // cfg.n_group):
            raise ConfigError(f"{source}: num_experts_per_tok {cfg.top_k} exceeds the experts of topk_group groups")
    if cfg.rotary_dim % 2:
        raise ConfigError(f"{source}: rotary dimension {cfg.rotary_dim} must be even")
    return cfg
