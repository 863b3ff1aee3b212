"""A GLM-4.5-family (`glm4moe`) GGUF loads as the model it was converted from.

The file is written here from a tiny transformers Glm4MoeForCausalLM: tensor names from the gguf
package's own name map for the architecture (`gguf.get_tensor_name_map`), metadata under llama.cpp's
keys (dense leading layers, shared experts, sigmoid gating, weights scale and norm, partial rotary,
one trailing next-token-prediction block that `block_count` includes). The engine's logits on the
GGUF equal transformers' on the model (float32, 1e-4); another gating function is refused.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from checkpoints import hf_prefill_logits, rel_err
from families import FAMILY_SPECS, Runner, make_family_model

from engine.errors import ConfigError
from engine.model.load import load_decoder

gguf = pytest.importorskip("gguf")
SPEC = next(s for s in FAMILY_SPECS if s.name == "glm4_moe")


def write_glm4moe(model: torch.nn.Module, path: Path, gating: int = 2) -> Path:
    c = model.config
    layers = c.num_hidden_layers
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GLM4_MOE, layers + 1)
    w = gguf.GGUFWriter(str(path), "glm4moe")
    w.add_block_count(layers + 1)
    w.add_nextn_predict_layers(1)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
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
        if name.endswith("experts.gate_up_proj"):  # in memory [E, 2I, H]: gate rows, then up rows
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
    path = write_glm4moe(model, tmp_path / "tiny-glm4moe.gguf")
    dec = load_decoder(path, "cpu", torch.float32, executor="torch")
    cfg = dec.cfg
    assert cfg.family == "glm4_moe" and cfg.num_layers == 3 and cfg.moe_layers == (False, True, True)
    assert cfg.router_kind == "sigmoid_grouped" and cfg.qk_norm and cfg.attention_bias and cfg.rotary_dim == 8
    ids = [int(t) for t in torch.randint(0, 96, (20,), generator=torch.Generator().manual_seed(3))]
    out = Runner(dec).step([(ids, 0, torch.arange(20), 0)])
    assert rel_err(out, hf_prefill_logits(model, ids)) <= 1e-4
    with pytest.raises(ConfigError, match="expert_gating_func 1 is not supported"):
        load_decoder(write_glm4moe(model, tmp_path / "softmax.gguf", gating=1), "cpu", torch.float32)
