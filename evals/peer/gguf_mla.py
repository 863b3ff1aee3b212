"""write_gguf.py --arch deepseek2: the MLA family's tensors and keys, GLM-4.7-Flash's shape by default.

Contract: llama.cpp (commit 0c1e57098) runs GLM-4.7-Flash (`Glm4MoeLiteForCausalLM`) as `deepseek2`
(its convert script maps it there; src/models/deepseek2.cpp names the 47-layer, 154880-token case
"GLM 4.7 Lite"). `deepseek2_tensors(args, vocab)` lists every tensor that loader's
`load_arch_tensors` creates for an MLA file without next-token-prediction layers, as
(name, numpy shape (the reverse of its ne), kind, fill, role) in write_gguf.TensorSpec's terms:
q through a LoRA pair (`attn_q_a`, `attn_q_a_norm`, `attn_q_b`; `attn_q` when --q-lora is 0),
`attn_kv_a_mqa` (latent + rope part), `attn_kv_a_norm`, the split up-projections `attn_k_b`
{nope, kv_lora, heads} and `attn_v_b` {kv_lora, v_head, heads}, `attn_output`; the first
--first-dense layers a dense MLP (`ffn_gate` / `ffn_up` / `ffn_down` of --ff), the others a sigmoid
router with a zero correction bias (`exp_probs_b.bias`), separate gate / up / down expert banks and
--shared-experts shared experts of --inter each. `add_deepseek2_hparams` writes the keys that loader
and llama_model_base::load_hparams read, as the converter writes them for MLA: head_count_kv 1,
key_length kv_lora + rope and value_length kv_lora (the MQA form llama.cpp runs), the per-head sizes
under key_length_mla / value_length_mla, sigmoid gating (expert_gating_func 2), normalised top-k
weights scaled by --routed-scale, one expert group.
"""

from __future__ import annotations

import argparse
from typing import Any

# GLM-4.7-Flash (engine/weights/shapes.py "glm-4.7-flash"), all 47 layers; its vocabulary is 154880
# tokens, the file takes the copied tokenizer's
GLM_FLASH: dict[str, Any] = dict(
    layers=47, experts=64, top_k=4, hidden=2048, inter=1536, heads=20, kv_heads=20, head_dim=256, ff=10240,
    ctx=202752, rope_base=1e6, q_lora=768, kv_lora=512, qk_nope=192, qk_rope=64, v_head=256, first_dense=1,
    shared_experts=1, routed_scale=1.8)
OPTIONS = ("q_lora", "kv_lora", "qk_nope", "qk_rope", "v_head", "first_dense", "shared_experts", "routed_scale")


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--q-lora", type=int, default=None, help="deepseek2: q LoRA rank, 0 for a plain attn_q (768)")
    p.add_argument("--kv-lora", type=int, default=None, help="deepseek2: latent KV rank (512)")
    p.add_argument("--qk-nope", type=int, default=None, help="deepseek2: per-head q/k dims without rope (192)")
    p.add_argument("--qk-rope", type=int, default=None, help="deepseek2: per-head rotary dims (64)")
    p.add_argument("--v-head", type=int, default=None, help="deepseek2: per-head value dims (256)")
    p.add_argument("--first-dense", type=int, default=None, help="deepseek2: leading dense-MLP layers (1)")
    p.add_argument("--shared-experts", type=int, default=None, help="deepseek2: shared experts (1)")
    p.add_argument("--routed-scale", type=float, default=None, help="deepseek2: routed experts' weight scale (1.8)")


Spec = tuple[str, tuple[int, ...], str, float, str]


