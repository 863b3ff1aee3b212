"""evals/peer/write_gguf.py --arch qwen35moe: the random Qwen3.5/3.6-MoE (Gated DeltaNet hybrid) GGUF.

CPU only, no llama.cpp build: a tiny shape is written and read back with the `gguf` package. The
expected keys, tensor names and shapes below are transcribed from the loader of the peer's llama.cpp
commit (llama_model_base::load_hparams in src/llama-model.cpp and load_arch_hparams /
load_arch_tensors in src/models/qwen35moe.cpp), in ggml's ne order as the loader writes them, so a
missing, extra or misshapen tensor or a missing required key fails here as it would fail to load.
Loading the file in llama-bench is checked by hand (evals/peer/README.md).
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from peer_gguf import N_VOCAB, field, shape_args

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed (pip install gguf)")

REPO = Path(__file__).resolve().parents[2]
# 8 layers: two full-attention (3, 7) and six Gated DeltaNet layers; kv heads != q heads, value
# heads = 2 x key heads, partial rotary (16 of 64 dims) as in Qwen3.6-35B-A3B, only smaller.
SHAPE = {"layers": 8, "experts": 8, "top_k": 2, "hidden": 64, "inter": 32, "shared_inter": 24, "heads": 4,
         "kv_heads": 2, "head_dim": 64, "linear_key_heads": 2, "linear_value_heads": 4, "linear_head_dim": 16}
ARCH = "qwen35moe"



def _args(vocab: Path, out: Path, shape: dict[str, int] = SHAPE) -> list[str]:
    return ["--arch", ARCH, "--out", str(out), "--vocab-from", str(vocab), *shape_args(shape)]


def _write(wg: ModuleType, vocab: Path, out: Path, *extra: str) -> Path:
    assert wg.main([*_args(vocab, out), *extra]) == 0
    return out


@pytest.fixture(scope="module")
def written(wg: ModuleType, vocab: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write(wg, vocab, tmp_path_factory.mktemp("gguf") / "tiny35.gguf", "--seed", "0", "--threads", "2")


def test_hparams(written: Path) -> None:
    r = gguf.GGUFReader(str(written))
    s = SHAPE
    assert field(r, "general.architecture") == ARCH
    assert field(r, "general.file_type") == 32  # MOSTLY_BF16
    uint32 = {
        # required by load_hparams / load_arch_hparams
        "context_length": 262144,
        "embedding_length": s["hidden"],
        "block_count": s["layers"],
        "ssm.conv_kernel": 4,
        "ssm.inner_size": s["linear_value_heads"] * s["linear_head_dim"],  # d_inner: head_v_dim = d_inner / dt_rank
        "ssm.state_size": s["linear_head_dim"],  # head_k_dim = head_v_dim
        "ssm.time_step_rank": s["linear_value_heads"],  # value heads
        "ssm.group_count": s["linear_key_heads"],  # key heads
        # optional, but the shape depends on them
        "expert_count": s["experts"],
        "expert_used_count": s["top_k"],
        "expert_feed_forward_length": s["inter"],
        "expert_shared_feed_forward_length": s["shared_inter"],
        "full_attention_interval": 4,
        "attention.head_count": s["heads"],
        "attention.head_count_kv": s["kv_heads"],
        "attention.key_length": s["head_dim"],
        "attention.value_length": s["head_dim"],
        "rope.dimension_count": s["head_dim"] // 4,  # partial rotary 0.25
    }
    for key, value in uint32.items():
        kv = r.fields[f"{ARCH}.{key}"]
        assert kv.types == [gguf.GGUFValueType.UINT32], key  # get_key<uint32_t> wants exactly UINT32
        assert kv.contents() == value, key
    sections = r.fields[f"{ARCH}.rope.dimension_sections"]  # required, 4 int32 (get_key_or_arr(..., 4, true))
    assert sections.types == [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32]
    assert sections.contents() == [3, 3, 2, 0]  # 8 rotary pairs split as Qwen3.5's [11, 11, 10] splits 32
    assert r.fields[f"{ARCH}.attention.layer_norm_rms_epsilon"].types == [gguf.GGUFValueType.FLOAT32]
    assert field(r, f"{ARCH}.attention.layer_norm_rms_epsilon") == pytest.approx(1e-6)
    assert field(r, f"{ARCH}.rope.freq_base") == pytest.approx(1e7)
    # nothing the loader would read differently: no recurrent-layer array, no MTP layers
    assert f"{ARCH}.attention.recurrent_layers" not in r.fields
    assert f"{ARCH}.nextn_predict_layers" not in r.fields
    assert "tokenizer.ggml.tokens" in r.fields


def _loader_tensors(s: dict[str, int]) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (ne, kind) as load_arch_tensors of src/models/qwen35moe.cpp creates them."""
    n_embd, n_vocab = s["hidden"], N_VOCAB
    n_embd_head_k, n_head, n_head_kv = s["head_dim"], s["heads"], s["kv_heads"]
    n_embd_k_gqa = n_embd_v_gqa = n_embd_head_k * n_head_kv
    head_k_dim = head_v_dim = s["linear_head_dim"]  # ssm_d_state
    n_k_heads, n_v_heads = s["linear_key_heads"], s["linear_value_heads"]  # ssm_n_group, ssm_dt_rank
    key_dim, value_dim = head_k_dim * n_k_heads, head_v_dim * n_v_heads
    conv_dim = key_dim * 2 + value_dim
    n_ff_exp, n_ff_shexp, n_expert, d_conv = s["inter"], s["shared_inter"], s["experts"], 4
    want = {
        "token_embd.weight": ((n_embd, n_vocab), "bf16"),
        "output_norm.weight": ((n_embd,), "ones"),
        "output.weight": ((n_embd, n_vocab), "bf16"),
    }
    for il in range(s["layers"]):
        b = f"blk.{il}."
        want |= {
            b + "attn_norm.weight": ((n_embd,), "ones"),
            b + "post_attention_norm.weight": ((n_embd,), "ones"),
        }
        if (il + 1) % 4 == 0:  # !hparams.is_recr(il): full attention
            want |= {
                b + "attn_q.weight": ((n_embd, n_embd_head_k * n_head * 2), "bf16"),  # query + gate
                b + "attn_k.weight": ((n_embd, n_embd_k_gqa), "bf16"),
                b + "attn_v.weight": ((n_embd, n_embd_v_gqa), "bf16"),
                b + "attn_output.weight": ((n_embd_head_k * n_head, n_embd), "bf16"),
                b + "attn_q_norm.weight": ((n_embd_head_k,), "ones"),
                b + "attn_k_norm.weight": ((n_embd_head_k,), "ones"),
            }
        else:  # Gated DeltaNet
            want |= {
                b + "attn_qkv.weight": ((n_embd, key_dim * 2 + value_dim), "bf16"),
                b + "attn_gate.weight": ((n_embd, value_dim), "bf16"),
                b + "ssm_conv1d.weight": ((d_conv, conv_dim), "f32"),  # ggml_ssm_conv wants f32
                b + "ssm_dt.bias": ((n_v_heads,), "zeros"),
                b + "ssm_a": ((n_v_heads,), "minus_ones"),
                b + "ssm_beta.weight": ((n_embd, n_v_heads), "bf16"),
                b + "ssm_alpha.weight": ((n_embd, n_v_heads), "bf16"),
                b + "ssm_norm.weight": ((head_v_dim,), "ones"),
                b + "ssm_out.weight": ((value_dim, n_embd), "bf16"),
            }
        want |= {
            b + "ffn_gate_inp.weight": ((n_embd, n_expert), "f32"),
            b + "ffn_down_exps.weight": ((n_ff_exp, n_embd, n_expert), "bf16"),
            b + "ffn_gate_exps.weight": ((n_embd, n_ff_exp, n_expert), "bf16"),
            b + "ffn_up_exps.weight": ((n_embd, n_ff_exp, n_expert), "bf16"),
            b + "ffn_gate_inp_shexp.weight": ((n_embd,), "f32"),
            b + "ffn_gate_shexp.weight": ((n_embd, n_ff_shexp), "bf16"),
            b + "ffn_up_shexp.weight": ((n_embd, n_ff_shexp), "bf16"),
            b + "ffn_down_shexp.weight": ((n_ff_shexp, n_embd), "bf16"),
        }
    return want


