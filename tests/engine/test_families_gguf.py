"""GLM-4.5-family (`glm4moe`) and MLA (`deepseek2`) GGUFs load as the models they were converted from.

The files are written here from tiny transformers models: tensor names from the gguf package's own
name map for the architecture (`gguf.get_tensor_name_map`), metadata under llama.cpp's keys (dense
leading layers, shared experts, sigmoid gating, weights scale and norm, partial rotary, one
trailing next-token-prediction block that `block_count` includes; for deepseek2 the MLA sizes, YaRN
and kv_b_proj whole or split into attn_k_b / attn_v_b). The engine's logits on the GGUF equal
transformers' on the model (float32, 1e-4); another gating function is refused. This checks the
reader against these conventions as written here, not against a file llama.cpp wrote.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from checkpoints import hf_prefill_logits, rel_err
from families import FAMILY_SPECS, YARN, Runner, make_family_model

from engine.errors import ConfigError
from engine.model.load import load_decoder

gguf = pytest.importorskip("gguf")
SPEC = next(s for s in FAMILY_SPECS if s.name == "glm4_moe")
DS = next(s for s in FAMILY_SPECS if s.name == "deepseek_v3_qlora_yarn")
# llama.cpp keeps one YaRN magnitude (yarn_log_multiplier): the released models set mscale = mscale_all_dim
DS = dataclasses.replace(DS, kw={**DS.kw, "rope_parameters": {**YARN, "mscale": 0.8, "mscale_all_dim": 0.8}})


def write_gguf(model: torch.nn.Module, path: Path, gating: int = 2, split_kv_b: bool = True) -> Path:
    c = model.config
    layers = c.num_hidden_layers
    mla = hasattr(c, "kv_lora_rank")
    arch = gguf.MODEL_ARCH.DEEPSEEK2 if mla else gguf.MODEL_ARCH.GLM4_MOE
    names = gguf.get_tensor_name_map(arch, layers + 1)
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    w.add_block_count(layers + 1)
    w.add_nextn_predict_layers(1)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    if mla:
        w.add_key_length(c.kv_lora_rank + c.qk_rope_head_dim)  # the MQA form llama.cpp runs
        w.add_value_length(c.kv_lora_rank)
        w.add_key_length_mla(c.qk_nope_head_dim + c.qk_rope_head_dim)
        w.add_value_length_mla(c.v_head_dim)
        w.add_q_lora_rank(c.q_lora_rank)
        w.add_kv_lora_rank(c.kv_lora_rank)
        w.add_rope_dimension_count(c.qk_rope_head_dim)
        rp = c.rope_parameters
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rp["factor"])
        w.add_rope_scaling_orig_ctx_len(rp["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rp["mscale_all_dim"])
    else:
        w.add_key_length(c.head_dim)
        w.add_rope_dimension_count(int(c.head_dim * c.rope_parameters["partial_rotary_factor"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_expert_count(c.n_routed_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_expert_shared_count(c.n_shared_experts)
    w.add_leading_dense_block_count(c.first_k_dense_replace)
    w.add_expert_weights_scale(c.routed_scaling_factor)
    w.add_expert_weights_norm(c.norm_topk_prob)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType(gating))
    w.add_expert_group_count(c.n_group)
    w.add_expert_group_used_count(c.topk_group)
    tensors: dict[str, torch.Tensor] = {}
    for name, t in {**dict(model.named_parameters()), **dict(model.named_buffers())}.items():
        if "rotary_emb" in name:
            continue
        if mla and split_kv_b and name.endswith("kv_b_proj.weight"):  # per head: k_b transposed, v_b
            kv = t.view(c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
            tensors[name.replace("kv_b", "k_b")] = kv[:, :c.qk_nope_head_dim].transpose(1, 2)
            tensors[name.replace("kv_b", "v_b")] = kv[:, c.qk_nope_head_dim:]
        elif name.endswith("experts.gate_up_proj"):  # in memory [E, 2I, H]: gate rows, then up rows
            gate, up = t.chunk(2, dim=1)
            base = name.removesuffix(".gate_up_proj")
            tensors[base + ".gate_proj"], tensors[base + ".up_proj"] = gate, up
        else:
            tensors[name] = t
    tensors[f"model.layers.{layers}.input_layernorm.weight"] = torch.ones(c.hidden_size)  # the NextN block
    for name, t in tensors.items():
        # as llama.cpp's converter names them: the correction bias as `.bias`, stacked experts `.weight`
        if name.endswith("e_score_correction_bias"):
            name = name.removesuffix("_bias") + ".bias"
        elif not name.endswith((".weight", ".bias")):
            name += ".weight"
        gname = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gname is not None, name
        w.add_tensor(gname, t.detach().float().contiguous().numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_glm4moe_gguf_matches_transformers(tmp_path: Path) -> None:
    model = make_family_model(SPEC)
    path = write_gguf(model, tmp_path / "tiny-glm4moe.gguf")
    dec = load_decoder(path, "cpu", torch.float32, executor="torch")
    cfg = dec.cfg
    assert cfg.family == "glm4_moe" and cfg.num_layers == 3 and cfg.moe_layers == (False, True, True)
    assert cfg.router_kind == "sigmoid_grouped" and cfg.qk_norm and cfg.attention_bias and cfg.rotary_dim == 8
    ids = [int(t) for t in torch.randint(0, 96, (20,), generator=torch.Generator().manual_seed(3))]
    out = Runner(dec).step([(ids, 0, torch.arange(20), 0)])
    assert rel_err(out, hf_prefill_logits(model, ids)) <= 1e-4
    with pytest.raises(ConfigError, match="expert_gating_func 1 is not supported"):
        load_decoder(write_gguf(model, tmp_path / "softmax.gguf", gating=1), "cpu", torch.float32)


@pytest.mark.parametrize("split", [True, False], ids=["k_b_v_b", "kv_b"])
def test_deepseek2_gguf_matches_transformers(tmp_path: Path, split: bool) -> None:
    model = make_family_model(DS)
    dec = load_decoder(write_gguf(model, tmp_path / "tiny-deepseek2.gguf", split_kv_b=split), "cpu", torch.float32,
                       executor="torch")
    cfg = dec.cfg
    assert cfg.attention_kind == "mla" and cfg.q_lora_rank == 24 and cfg.v_head_dim == 12 and cfg.num_layers == 3
    assert cfg.rope_scaling.rope_type == "yarn" and cfg.rope_scaling.mscale_all_dim == pytest.approx(0.8)
    ids = [int(t) for t in torch.randint(0, 96, (20,), generator=torch.Generator().manual_seed(4))]
    out = Runner(dec).step([(ids, 0, torch.arange(20), 0)])
    assert rel_err(out, hf_prefill_logits(model, ids)) <= 1e-4
