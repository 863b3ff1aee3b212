"""Load a checkpoint into `DecoderWeights`: dense tensors on the device, experts into host banks.

Contract: `load_weights(cfg, reader, device, dtype, progress)` reads every tensor the config
implies, checks its shape (a mismatch raises `WeightError` naming tensor and file), accepts routed
experts stored per expert (`experts.{e}.gate_proj.weight`, ...), fused (`experts.gate_up_proj`
[E, 2I, H] or its transpose, `experts.down_proj`) or stacked (`experts.gate_proj` [E, I, H]), and
ignores tensors of other towers (vision, MTP). `progress(done, total)` is called as layers load.
Quantized routed experts (a GGUF's quant types, an HF fp8 / nvfp4 / mxfp4 checkpoint) load packed,
as stored, into `PackedExpertBanks` (engine/weights/packed.py); float experts into `ExpertBanks`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.config import FULL_ATTENTION, ModelConfig
from engine.errors import WeightError
from engine.weights.gguf_reader import GgufReader
from engine.weights.layout import (
    AttentionWeights,
    DecoderWeights,
    ExpertBanks,
    LayerWeights,
    LinearAttentionWeights,
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
    packed = packed_format(reader, cfg) is not None
    rows = 0 if packed else cfg.num_moe_layers * e
    banks = ExpertBanks(w13=torch.empty(rows, 2 * i, h, dtype=dtype), w2=torch.empty(rows, h, i, dtype=dtype),
                        num_experts=e)
    experts = load_packed_experts(reader, cfg) if packed else banks  # type: ignore[arg-type]
    embed = f.dense(f"{p}embed_tokens.weight", cfg.vocab_size, h)
    layers = []
    total = cfg.num_layers + 1
    for li in range(cfg.num_layers):
        lp = f"{p}layers.{li}."
        lw = LayerWeights(input_norm=f.dense(lp + "input_layernorm.weight", h),
                          post_norm=f.dense(lp + "post_attention_layernorm.weight", h))
        if cfg.layer_types[li] == FULL_ATTENTION:
            lw.attention = _attention(f, cfg, lp + "self_attn.")
        else:
            lw.linear_attention = _linear_attention(f, cfg, lp + "linear_attn.")
        if cfg.moe_layers[li]:
            lw.moe_index = cfg.moe_layer_ids.index(li)
            lw.moe = _moe(f, cfg, lp + "mlp.")
            if not packed:
                _experts(f, cfg, lp + "mlp.experts.", banks, lw.moe_index)
        else:
            di = cfg.dense_intermediate_size
            lw.mlp = MlpWeights(f.dense(lp + "mlp.gate_proj.weight", di, h), f.dense(lp + "mlp.up_proj.weight", di, h),
                                f.dense(lp + "mlp.down_proj.weight", h, di))
        layers.append(lw)
        if progress:
            progress(li + 1, total)
    final_norm = f.dense(f"{p}norm.weight", h)
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
        q_norm=f.dense(ap + "q_norm.weight", hd),
        k_norm=f.dense(ap + "k_norm.weight", hd),
    )
    if cfg.attention_bias:
        w.q_bias = f.dense(ap + "q_proj.bias", q_out)
        w.k_bias = f.dense(ap + "k_proj.bias", kv_out)
        w.v_bias = f.dense(ap + "v_proj.bias", kv_out)
        w.o_bias = f.optional(ap + "o_proj.bias", h)
    return w


def _linear_attention(f: _Fetch, cfg: ModelConfig, lp: str) -> LinearAttentionWeights:
    h, hv = cfg.hidden_size, cfg.linear_num_value_heads
    conv = f.dense(lp + "conv1d.weight", cfg.linear_conv_dim, 1, cfg.linear_conv_kernel_dim)
    return LinearAttentionWeights(
        in_proj_qkv=f.dense(lp + "in_proj_qkv.weight", cfg.linear_conv_dim, h),
        in_proj_z=f.dense(lp + "in_proj_z.weight", cfg.linear_value_dim, h),
        in_proj_a=f.dense(lp + "in_proj_a.weight", hv, h),
        in_proj_b=f.dense(lp + "in_proj_b.weight", hv, h),
        conv=conv[:, 0, :].contiguous(),
        a_log=f.dense(lp + "A_log", hv, dtype=torch.float32),
        dt_bias=f.dense(lp + "dt_bias", hv, dtype=torch.float32),
        norm=f.dense(lp + "norm.weight", cfg.linear_value_head_dim),
        out_proj=f.dense(lp + "out_proj.weight", h, cfg.linear_value_dim),
    )


def _moe(f: _Fetch, cfg: ModelConfig, mp: str) -> MoeWeights:
    h = cfg.hidden_size
    w = MoeWeights(router=f.dense(mp + "gate.weight", cfg.num_experts, h))
    si = cfg.shared_expert_intermediate_size
    if si:
        w.shared = MlpWeights(
            f.dense(mp + "shared_expert.gate_proj.weight", si, h),
            f.dense(mp + "shared_expert.up_proj.weight", si, h),
            f.dense(mp + "shared_expert.down_proj.weight", h, si),
        )
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
