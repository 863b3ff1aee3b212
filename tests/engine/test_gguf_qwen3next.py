"""A Qwen3-Next (`qwen3next`) GGUF loads as the model it was converted from.

The file is written here from a tiny random transformers Qwen3-Next under the names and layout
llama.cpp's qwen3next loader and graph (src/models/qwen3next.cpp, commit 0c1e57098) read: RMSNorm
weights stored as multipliers (Hugging Face's zero-centred w + 1; the gated Gated DeltaNet norm
as is), `ssm_a` = -exp(A_log), `in_proj_qkvz` (rows per key head: q, k, its values, its z) split
into `attn_qkv` (all q, all k, all v: the graph's concatenation, value heads in grouped order) and
`attn_gate` (z), `in_proj_ba` kept whole as `ssm_ba` (the graph splits it per key head: b, then a),
the conv kernel without its unit axis, stacked experts, the shared expert's gate as a vector. The
engine's prefill logits on the GGUF equal transformers' on the model (float32, rel. err <= 1e-4).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from checkpoints import FULL, LIN, hf_prefill_logits, rel_err
from families import FamilySpec, Runner, make_family_model

from engine.model.load import load_decoder
from engine.weights.gguf_reader import GgufReader

gguf = pytest.importorskip("gguf")
KH, VH, DK, H = 2, 4, 8, 32
SPEC = FamilySpec("qwen3_next_gguf", "Qwen3NextConfig", dict(
    vocab_size=96, hidden_size=H, num_attention_heads=4, max_position_embeddings=512, eos_token_id=None,
    pad_token_id=None, bos_token_id=None, tie_word_embeddings=False, num_hidden_layers=4, num_key_value_heads=2,
    head_dim=16, linear_key_head_dim=DK, linear_value_head_dim=DK, linear_num_key_heads=KH,
    linear_num_value_heads=VH, linear_conv_kernel_dim=4, moe_intermediate_size=16,
    shared_expert_intermediate_size=24, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
    layer_types=[LIN, LIN, LIN, FULL],
    rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25}), seed=7)
_PLAIN = {"embed_tokens": "token_embd", "lm_head": "output", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "linear_attn.in_proj_ba": "ssm_ba", "linear_attn.out_proj": "ssm_out", "linear_attn.norm": "ssm_norm",
          "mlp.gate": "ffn_gate_inp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
          "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp"}
_PLUS_ONE = {"model.norm": "output_norm", "input_layernorm": "attn_norm",
             "post_attention_layernorm": "post_attention_norm", "self_attn.q_norm": "attn_q_norm",
             "self_attn.k_norm": "attn_k_norm"}


def _gguf_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        t = t.detach().float()
        if "rotary_emb" in name:
            continue
        layer = name.split(".")[2] if name.startswith("model.layers.") else ""
        b = f"blk.{layer}." if layer else ""
        key = name.removeprefix(f"model.layers.{layer}.").removesuffix(".weight") if layer else \
            name.removesuffix(".weight").removeprefix("model.").replace("norm", "model.norm")
        if key in _PLUS_ONE:
            out[b + _PLUS_ONE[key] + ".weight"] = t + 1
        elif key in _PLAIN:
            out[b + _PLAIN[key] + ".weight"] = t
        elif key == "linear_attn.in_proj_qkvz":
            per = VH // KH
            q, k, v, z = t.view(KH, -1, H).split([DK, DK, per * DK, per * DK], dim=1)
            out[b + "attn_qkv.weight"] = torch.cat([q.reshape(-1, H), k.reshape(-1, H), v.reshape(-1, H)])
            out[b + "attn_gate.weight"] = z.reshape(-1, H)
        elif key == "linear_attn.conv1d":
            out[b + "ssm_conv1d.weight"] = t[:, 0]
        elif key == "linear_attn.dt_bias":
            out[b + "ssm_dt.bias"] = t
        elif key == "linear_attn.A_log":
            out[b + "ssm_a"] = -torch.exp(t)
        elif key == "mlp.experts.gate_up_proj":  # [E, 2I, H]: gate rows, then up rows
            out[b + "ffn_gate_exps.weight"], out[b + "ffn_up_exps.weight"] = t.chunk(2, dim=1)
        elif key == "mlp.experts.down_proj":
            out[b + "ffn_down_exps.weight"] = t
        elif key == "mlp.shared_expert_gate":
            out[b + "ffn_gate_inp_shexp.weight"] = t[0]
        else:
            raise AssertionError(f"unmapped tensor {name}")
    return out


def write_qwen3next_gguf(model: torch.nn.Module, path: Path) -> Path:
    c: Any = model.config
    a = "qwen3next"
    w = gguf.GGUFWriter(str(path), a)
    for key, value in {"context_length": 512, "embedding_length": H, "block_count": c.num_hidden_layers,
                       "attention.head_count": c.num_attention_heads, "attention.head_count_kv": c.num_key_value_heads,
                       "attention.key_length": c.head_dim, "attention.value_length": c.head_dim,
                       "rope.dimension_count": c.head_dim // 4, "expert_count": c.num_experts,
                       "expert_used_count": c.num_experts_per_tok,
                       "expert_feed_forward_length": c.moe_intermediate_size,
                       "expert_shared_feed_forward_length": c.shared_expert_intermediate_size,
                       "full_attention_interval": 4, "ssm.conv_kernel": 4, "ssm.state_size": DK,
                       "ssm.group_count": KH, "ssm.time_step_rank": VH, "ssm.inner_size": VH * DK}.items():
        w.add_uint32(f"{a}.{key}", value)
    w.add_float32(f"{a}.rope.freq_base", 1e4)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", c.rms_norm_eps)
    for name, t in _gguf_tensors(model).items():
        w.add_tensor(name, t.contiguous().numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_qwen3next_gguf_matches_transformers(tmp_path: Path) -> None:
    model = make_family_model(SPEC)
    path = write_qwen3next_gguf(model, tmp_path / "tiny-qwen3next.gguf")
    cfg = GgufReader(path).config()
    assert cfg["model_type"] == "qwen3_next" and cfg["partial_rotary_factor"] == 0.25
    dec = load_decoder(path, "cpu", torch.float32, executor="torch")
    assert dec.cfg.family == "qwen3_next" and dec.cfg.num_layers == 4 and dec.cfg.norm_topk_prob
    ids = [int(t) for t in torch.randint(0, 96, (20,), generator=torch.Generator().manual_seed(5))]
    out = Runner(dec).step([(ids, 0, torch.arange(20), 0)])
    assert rel_err(out, hf_prefill_logits(model, ids)) <= 1e-4