def deepseek2_tensors(a: argparse.Namespace, vocab: int) -> list[Spec]:
    h, heads, qk = a.hidden, a.heads, a.qk_nope + a.qk_rope
    shared = a.inter * a.shared_experts
    out: list[Spec] = [("token_embd.weight", (vocab, h), "mat", 0.0, "embed"),
                       ("output_norm.weight", (h,), "norm", 0.0, ""), ("output.weight", (vocab, h), "mat", 0.0, "")]
    for i in range(a.layers):
        b = f"blk.{i}."
        out.append((b + "attn_norm.weight", (h,), "norm", 0.0, ""))
        if a.q_lora:
            out += [(b + "attn_q_a_norm.weight", (a.q_lora,), "norm", 0.0, "")]
        out.append((b + "attn_kv_a_norm.weight", (a.kv_lora,), "norm", 0.0, ""))
        if a.q_lora:
            out += [(b + "attn_q_a.weight", (a.q_lora, h), "mat", 0.0, ""),
                    (b + "attn_q_b.weight", (heads * qk, a.q_lora), "mat", 0.0, "")]
        else:
            out.append((b + "attn_q.weight", (heads * qk, h), "mat", 0.0, ""))
        out += [
            (b + "attn_kv_a_mqa.weight", (a.kv_lora + a.qk_rope, h), "mat", 0.0, ""),
            (b + "attn_k_b.weight", (heads, a.kv_lora, a.qk_nope), "mat", 0.0, ""),
            (b + "attn_v_b.weight", (heads, a.v_head, a.kv_lora), "mat", 0.0, ""),
            (b + "attn_output.weight", (h, heads * a.v_head), "mat", 0.0, "residual"),
            (b + "ffn_norm.weight", (h,), "norm", 0.0, ""),
        ]
        if i < a.first_dense:
            out += [(b + "ffn_gate.weight", (a.ff, h), "mat", 0.0, ""),
                    (b + "ffn_down.weight", (h, a.ff), "mat", 0.0, "residual"),
                    (b + "ffn_up.weight", (a.ff, h), "mat", 0.0, "")]
            continue
        out += [
            (b + "ffn_gate_inp.weight", (a.experts, h), "router", 0.0, ""),
            (b + "exp_probs_b.bias", (a.experts,), "const", 0.0, ""),
            (b + "ffn_down_exps.weight", (a.experts, h, a.inter), "mat", 0.0, "residual"),
            (b + "ffn_gate_exps.weight", (a.experts, a.inter, h), "mat", 0.0, ""),
            (b + "ffn_up_exps.weight", (a.experts, a.inter, h), "mat", 0.0, ""),
            (b + "ffn_gate_shexp.weight", (shared, h), "mat", 0.0, ""),
            (b + "ffn_down_shexp.weight", (h, shared), "mat", 0.0, "residual"),
            (b + "ffn_up_shexp.weight", (shared, h), "mat", 0.0, ""),
        ]
    return out


def add_deepseek2_hparams(writer: Any, arch: str, a: argparse.Namespace, vocab: int) -> None:
    if not (0 <= a.first_dense < a.layers) or a.shared_experts < 1 or a.qk_nope < 1 or a.qk_rope < 2:
        raise SystemExit("write_gguf.py: deepseek2 needs 0 <= --first-dense < --layers, --shared-experts >= 1, "
                         "--qk-nope >= 1, --qk-rope >= 2")
    u32 = {"context_length": a.ctx, "embedding_length": a.hidden, "block_count": a.layers,
           "feed_forward_length": a.ff, "attention.head_count": a.heads, "attention.head_count_kv": 1,
           "attention.key_length": a.kv_lora + a.qk_rope, "attention.value_length": a.kv_lora,
           "attention.key_length_mla": a.qk_nope + a.qk_rope, "attention.value_length_mla": a.v_head,
           "attention.kv_lora_rank": a.kv_lora, "rope.dimension_count": a.qk_rope,
           "leading_dense_block_count": a.first_dense, "expert_feed_forward_length": a.inter,
           "expert_count": a.experts, "expert_used_count": a.top_k, "expert_shared_count": a.shared_experts,
           "expert_gating_func": 2, "expert_group_count": 1, "expert_group_used_count": 1,
           "attention.q_lora_rank": a.q_lora}  # required (0: a plain attn_q) unless the layer count says "lite"
    for key, value in u32.items():
        writer.add_uint32(f"{arch}.{key}", int(value))
    writer.add_float32(f"{arch}.rope.freq_base", a.rope_base)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", a.rms_eps)
    writer.add_float32(f"{arch}.expert_weights_scale", a.routed_scale)
    writer.add_bool(f"{arch}.expert_weights_norm", True)
    writer.add_uint32(f"{arch}.vocab_size", vocab)
