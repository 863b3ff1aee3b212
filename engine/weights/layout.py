"""In-memory weight layout of the generic decoder.

Contract: plain dataclasses of tensors, no behaviour. Dense weights live on the compute device;
routed experts live in `ExpertBanks`, host tensors whose first dimension is the flat expert id
`moe_layer * num_experts + expert` (moe_layer counts only layers that have routed experts, so for
every released Qwen MoE it equals the layer index).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionWeights:
    q_proj: torch.Tensor  # [heads*head_dim*(2 if output gate else 1), hidden]
    k_proj: torch.Tensor
    v_proj: torch.Tensor
    o_proj: torch.Tensor
    q_norm: torch.Tensor | None  # [head_dim]; None without per-head q/k norms (cfg.qk_norm off)
    k_norm: torch.Tensor | None
    sinks: torch.Tensor | None = None  # [heads] float32: a learned logit per head that takes softmax mass
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None


@dataclass
class MlaWeights:
    """Multi-head latent attention: q through a low-rank pair (or straight), the KV latent and the
    shared rope key from one projection, per-head keys / values expanded by kv_b_proj."""

    kv_a_proj: torch.Tensor  # [kv_lora + rope, hidden]
    kv_a_norm: torch.Tensor  # [kv_lora]
    kv_b_proj: torch.Tensor  # [heads * (nope + v), kv_lora]: per head, nope key rows then value rows
    o_proj: torch.Tensor  # [hidden, heads * v]
    q_proj: torch.Tensor | None = None  # [heads * (nope + rope), hidden] when q_lora_rank is 0
    q_a_proj: torch.Tensor | None = None  # [q_lora, hidden]
    q_a_norm: torch.Tensor | None = None  # [q_lora]
    q_b_proj: torch.Tensor | None = None  # [heads * (nope + rope), q_lora]
    q_a_bias: torch.Tensor | None = None
    kv_a_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None


@dataclass
class LinearAttentionWeights:
    in_proj_qkv: torch.Tensor  # [2*key_dim + value_dim, hidden]
    in_proj_z: torch.Tensor  # [value_dim, hidden]
    in_proj_a: torch.Tensor  # [v_heads, hidden]
    in_proj_b: torch.Tensor  # [v_heads, hidden]
    conv: torch.Tensor  # [conv_dim, kernel]
    a_log: torch.Tensor  # [v_heads]
    dt_bias: torch.Tensor  # [v_heads]
    norm: torch.Tensor  # [v_head_dim]
    out_proj: torch.Tensor  # [hidden, value_dim]


@dataclass
class MlpWeights:
    gate_proj: torch.Tensor
    up_proj: torch.Tensor
    down_proj: torch.Tensor


@dataclass
class MoeWeights:
    router: torch.Tensor  # [E, hidden]
    score_bias: torch.Tensor | None = None  # [E] e_score_correction_bias (sigmoid_grouped: the choice only)
    router_bias: torch.Tensor | None = None  # [E] added to the router logits (topk_softmax)
    shared: MlpWeights | None = None
    shared_gate: torch.Tensor | None = None  # [1, hidden]; None: the shared expert is ungated


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    attention: AttentionWeights | None = None
    mla: MlaWeights | None = None
    linear_attention: LinearAttentionWeights | None = None
    moe: MoeWeights | None = None
    mlp: MlpWeights | None = None
    moe_index: int = -1  # ordinal among MoE layers; bank row = moe_index * E + expert


@dataclass
class ExpertBanks:
    w13: torch.Tensor  # [L_moe * E, 2 * I, hidden]: gate rows then up rows
    w2: torch.Tensor  # [L_moe * E, hidden, I]
    num_experts: int
    b13: torch.Tensor | None = None  # [L_moe * E, 2 * I] biases of the gate and up rows (gpt-oss)
    b2: torch.Tensor | None = None  # [L_moe * E, hidden]
    activation: str = "silu"  # engine/config.py EXPERT_ACTIVATIONS
    alpha: float = 1.702  # swiglu_clamped only
    limit: float = 7.0

    def flat_id(self, moe_index: int, expert: int) -> int:
        return moe_index * self.num_experts + expert

    @property
    def rows(self) -> int:
        """Experts of every MoE layer together (bank rows: moe_index * E + expert)."""
        return self.w13.shape[0]

    @property
    def expert_bytes(self) -> int:
        return (self.w13[0].numel() + self.w2[0].numel()) * self.w13.element_size()

    @property
    def total_bytes(self) -> int:
        """Bytes of every expert of every layer in host memory."""
        return self.w13.numel() * self.w13.element_size() + self.w2.numel() * self.w2.element_size()


@dataclass
class PackedExpertBanks(ExpertBanks):
    """Routed experts kept in their stored (quantized) bytes, per MoE layer (QUANT_LAYOUT.md):
    `gate_up[l]` uint8 [E, 2I, row_bytes(fmt_gu[l], H)] (gate rows, then up rows), `down[l]` uint8
    [E, H, row_bytes(fmt_d[l], I)], `gscale[l]` f32 [E, 3] (gate, up, down global scales; 1.0 for a
    format without one). The float banks `w13` / `w2` it inherits are empty (0 rows, uint8): code
    that reads float experts must check `isinstance(banks, PackedExpertBanks)` first. Experts with
    biases (gpt-oss) carry them in the inherited `b13` [L*E, 2I] (gate, then up) and `b2` [L*E, H],
    float32, with the inherited `activation` / `alpha` / `limit`. `file_bytes`: the expert weights'
    bytes in the checkpoint file where the loader counted them (0: not counted)."""

    gate_up: list[torch.Tensor] = field(default_factory=list)
    down: list[torch.Tensor] = field(default_factory=list)
    fmt_gu: list[str] = field(default_factory=list)
    fmt_d: list[str] = field(default_factory=list)
    gscale: list[torch.Tensor] = field(default_factory=list)
    hidden: int = 0
    inter: int = 0
    file_bytes: int = 0

    @classmethod
    def empty(cls, num_experts: int, hidden: int, inter: int) -> PackedExpertBanks:
        return cls(w13=torch.empty(0, 2 * inter, hidden, dtype=torch.uint8),
                   w2=torch.empty(0, hidden, inter, dtype=torch.uint8), num_experts=num_experts, hidden=hidden,
                   inter=inter)

    @property
    def total_bytes(self) -> int:
        return sum(t.numel() for t in (*self.gate_up, *self.down))

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert (the largest over layers: formats may differ from layer to layer)."""
        return max(g[0].numel() + d[0].numel() for g, d in zip(self.gate_up, self.down, strict=True))

    @property
    def rows(self) -> int:
        return len(self.gate_up) * self.num_experts

    @property
    def bf16_bytes(self) -> int:
        """What the same experts take in bfloat16."""
        return len(self.gate_up) * self.num_experts * 3 * self.hidden * self.inter * 2


@dataclass
class DecoderWeights:
    embed: torch.Tensor
    final_norm: torch.Tensor
    lm_head: torch.Tensor
    layers: list[LayerWeights]
    experts: ExpertBanks  # a PackedExpertBanks for quantized experts