def test_tensors_as_the_loader_wants(written: Path) -> None:
    r = gguf.GGUFReader(str(written))
    want = _loader_tensors(SHAPE)
    got = {t.name: t for t in r.tensors}
    assert sorted(set(want) - set(got)) == []  # missing: "missing tensor" at load
    assert sorted(set(got) - set(want)) == []  # extra: "wrong number of tensors" at load
    bf16, f32 = gguf.GGMLQuantizationType.BF16, gguf.GGMLQuantizationType.F32
    fill = {"ones": 1.0, "zeros": 0.0, "minus_ones": -1.0}
    for name, (ne, kind) in want.items():
        t = got[name]
        assert tuple(int(x) for x in t.shape) == ne, name  # the reader gives ggml's ne order, as the loader checks
        assert t.tensor_type == (bf16 if kind == "bf16" else f32), name
        if kind in fill:
            assert np.all(np.asarray(t.data, dtype=np.float32) == fill[kind]), name
        elif kind == "f32":
            vals = np.asarray(t.data, dtype=np.float32)
            assert np.all(np.isfinite(vals)) and 0.0 < float(vals.std()) < 0.05, name
    # the 3:1 pattern: Gated DeltaNet layers 0-2 and 4-6, full attention 3 and 7
    assert [i for i in range(SHAPE["layers"]) if f"blk.{i}.attn_q.weight" in got] == [3, 7]
    assert [i for i in range(SHAPE["layers"]) if f"blk.{i}.ssm_a" in got] == [0, 1, 2, 4, 5, 6]


