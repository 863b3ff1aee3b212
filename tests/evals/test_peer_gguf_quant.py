"""evals/peer/write_gguf.py --quant q8_0 / q4_k_m: the quantized random GGUFs for the llama.cpp peer.

CPU only, no llama.cpp build. The expected tensor types are written out here by hand from
`llama_tensor_get_type` in src/llama-quant.cpp of the peer's commit (0c1e57098), not computed with
the writer's own rule: LLAMA_FTYPE_MOSTLY_Q4_K_M gives Q4_K by default, Q6_K to output.weight and to
attn_v / attn_qkv (one counter over them) and every ffn_down* on the layers
use_more_bits(i, n) = i < n/8 || i >= 7n/8 || (i - n/8) % 3 == 2 picks; with exactly 8 experts attn_v
and attn_k become Q8_0 and attn_output Q5_K; rows that are not whole blocks fall back (Q4_K -> Q5_0,
Q5_K -> Q5_1, Q6_K -> Q8_0, output -> Q8_0, F16 when 32 does not divide the row); norms, routers,
ssm_conv1d and 1-D tensors keep the source's float32. Each tensor, dequantized by gguf.quants, is
finite with mean ~0 and the std the bf16 file's tensor has; the engine loads both quantized files
and decodes finite logits.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch
from peer_gguf import N_VOCAB, field, shape_args

from engine.engine import Engine
from engine.options import EngineOptions
from engine.sampling import SamplingParams

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed (pip install gguf)")
T = gguf.GGMLQuantizationType
STD = 0.02
# rows of 256: every type is reachable without fallbacks; 4 experts (not 8)
QWEN3 = {"layers": 6, "experts": 4, "top_k": 2, "hidden": 256, "inter": 256, "heads": 2, "kv_heads": 1, "head_dim": 128}
MORE_BITS_6 = {2, 5}  # use_more_bits(i, 6): 6/8 = 0, 7*6/8 = 5
QWEN35 = {"layers": 8, "experts": 4, "top_k": 2, "hidden": 256, "inter": 256, "shared_inter": 256, "heads": 2,
          "kv_heads": 1, "head_dim": 128, "linear_key_heads": 2, "linear_value_heads": 4, "linear_head_dim": 64}
MORE_BITS_8 = {0, 3, 6, 7}  # 8/8 = 1, 7*8/8 = 7: i < 1, i >= 7, (i - 1) % 3 == 2
# 48 layers (Qwen3-30B-A3B): i < 6, i >= 42, (i - 6) % 3 == 2
MORE_BITS_48 = {0, 1, 2, 3, 4, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35, 38, 41, 42, 43, 44, 45, 46, 47}



def _write(wg: ModuleType, vocab: Path, out: Path, shape: dict[str, int], *extra: str) -> Path:
    assert wg.main(["--out", str(out), "--vocab-from", str(vocab), *shape_args(shape), *extra]) == 0
    return out


@pytest.fixture(scope="module")
def q4km(wg: ModuleType, vocab: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write(wg, vocab, tmp_path_factory.mktemp("q") / "q4km.gguf", QWEN3, "--quant", "q4_k_m", "--threads", "2")


@pytest.fixture(scope="module")
def q8(wg: ModuleType, vocab: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write(wg, vocab, tmp_path_factory.mktemp("q") / "q8.gguf", QWEN3, "--quant", "q8_0", "--threads", "2")


def _types(path: Path) -> dict[str, Any]:
    return {t.name: T(t.tensor_type) for t in gguf.GGUFReader(str(path)).tensors}


def _qwen3_expected(more_bits: set[int], layers: int, default: Any, six: Any) -> dict[str, Any]:
    want = {"token_embd.weight": default, "output.weight": six, "output_norm.weight": T.F32}
    for i in range(layers):
        p, extra = f"blk.{i}.", six if i in more_bits else default
        want |= {p + n: T.F32 for n in ("attn_norm", "attn_q_norm", "attn_k_norm", "ffn_norm", "ffn_gate_inp")}
        want |= {p + n: default for n in ("attn_q", "attn_k", "attn_output", "ffn_gate_exps", "ffn_up_exps")}
        want |= {p + "attn_v": extra, p + "ffn_down_exps": extra}
    return {k if k.endswith(".weight") else k + ".weight": v for k, v in want.items()}


def test_q4_k_m_types_are_llama_quantize_s(q4km: Path) -> None:
    r = gguf.GGUFReader(str(q4km))
    assert field(r, "general.file_type") == 15  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    assert _types(q4km) == _qwen3_expected(MORE_BITS_6, 6, T.Q4_K, T.Q6_K)


def test_q8_0_types(q8: Path) -> None:
    assert field(gguf.GGUFReader(str(q8)), "general.file_type") == 7  # LLAMA_FTYPE_MOSTLY_Q8_0
    assert _types(q8) == _qwen3_expected(set(), 6, T.Q8_0, T.Q8_0)


def test_qwen35moe_q4_k_m_types(wg: ModuleType, vocab: Path, tmp_path: Path) -> None:
    out = _write(wg, vocab, tmp_path / "q35.gguf", QWEN35, "--arch", "qwen35moe", "--quant", "q4_k_m", "--plan")
    assert not out.exists()
    s = wg.parse_args(["--out", str(out), "--arch", "qwen35moe", "--quant", "q4_k_m", *shape_args(QWEN35)])
    shape = wg.Shape(8, 4, 2, 256, 256, 2, 1, 128, N_VOCAB, 256, 4, 2, 4, 64, 4)
    got = {n: T(q) for n, q in wg.quant_types(wg.qwen35moe_tensor_specs(shape), s).items()}
    for i in range(8):
        p, extra = f"blk.{i}.", T.Q6_K if i in MORE_BITS_8 else T.Q4_K
        full = i % 4 == 3
        mixed = {"attn_v" if full else "attn_qkv": extra, "ffn_down_exps": extra, "ffn_down_shexp": extra}
        plain = ("attn_q", "attn_k", "attn_output") if full else ("attn_gate", "ssm_beta", "ssm_alpha", "ssm_out")
        floats = ("attn_q_norm", "attn_k_norm") if full else ("ssm_conv1d", "ssm_norm")
        for n, t in {**mixed, **{n: T.Q4_K for n in (*plain, "ffn_gate_exps", "ffn_up_exps", "ffn_gate_shexp",
                                                     "ffn_up_shexp")},
                     **{n: T.F32 for n in (*floats, "attn_norm", "post_attention_norm", "ffn_gate_inp",
                                           "ffn_gate_inp_shexp")}}.items():
            assert got[p + n + ".weight"] == t, p + n
        if not full:
            assert got[p + "ssm_a"] == T.F32 and got[p + "ssm_dt.bias"] == T.F32
    assert got["output.weight"] == T.Q6_K and got["token_embd.weight"] == T.Q4_K


def test_use_more_bits_on_48_layers(wg: ModuleType) -> None:
    specs = wg.tensor_specs(wg.Shape(48, 128, 8, 256, 256, 2, 1, 128, N_VOCAB))
    args = wg.parse_args(["--out", "x", "--quant", "q4_k_m", "--layers", "48", "--experts", "128"])
    got = wg.quant_types(specs, args)
    for i in range(48):
        want = T.Q6_K if i in MORE_BITS_48 else T.Q4_K
        assert got[f"blk.{i}.attn_v.weight"] == want == got[f"blk.{i}.ffn_down_exps.weight"], i


def test_fallbacks_and_eight_experts(wg: ModuleType, vocab: Path, tmp_path: Path) -> None:
    """Rows of 64 / 32 / 48 (hidden 64, inter 32, 2 heads of 24) and exactly 8 experts."""
    shape = {"layers": 2, "experts": 8, "top_k": 2, "hidden": 64, "inter": 32, "heads": 2, "kv_heads": 1, "head_dim": 24}
    got = _types(_write(wg, vocab, tmp_path / "fb.gguf", shape, "--quant", "q4_k_m"))
    assert got["output.weight"] == T.Q8_0  # 64 % 256: Q8_0, not Q6_K
    assert got["token_embd.weight"] == T.Q5_0  # Q4_K -> Q5_0
    for i in range(2):  # use_more_bits(i, 2): 2/8 = 0, 7*2/8 = 1: layer 1
        p = f"blk.{i}."
        assert got[p + "attn_v.weight"] == got[p + "attn_k.weight"] == T.Q8_0  # 8 experts
        assert got[p + "attn_output.weight"] == T.F16  # Q5_K (8 experts) -> Q5_1 -> 48 % 32: F16
        assert got[p + "attn_q.weight"] == got[p + "ffn_gate_exps.weight"] == T.Q5_0
        assert got[p + "ffn_down_exps.weight"] == (T.Q8_0 if i == 1 else T.Q5_0)  # Q6_K -> Q8_0


def _target(name: str, layers: int) -> float:
    if name == "token_embd.weight":
        return 1.0
    if any(k in name for k in ("attn_output", "ffn_down", "ssm_out")):
        return STD / (2 * layers) ** 0.5
    return STD


@pytest.mark.parametrize("which", ["q4km", "q8"])
def test_values_have_the_bf16_files_spread(which: str, request: pytest.FixtureRequest) -> None:
    path: Path = request.getfixturevalue(which)
    for t in gguf.GGUFReader(str(path)).tensors:
        if t.tensor_type == T.F32:
            continue
        v = gguf.quants.dequantize(np.asarray(t.data), T(t.tensor_type)).astype(np.float64)
        want = _target(t.name, QWEN3["layers"])
        assert np.isfinite(v).all(), t.name
        assert v.size == int(t.n_elements), t.name
        assert abs(v.std() / want - 1) < 0.15, (t.name, v.std(), want)
        assert abs(v.mean()) < 0.05 * want, (t.name, v.mean(), want)


def test_deterministic_and_thread_independent(wg: ModuleType, vocab: Path, q4km: Path, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    same = _write(wg, vocab, tmp_path / "same.gguf", QWEN3, "--quant", "q4_k_m", "--threads", "1")
    assert same.read_bytes() == q4km.read_bytes()
    other = _write(wg, vocab, tmp_path / "other.gguf", QWEN3, "--quant", "q4_k_m", "--seed", "1")
    assert other.stat().st_size == q4km.stat().st_size and other.read_bytes() != q4km.read_bytes()
    monkeypatch.setattr(wg, "QCHUNK", 7)  # many chunks per tensor
    a = _write(wg, vocab, tmp_path / "a.gguf", QWEN3, "--quant", "q4_k_m", "--threads", "1")
    b = _write(wg, vocab, tmp_path / "b.gguf", QWEN3, "--quant", "q4_k_m", "--threads", "3")
    assert a.read_bytes() == b.read_bytes()


def test_dtype_is_only_for_bf16(wg: ModuleType) -> None:
    with pytest.raises(SystemExit):
        wg.parse_args(["--out", "x", "--quant", "q8_0", "--dtype", "f16"])


@pytest.fixture(scope="module")
def q4km35(wg: ModuleType, vocab: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("q") / "q4km35.gguf"
    return _write(wg, vocab, out, QWEN35, "--arch", "qwen35moe", "--quant", "q4_k_m", "--threads", "2")


@pytest.mark.parametrize("which", ["q4km", "q8", "q4km35"])
def test_engine_decodes_the_quantized_file(which: str, request: pytest.FixtureRequest) -> None:
    path: Path = request.getfixturevalue(which)
    with Engine(path, EngineOptions(dtype="float32", kv_tokens=256, max_running=1, prefill_chunk=16,
                                    executor="torch")) as eng:
        h = eng.submit(list(range(5, 25)), SamplingParams(max_tokens=3, ignore_eos=True), capture_logits=True)
        assert len(h.result(timeout=120)) == 3
        logits = torch.stack([t.float() for t in h.logits])
    assert torch.isfinite(logits).all() and logits.abs().max() > 0
