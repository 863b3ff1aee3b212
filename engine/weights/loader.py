"""Load a checkpoint into `DecoderWeights`: dense tensors on the device, experts into host banks.

Contract: `load_weights(cfg, reader, device, dtype, progress)` reads every tensor the config
implies, checks its shape (a mismatch raises `WeightError` naming tensor and file), accepts routed
experts stored per expert (`experts.{e}.gate_proj.weight`, ...), fused (`experts.gate_up_proj`
[E, 2I, H] or its transpose, `experts.down_proj`) or stacked (`experts.gate_proj` [E, I, H]), or in
gpt-oss's layout (`cfg.expert_layout == "gpt_oss"`: engine/weights/gpt_oss.py), and ignores tensors
of other towers (vision, MTP). Family name maps: MLA attention (`self_attn.q_a_proj`,
`kv_a_proj_with_mqa`, `kv_b_proj`, ...: DeepSeek-V3, GLM-4.7-Flash), the router as `mlp.gate` (with
`gate.e_score_correction_bias` for sigmoid routers) or `mlp.router` (with its bias: gpt-oss), shared
experts as `shared_expert` (+ `shared_expert_gate`, Qwen) or `shared_experts` (DeepSeek, GLM), and
Qwen3-Next's fused Gated DeltaNet projections (`in_proj_qkvz`, `in_proj_ba`, grouped per key head)
split into Qwen3.5's four. `progress(done, total)` is called as layers load.
Quantized routed experts (a GGUF's quant types, an HF fp8 / nvfp4 / mxfp4 checkpoint) load packed,
as stored, into `PackedExpertBanks` (engine/weights/packed.py; gpt-oss's, with their biases:
engine/weights/gpt_oss.py); float experts into `ExpertBanks`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.config import LINEAR_ATTENTION, ModelConfig
from engine.errors import WeightError
from engine.weights.gguf_reader import GgufReader
from engine.weights.gpt_oss import gpt_oss_experts, gpt_oss_packed
from engine.weights.layout import (
    AttentionWeights,
    DecoderWeights,
    ExpertBanks,
    LayerWeights,
    LinearAttentionWeights,
    MlaWeights,
    MlpWeights,
    MoeWeights,
)
from engine.weights.packed import load_packed_experts, packed_format
from engine.weights.reader import CheckpointReader

Progress = Callable[[int, int], None]
_ALIGN = 64  # bytes: a cache line, and what torch's CPU allocator gives


class _Fetch:
    def __init__(self, reader: CheckpointReader | GgufReader, device: torch.device, dtype: torch.dtype) -> None:
        self.reader, self.device, self.dtype = reader, device, dtype

    def raw(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if not self.reader.has(name):
            raise WeightError(f"{self.reader.model_dir}: missing tensor {name!r}")
        got = self.reader.shape(name)
        if got != shape:
            raise WeightError(
                f"{self.reader.file_of(name)}: tensor {name!r} has shape {list(got)}, expected {list(shape)}"
            )
        return self.reader.get(name)

    def dense(self, name: str, *shape: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        t = self.raw(name, tuple(shape)).to(device=self.device, dtype=dtype or self.dtype).contiguous()
        # a tensor read in place from a file sits wherever the file put it; CPU BLAS kernels order
        # their sums by the pointer's alignment (a one-row product on the torch 2.13 CPU build gave
        # other float32 roundings for the same router weights at offsets 0 and 40): own, aligned memory
        return t.clone() if t.device.type == "cpu" and t.data_ptr() % _ALIGN else t

    def optional(self, name: str, *shape: int) -> torch.Tensor | None:
        return self.dense(name, *shape) if self.reader.has(name) else None


def load_weights(
    cfg: ModelConfig,
    reader: CheckpointReader | GgufReader,
    device: torch.device,
    dtype: torch.dtype,
    progress: Progress | None = None,
) -> DecoderWeights:
    f = _Fetch(reader, device, dtype)
    p = cfg.weight_prefix
    h, e, i = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    gpt_oss = cfg.expert_layout == "gpt_oss"
    if gpt_oss:
        packed = gpt_oss_packed(reader, cfg)
    else:
        packed = load_packed_experts(reader, cfg) if packed_format(reader, cfg) is not None else None  # type: ignore[arg-type]
    rows = 0 if packed is not None else cfg.num_moe_layers * e
    banks = ExpertBanks(w13=torch.empty(rows, 2 * i, h, dtype=dtype), w2=torch.empty(rows, h, i, dtype=dtype),
                        num_experts=e, activation=cfg.expert_activation, alpha=cfg.swiglu_alpha,
                        limit=cfg.swiglu_limit)
    if cfg.expert_bias:
        banks.b13 = torch.zeros(rows, 2 * i, dtype=dtype)
        banks.b2 = torch.zeros(rows, h, dtype=dtype)
    experts = packed if packed is not None else banks
    embed = f.dense(f"{p}embed_tokens.weight", cfg.vocab_size, h)
    norm_dtype = torch.float32 if cfg.norm_float32 else dtype
    layers = []
    total = cfg.num_layers + 1
    for li in range(cfg.num_layers):
        lp = f"{p}layers.{li}."
        lw = LayerWeights(input_norm=f.dense(lp + "input_layernorm.weight", h, dtype=norm_dtype),
                          post_norm=f.dense(lp + "post_attention_layernorm.weight", h, dtype=norm_dtype))
        if cfg.layer_types[li] != LINEAR_ATTENTION and cfg.attention_kind == "mla":
            lw.mla = _mla(f, cfg, lp + "self_attn.")
        elif cfg.layer_types[li] != LINEAR_ATTENTION:
            lw.attention = _attention(f, cfg, lp + "self_attn.")
        else:
            lw.linear_attention = _linear_attention(f, cfg, lp + "linear_attn.")
        if cfg.moe_layers[li]:
            lw.moe_index = cfg.moe_layer_ids.index(li)
            lw.moe = _moe(f, cfg, lp + "mlp.")
            if packed is None and gpt_oss:
                gpt_oss_experts(f, cfg, lp + "mlp.experts.", banks, lw.moe_index)
            elif packed is None:
                _experts(f, cfg, lp + "mlp.experts.", banks, lw.moe_index)
        else:
            di = cfg.dense_intermediate_size
            lw.mlp = MlpWeights(f.dense(lp + "mlp.gate_proj.weight", di, h), f.dense(lp + "mlp.up_proj.weight", di, h),
                                f.dense(lp + "mlp.down_proj.weight", h, di))
        layers.append(lw)
        if progress:
            progress(li + 1, total)
    final_norm = f.dense(f"{p}norm.weight", h, dtype=norm_dtype)
    if cfg.tie_word_embeddings and not reader.has("lm_head.weight"):
        lm_head = embed
    else:
        lm_head = f.dense("lm_head.weight", cfg.vocab_size, h)
    if progress:
        progress(total, total)
    return DecoderWeights(embed=embed, final_norm=final_norm, lm_head=lm_head, layers=layers, experts=experts)


def _attention(f: _Fetch, cfg: ModelConfig, ap: str) -> AttentionWeights:
    h, hd = cfg.hidden_size, cfg.head_dim
    q_out = cfg.num_heads * hd * (2 if cfg.attn_output_gate else 1)
    kv_out = cfg.num_kv_heads * hd
    w = AttentionWeights(
        q_proj=f.dense(ap + "q_proj.weight", q_out, h),
        k_proj=f.dense(ap + "k_proj.weight", kv_out, h),
        v_proj=f.dense(ap + "v_proj.weight", kv_out, h),
        o_proj=f.dense(ap + "o_proj.weight", h, cfg.num_heads * hd),
        q_norm=f.dense(ap + "q_norm.weight", hd) if cfg.qk_norm else None,
        k_norm=f.dense(ap + "k_norm.weight", hd) if cfg.qk_norm else None,
        sinks=f.dense(ap + "sinks", cfg.num_heads, dtype=torch.float32) if cfg.attention_sinks else None,
    )
    if cfg.attention_bias:
        w.q_bias = f.dense(ap + "q_proj.bias", q_out)
        w.k_bias = f.dense(ap + "k_proj.bias", kv_out)
        w.v_bias = f.dense(ap + "v_proj.bias", kv_out)
        w.o_bias = f.optional(ap + "o_proj.bias", h)
    return w


def _mla(f: _Fetch, cfg: ModelConfig, ap: str) -> MlaWeights:
    h, heads, c = cfg.hidden_size, cfg.num_heads, cfg.kv_lora_rank
    qk, rope, v = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    w = MlaWeights(
        kv_a_proj=f.dense(ap + "kv_a_proj_with_mqa.weight", c + rope, h),
        kv_a_norm=f.dense(ap + "kv_a_layernorm.weight", c),
        kv_b_proj=f.dense(ap + "kv_b_proj.weight", heads * (cfg.qk_nope_head_dim + v), c),
        o_proj=f.dense(ap + "o_proj.weight", h, heads * v),
    )
    if cfg.q_lora_rank:
        w.q_a_proj = f.dense(ap + "q_a_proj.weight", cfg.q_lora_rank, h)
        w.q_a_norm = f.dense(ap + "q_a_layernorm.weight", cfg.q_lora_rank)
        w.q_b_proj = f.dense(ap + "q_b_proj.weight", heads * qk, cfg.q_lora_rank)
    else:
        w.q_proj = f.dense(ap + "q_proj.weight", heads * qk, h)
    if cfg.attention_bias:
        w.q_a_bias = f.optional(ap + "q_a_proj.bias", cfg.q_lora_rank) if cfg.q_lora_rank else None
        w.kv_a_bias = f.dense(ap + "kv_a_proj_with_mqa.bias", c + rope)
        w.o_bias = f.optional(ap + "o_proj.bias", h)
    return w


def _gdn_projections(f: _Fetch, cfg: ModelConfig, lp: str) -> tuple[torch.Tensor, ...]:
    """(in_proj_qkv, in_proj_z, in_proj_a, in_proj_b) in Qwen3.5's layout, from Qwen3.5's four
    tensors or Qwen3-Next's two, whose rows run per key head: q, k, then that head's values and z
    (in_proj_qkvz), its b then its a (in_proj_ba)."""
    h, hv = cfg.hidden_size, cfg.linear_num_value_heads
    if not f.reader.has(lp + "in_proj_qkvz.weight"):
        return (f.dense(lp + "in_proj_qkv.weight", cfg.linear_conv_dim, h),
                f.dense(lp + "in_proj_z.weight", cfg.linear_value_dim, h),
                f.dense(lp + "in_proj_a.weight", hv, h), f.dense(lp + "in_proj_b.weight", hv, h))
    kh, dk, dv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    per = hv // kh  # value heads per key head
    qkvz = f.dense(lp + "in_proj_qkvz.weight", 2 * cfg.linear_key_dim + 2 * cfg.linear_value_dim, h)
    q, k, v, z = qkvz.view(kh, 2 * dk + 2 * per * dv, h).split([dk, dk, per * dv, per * dv], dim=1)
    ba = f.dense(lp + "in_proj_ba.weight", 2 * hv, h).view(kh, 2 * per, h)
    qkv = torch.cat([q.reshape(-1, h), k.reshape(-1, h), v.reshape(-1, h)])
    return (qkv.contiguous(), z.reshape(-1, h).contiguous(), ba[:, per:].reshape(-1, h).contiguous(),
            ba[:, :per].reshape(-1, h).contiguous())


def _linear_attention(f: _Fetch, cfg: ModelConfig, lp: str) -> LinearAttentionWeights:
    h, hv = cfg.hidden_size, cfg.linear_num_value_heads
    conv = f.dense(lp + "conv1d.weight", cfg.linear_conv_dim, 1, cfg.linear_conv_kernel_dim)
    qkv, z, a, b = _gdn_projections(f, cfg, lp)
    return LinearAttentionWeights(
        in_proj_qkv=qkv,
        in_proj_z=z,
        in_proj_a=a,
        in_proj_b=b,
        conv=conv[:, 0, :].contiguous(),
        a_log=f.dense(lp + "A_log", hv, dtype=torch.float32),
        dt_bias=f.dense(lp + "dt_bias", hv, dtype=torch.float32),
        norm=f.dense(lp + "norm.weight", cfg.linear_value_head_dim),
        out_proj=f.dense(lp + "out_proj.weight", h, cfg.linear_value_dim),
    )


def _moe(f: _Fetch, cfg: ModelConfig, mp: str) -> MoeWeights:
    h = cfg.hidden_size
    if f.reader.has(mp + "router.weight"):  # gpt-oss
        w = MoeWeights(router=f.dense(mp + "router.weight", cfg.num_experts, h),
                       router_bias=f.optional(mp + "router.bias", cfg.num_experts))
    else:
        w = MoeWeights(router=f.dense(mp + "gate.weight", cfg.num_experts, h))
    if cfg.router_kind == "sigmoid_grouped":
        w.score_bias = f.dense(mp + "gate.e_score_correction_bias", cfg.num_experts, dtype=torch.float32)
    si = cfg.shared_expert_intermediate_size
    if si:
        sp = mp + ("shared_expert." if cfg.shared_expert_gated else "shared_experts.")
        w.shared = MlpWeights(
            f.dense(sp + "gate_proj.weight", si, h),
            f.dense(sp + "up_proj.weight", si, h),
            f.dense(sp + "down_proj.weight", h, si),
        )
        if cfg.shared_expert_gated:
            w.shared_gate = f.dense(mp + "shared_expert_gate.weight", 1, h)
    return w


def _experts(f: _Fetch, cfg: ModelConfig, ep: str, banks: ExpertBanks, moe_index: int) -> None:
    h, e, i = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    rows = slice(moe_index * e, (moe_index + 1) * e)
    dtype = banks.w13.dtype
    reader = f.reader
    fused = next((n for n in (ep + "gate_up_proj", ep + "gate_up_proj.weight") if reader.has(n)), None)
    if fused is not None:
        down = ep + "down_proj" if reader.has(ep + "down_proj") else ep + "down_proj.weight"
        gu = _either(f, fused, (e, 2 * i, h), (e, h, 2 * i))
        dn = _either(f, down, (e, h, i), (e, i, h))
        banks.w13[rows] = gu.to(dtype)
        banks.w2[rows] = dn.to(dtype)
    elif reader.has(ep + "gate_proj") or reader.has(ep + "gate_proj.weight"):
        sfx = "" if reader.has(ep + "gate_proj") else ".weight"
        banks.w13[rows, :i] = _either(f, ep + "gate_proj" + sfx, (e, i, h), (e, h, i)).to(dtype)
        banks.w13[rows, i:] = _either(f, ep + "up_proj" + sfx, (e, i, h), (e, h, i)).to(dtype)
        banks.w2[rows] = _either(f, ep + "down_proj" + sfx, (e, h, i), (e, i, h)).to(dtype)
    else:
        if not reader.has(f"{ep}0.gate_proj.weight"):
            raise WeightError(f"{reader.model_dir}: missing experts of {ep.rstrip('.')!r} (neither "
                              f"{ep}0.gate_proj.weight nor fused {ep}gate_up_proj)")
        for x in range(e):
            row = moe_index * e + x
            banks.w13[row, :i] = f.raw(f"{ep}{x}.gate_proj.weight", (i, h)).to(dtype)
            banks.w13[row, i:] = f.raw(f"{ep}{x}.up_proj.weight", (i, h)).to(dtype)
            banks.w2[row] = f.raw(f"{ep}{x}.down_proj.weight", (h, i)).to(dtype)


def _either(f: _Fetch, name: str, shape: tuple[int, ...], transposed: tuple[int, ...]) -> torch.Tensor:
    """Stacked experts in the in-memory layout, or transposed per expert (as some releases store)."""
    got = f.reader.shape(name) if f.reader.has(name) else None
    if got == transposed and got != shape:
        return f.raw(name, transposed).transpose(1, 2)
    return f.raw(name, shape)