def test_random_values(written: Path) -> None:
    r = gguf.GGUFReader(str(written))
    residual = 0.02 / (2 * SHAPE["layers"]) ** 0.5  # --scales residual: the residual-stream writers
    for name, want in (("blk.2.ffn_down_exps.weight", residual), ("blk.2.ssm_out.weight", residual),
                       ("blk.3.attn_output.weight", residual), ("blk.2.ffn_down_shexp.weight", residual),
                       ("blk.2.ffn_up_exps.weight", 0.02), ("blk.2.attn_qkv.weight", 0.02), ("token_embd.weight", 1.0)):
        t = next(t for t in r.tensors if t.name == name)
        bits = np.frombuffer(np.ascontiguousarray(t.data).tobytes(), dtype=np.uint16).astype(np.uint32) << 16
        vals = bits.view(np.float32)
        assert np.all(np.isfinite(vals)) and 0.8 * want < float(vals.std()) < 1.2 * want, name


def test_deterministic(wg: ModuleType, vocab: Path, written: Path, tmp_path: Path) -> None:
    same = _write(wg, vocab, tmp_path / "same.gguf", "--seed", "0", "--threads", "1")
    assert same.read_bytes() == written.read_bytes()
    other = _write(wg, vocab, tmp_path / "other.gguf", "--seed", "1", "--threads", "2")
    assert other.stat().st_size == written.stat().st_size
    assert other.read_bytes() != written.read_bytes()


def test_layers_must_be_a_multiple_of_the_interval(wg: ModuleType, vocab: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bad.gguf"
    with pytest.raises(SystemExit) as exc:
        wg.main(_args(vocab, out, SHAPE | {"layers": 6}))
    assert exc.value.code == 2
    assert "not a multiple of --full-attn-interval 4" in capsys.readouterr().err
    assert not out.exists()
    # the other architecture's options are refused instead of silently ignored
    with pytest.raises(SystemExit):
        wg.main(["--out", str(out), "--vocab-from", str(vocab), "--shared-inter", "8"])
    with pytest.raises(SystemExit):
        wg.main([*_args(vocab, out), "--ff", "8"])
    assert "--ff: not an option of --arch qwen35moe" in capsys.readouterr().err


def test_defaults_and_plan(wg: ModuleType, vocab: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = wg.parse_args(["--arch", ARCH, "--out", "x"])
    assert (a.layers, a.experts, a.top_k, a.hidden, a.inter, a.shared_inter) == (20, 256, 8, 2048, 512, 512)
    assert (a.heads, a.kv_heads, a.head_dim, a.rope_dim, a.rope_sections) == (16, 2, 256, 64, [11, 11, 10, 0])
    assert (a.linear_key_heads, a.linear_value_heads, a.linear_head_dim, a.conv_kernel) == (16, 32, 128, 4)
    assert (a.full_attn_interval, a.rope_base, a.ctx) == (4, 1e7, 262144)
    q3 = wg.parse_args(["--out", "x"])  # the default architecture keeps its old defaults and stamp
    assert q3.arch == "qwen3moe"
    assert (q3.layers, q3.experts, q3.inter, q3.heads, q3.kv_heads, q3.head_dim, q3.ff) == (24, 128, 768, 32, 4, 128, 6144)
    assert "arch" not in wg.stamp_of(q3)
    plan = tmp_path / "plan.gguf"
    _write(wg, vocab, plan, "--plan")
    assert not plan.exists()
    out = capsys.readouterr().out
    assert "2 full-attention + 6 Gated DeltaNet layers" in out and "blk.7.ffn_down_shexp.weight" in out
