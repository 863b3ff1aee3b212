"""evals/peer/write_gguf.py --arch deepseek2 (GLM-4.7-Flash's MLA shape) and --arch qwen3next.

CPU only, no llama.cpp build. The keys, tensor names and ne shapes expected below are transcribed
from the peer commit's loaders (load_arch_hparams / load_arch_tensors of src/models/deepseek2.cpp
and src/models/qwen3next.cpp, llama_model_base::load_hparams), so a missing, extra or misshapen
tensor fails here as it would fail to load; the Q4_K_M types from llama_tensor_get_type
(src/llama-quant.cpp). The engine loads each written file (bf16 and q4_k_m) and decodes finite logits.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from peer_gguf import N_VOCAB, field, shape_args

from engine.engine import Engine
from engine.options import EngineOptions
from engine.sampling import SamplingParams

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed (pip install gguf)")
T = gguf.GGMLQuantizationType
# 3 layers (1 dense), q through a LoRA pair; rows of 256 where a K type is expected
MLA = {"layers": 3, "experts": 4, "top_k": 2, "hidden": 256, "inter": 256, "heads": 2, "ff": 256, "q_lora": 256,
       "kv_lora": 256, "qk_nope": 32, "qk_rope": 16, "v_head": 32, "first_dense": 1, "shared_experts": 1}
NEXT = {"layers": 4, "experts": 4, "top_k": 2, "hidden": 64, "inter": 32, "shared_inter": 24, "heads": 4,
        "kv_heads": 2, "head_dim": 64, "linear_key_heads": 2, "linear_value_heads": 4, "linear_head_dim": 16}



def _write(wg: ModuleType, vocab: Path, out: Path, arch: str, shape: dict[str, int], *extra: str) -> Path:
    assert wg.main(["--out", str(out), "--vocab-from", str(vocab), "--arch", arch, *shape_args(shape),
                    "--threads", "2", *extra]) == 0
    return out


@pytest.fixture(scope="module")
def mla(wg: ModuleType, vocab: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write(wg, vocab, tmp_path_factory.mktemp("a") / "mla.gguf", "deepseek2", MLA)


@pytest.fixture(scope="module")
def mla_q4(wg: ModuleType, vocab: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write(wg, vocab, tmp_path_factory.mktemp("a") / "mla-q4.gguf", "deepseek2", MLA, "--quant", "q4_k_m")


@pytest.fixture(scope="module")
def nxt(wg: ModuleType, vocab: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write(wg, vocab, tmp_path_factory.mktemp("a") / "next.gguf", "qwen3next", NEXT)


@pytest.fixture(scope="module")
def nxt_q4(wg: ModuleType, vocab: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write(wg, vocab, tmp_path_factory.mktemp("a") / "next-q4.gguf", "qwen3next", NEXT, "--quant", "q4_k_m")


def _tensors(path: Path) -> dict[str, tuple[tuple[int, ...], Any]]:
    return {t.name: (tuple(int(x) for x in t.shape), T(t.tensor_type)) for t in gguf.GGUFReader(str(path)).tensors}


def _u32(r: Any, arch: str, want: dict[str, int]) -> None:
    for key, value in want.items():
        kv = r.fields[f"{arch}.{key}"]
        assert kv.types == [gguf.GGUFValueType.UINT32], key  # get_key<uint32_t> wants exactly UINT32
        assert kv.contents() == value, key


def test_deepseek2_keys(mla: Path) -> None:
    r, s = gguf.GGUFReader(str(mla)), MLA
    assert field(r, "general.architecture") == "deepseek2"
    _u32(r, "deepseek2", {
        "context_length": 202752, "embedding_length": s["hidden"], "block_count": s["layers"],
        "attention.q_lora_rank": s["q_lora"], "attention.kv_lora_rank": s["kv_lora"],  # required (not "lite")
        "expert_feed_forward_length": s["inter"], "expert_shared_count": 1,  # required
        "attention.key_length_mla": s["qk_nope"] + s["qk_rope"], "attention.value_length_mla": s["v_head"],
        "attention.key_length": s["kv_lora"] + s["qk_rope"], "attention.value_length": s["kv_lora"],  # MQA form
        "attention.head_count": s["heads"], "attention.head_count_kv": 1, "rope.dimension_count": s["qk_rope"],
        "leading_dense_block_count": 1, "feed_forward_length": s["ff"], "expert_count": s["experts"],
        "expert_used_count": s["top_k"], "expert_gating_func": 2})  # sigmoid
    assert field(r, "deepseek2.expert_weights_norm") is True
    assert field(r, "deepseek2.expert_weights_scale") == pytest.approx(1.8)
    assert field(r, "deepseek2.attention.layer_norm_rms_epsilon") == pytest.approx(1e-6)
    assert "deepseek2.nextn_predict_layers" not in r.fields


def _mla_loader(s: dict[str, int]) -> dict[str, tuple[int, ...]]:
    """name -> ne, as load_arch_tensors of src/models/deepseek2.cpp creates them (is_mla, q_lora > 0)."""
    n_embd, n_head, k_mla, rope = s["hidden"], s["heads"], s["qk_nope"] + s["qk_rope"], s["qk_rope"]
    nope, ql, kvl, v_mla, n_exp, n_ff_exp = s["qk_nope"], s["q_lora"], s["kv_lora"], s["v_head"], s["experts"], s["inter"]
    want = {"token_embd.weight": (n_embd, N_VOCAB), "output_norm.weight": (n_embd,), "output.weight": (n_embd, N_VOCAB)}
    for i in range(s["layers"]):
        b = f"blk.{i}."
        want |= {b + "attn_norm.weight": (n_embd,), b + "attn_q_a_norm.weight": (ql,), b + "attn_kv_a_norm.weight": (kvl,),
                 b + "attn_q_a.weight": (n_embd, ql), b + "attn_q_b.weight": (ql, n_head * k_mla),
                 b + "attn_kv_a_mqa.weight": (n_embd, kvl + rope), b + "attn_k_b.weight": (nope, kvl, n_head),
                 b + "attn_v_b.weight": (kvl, v_mla, n_head), b + "attn_output.weight": (n_head * v_mla, n_embd),
                 b + "ffn_norm.weight": (n_embd,)}
        if i < s["first_dense"]:
            want |= {b + "ffn_gate.weight": (n_embd, s["ff"]), b + "ffn_down.weight": (s["ff"], n_embd),
                     b + "ffn_up.weight": (n_embd, s["ff"])}
        else:
            want |= {b + "ffn_gate_inp.weight": (n_embd, n_exp), b + "exp_probs_b.bias": (n_exp,),
                     b + "ffn_down_exps.weight": (n_ff_exp, n_embd, n_exp),
                     b + "ffn_gate_exps.weight": (n_embd, n_ff_exp, n_exp), b + "ffn_up_exps.weight": (n_embd, n_ff_exp, n_exp),
                     b + "ffn_gate_shexp.weight": (n_embd, n_ff_exp), b + "ffn_down_shexp.weight": (n_ff_exp, n_embd),
                     b + "ffn_up_shexp.weight": (n_embd, n_ff_exp)}
    return want


def test_deepseek2_tensors(mla: Path) -> None:
    got = _tensors(mla)
    assert {k: v[0] for k, v in got.items()} == _mla_loader(MLA)
    for name, (_, t) in got.items():
        floats = name.endswith(("norm.weight", "ffn_gate_inp.weight", "exp_probs_b.bias"))
        assert t == (T.F32 if floats else T.BF16), name


def test_deepseek2_q4_k_m_types(mla_q4: Path) -> None:
    got = {k: v[1] for k, v in _tensors(mla_q4).items()}
    assert got["token_embd.weight"] == T.Q4_K and got["output.weight"] == T.Q6_K
    for i in range(3):  # use_more_bits(i, 3): 3/8 = 0, 7*3/8 = 2: layer 2
        b = f"blk.{i}."
        for n in ("attn_q_a", "attn_q_b", "attn_kv_a_mqa", "attn_v_b"):
            assert got[b + n + ".weight"] == T.Q4_K, b + n
        assert got[b + "attn_k_b.weight"] == T.Q5_0  # rows of qk_nope 32: Q4_K -> Q5_0
        assert got[b + "attn_output.weight"] == T.Q5_0  # rows of 2 x 32
        down = [b + "ffn_down.weight"] if i == 0 else [b + "ffn_down_exps.weight", b + "ffn_down_shexp.weight"]
        for n in down:
            assert got[n] == (T.Q6_K if i == 2 else T.Q4_K), n
        if i:
            assert got[b + "ffn_gate_inp.weight"] == got[b + "exp_probs_b.bias"] == T.F32


def test_qwen3next_keys_and_tensors(nxt: Path, nxt_q4: Path) -> None:
    r, s = gguf.GGUFReader(str(nxt)), NEXT
    assert field(r, "general.architecture") == "qwen3next"
    _u32(r, "qwen3next", {
        "context_length": 262144, "embedding_length": s["hidden"], "block_count": s["layers"],
        "ssm.conv_kernel": 4, "ssm.inner_size": s["linear_value_heads"] * s["linear_head_dim"],
        "ssm.state_size": s["linear_head_dim"], "ssm.time_step_rank": s["linear_value_heads"],
        "ssm.group_count": s["linear_key_heads"], "expert_feed_forward_length": s["inter"],
        "expert_shared_feed_forward_length": s["shared_inter"], "full_attention_interval": 4,
        "rope.dimension_count": s["head_dim"] // 4, "attention.head_count": s["heads"],
        "attention.head_count_kv": s["kv_heads"], "attention.key_length": s["head_dim"]})
    assert "qwen3next.rope.dimension_sections" not in r.fields  # NEOX rotary, no IMRoPE sections
    got, q4 = _tensors(nxt), {k: v[1] for k, v in _tensors(nxt_q4).items()}
    n_embd, vh, kd = s["hidden"], s["linear_value_heads"], s["linear_key_heads"] * s["linear_head_dim"]
    vd = vh * s["linear_head_dim"]
    for i in range(4):
        b = f"blk.{i}."
        if i == 3:  # full attention
            assert got[b + "attn_q.weight"][0] == (n_embd, s["heads"] * s["head_dim"] * 2)
            assert b + "attn_qkv.weight" not in got
            continue
        # Gated DeltaNet: qkv + gate, one ssm_ba {n_embd, 2 x value heads}, no ssm_beta / ssm_alpha
        assert got[b + "attn_qkv.weight"][0] == (n_embd, 2 * kd + vd)
        assert got[b + "attn_gate.weight"][0] == (n_embd, vd)
        assert got[b + "ssm_ba.weight"] == ((n_embd, 2 * vh), T.BF16)
        assert got[b + "ssm_conv1d.weight"] == ((4, 2 * kd + vd), T.F32)
        assert got[b + "ssm_a"][0] == got[b + "ssm_dt.bias"][0] == (vh,)
        assert b + "ssm_beta.weight" not in got and b + "ssm_alpha.weight" not in got
        assert q4[b + "ssm_conv1d.weight"] == T.F32 and q4[b + "ssm_ba.weight"] == T.Q5_0  # rows of 64
    assert got["blk.0.ffn_gate_inp_shexp.weight"] == ((n_embd,), T.F32)


@pytest.mark.parametrize("which", ["mla", "mla_q4", "nxt", "nxt_q4"])
def test_engine_decodes_the_file(which: str, request: pytest.FixtureRequest) -> None:
    path: Path = request.getfixturevalue(which)
    with Engine(path, EngineOptions(dtype="float32", kv_tokens=256, max_running=1, prefill_chunk=16,
                                    executor="torch")) as eng:
        h = eng.submit(list(range(5, 25)), SamplingParams(max_tokens=3, ignore_eos=True), capture_logits=True)
        assert len(h.result(timeout=120)) == 3
        logits = torch.stack([t.float() for t in h.logits])
    assert torch.isfinite(logits).all() and logits.abs().max() > 0
