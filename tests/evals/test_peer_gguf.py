"""evals/peer/write_gguf.py: the random qwen3moe GGUF it writes for the llama.cpp peer.

CPU only, no llama.cpp: a tiny shape is written and read back with the `gguf` package (tensor names,
shapes, dtypes, hyperparameters, the copied tokenizer), and the bytes depend on the seed alone.
Loading such a file in llama-bench is checked by hand (evals/peer/README.md), not here.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from peer_gguf import N_VOCAB, field, shape_args

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed (pip install gguf)")

REPO = Path(__file__).resolve().parents[2]
SHAPE = {"layers": 2, "experts": 8, "top_k": 2, "hidden": 64, "inter": 32, "heads": 4, "kv_heads": 2, "head_dim": 16}



def _write(wg: ModuleType, vocab: Path, out: Path, *extra: str) -> Path:
    assert wg.main(["--out", str(out), "--vocab-from", str(vocab), *shape_args(SHAPE), *extra]) == 0
    return out


@pytest.fixture(scope="module")
def written(wg: ModuleType, vocab: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write(wg, vocab, tmp_path_factory.mktemp("gguf") / "tiny.gguf", "--seed", "0", "--threads", "2")


def test_hparams(written: Path) -> None:
    r = gguf.GGUFReader(str(written))
    assert field(r, "general.architecture") == "qwen3moe"
    assert field(r, "general.file_type") == 32  # MOSTLY_BF16
    want = {
        "block_count": SHAPE["layers"],
        "embedding_length": SHAPE["hidden"],
        "expert_count": SHAPE["experts"],
        "expert_used_count": SHAPE["top_k"],
        "expert_feed_forward_length": SHAPE["inter"],
        "attention.head_count": SHAPE["heads"],
        "attention.head_count_kv": SHAPE["kv_heads"],
        "attention.key_length": SHAPE["head_dim"],
        "attention.value_length": SHAPE["head_dim"],
        "rope.dimension_count": SHAPE["head_dim"],
        "context_length": 40960,
    }
    for key, value in want.items():
        assert field(r, f"qwen3moe.{key}") == value, key
    assert field(r, "qwen3moe.rope.freq_base") == pytest.approx(1e6)
    assert field(r, "qwen3moe.attention.layer_norm_rms_epsilon") == pytest.approx(1e-6)


def test_tokenizer_copied(written: Path, vocab: Path) -> None:
    r, v = gguf.GGUFReader(str(written)), gguf.GGUFReader(str(vocab))
    keys = {k for k in v.fields if k.startswith("tokenizer.")}
    assert keys and keys <= set(r.fields)
    for k in keys:
        assert field(r, k) == field(v, k), k


def test_tensors(written: Path) -> None:
    r = gguf.GGUFReader(str(written))
    s = SHAPE
    q, kv, e, h, i = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"], s["experts"], s["hidden"], s["inter"]
    bf16, f32 = gguf.GGMLQuantizationType.BF16, gguf.GGMLQuantizationType.F32
    want: dict[str, tuple[tuple[int, ...], Any]] = {
        "token_embd.weight": ((N_VOCAB, h), bf16),
        "output.weight": ((N_VOCAB, h), bf16),
        "output_norm.weight": ((h,), f32),
    }
    for b in range(s["layers"]):
        p = f"blk.{b}."
        want |= {
            p + "attn_norm.weight": ((h,), f32),
            p + "attn_q.weight": ((q, h), bf16),
            p + "attn_k.weight": ((kv, h), bf16),
            p + "attn_v.weight": ((kv, h), bf16),
            p + "attn_output.weight": ((h, q), bf16),
            p + "attn_q_norm.weight": ((s["head_dim"],), f32),
            p + "attn_k_norm.weight": ((s["head_dim"],), f32),
            p + "ffn_norm.weight": ((h,), f32),
            p + "ffn_gate_inp.weight": ((e, h), f32),
            p + "ffn_gate_exps.weight": ((e, i, h), bf16),
            p + "ffn_up_exps.weight": ((e, i, h), bf16),
            p + "ffn_down_exps.weight": ((e, h, i), bf16),
        }
    got = {t.name: t for t in r.tensors}
    assert set(got) == set(want)
    for name, (shape, dtype) in want.items():
        t = got[name]
        # the reader gives ggml's ne order: the reverse of the row-major shape
        assert tuple(int(x) for x in reversed(t.shape)) == shape, name
        assert t.tensor_type == dtype, name
        assert int(t.n_elements) == int(np.prod(shape)), name
        if "norm" in name:
            assert np.all(np.asarray(t.data, dtype=np.float32) == 1.0), name


def test_random_values(wg: ModuleType, vocab: Path, written: Path, tmp_path: Path) -> None:
    """--scales residual (default): --std, except the embedding (1.0) and the residual-stream writers
    (--std / sqrt(2 x layers)), as the engine's random weights; --scales uniform: --std everywhere."""
    r = gguf.GGUFReader(str(written))
    residual = 0.02 / (2 * SHAPE["layers"]) ** 0.5
    for name, want in (("blk.1.ffn_down_exps.weight", residual), ("blk.0.attn_output.weight", residual),
                       ("blk.1.ffn_gate_exps.weight", 0.02), ("blk.0.attn_q.weight", 0.02), ("token_embd.weight", 1.0)):
        assert 0.8 * want < _bf16_std(r, name) < 1.2 * want, name
    uniform = gguf.GGUFReader(str(_write(wg, vocab, tmp_path / "u.gguf", "--scales", "uniform")))
    for name in ("blk.1.ffn_down_exps.weight", "token_embd.weight", "blk.0.attn_q.weight"):
        assert 0.016 < _bf16_std(uniform, name) < 0.024, name
    router = next(t for t in r.tensors if t.name == "blk.0.ffn_gate_inp.weight")
    assert 0.01 < float(np.asarray(router.data, dtype=np.float32).std()) < 0.03


def test_deterministic_per_seed(wg: ModuleType, vocab: Path, written: Path, tmp_path: Path,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    same = _write(wg, vocab, tmp_path / "same.gguf", "--seed", "0", "--threads", "1")
    assert same.read_bytes() == written.read_bytes()
    other = _write(wg, vocab, tmp_path / "other.gguf", "--seed", "1", "--threads", "2")
    assert other.stat().st_size == written.stat().st_size
    assert other.read_bytes() != written.read_bytes()
    # many chunks per tensor: still independent of the number of threads
    monkeypatch.setattr(wg, "CHUNK", 1000)
    a = _write(wg, vocab, tmp_path / "a.gguf", "--seed", "3", "--threads", "1")
    b = _write(wg, vocab, tmp_path / "b.gguf", "--seed", "3", "--threads", "3")
    assert a.read_bytes() == b.read_bytes()


def test_f16_and_plan(wg: ModuleType, vocab: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f16 = _write(wg, vocab, tmp_path / "f16.gguf", "--dtype", "f16")
    r = gguf.GGUFReader(str(f16))
    assert r.fields["general.file_type"].contents() == 1
    t = next(t for t in r.tensors if t.name == "blk.0.ffn_up_exps.weight")
    assert t.tensor_type == gguf.GGMLQuantizationType.F16
    assert 0.015 < float(np.asarray(t.data, dtype=np.float32).std()) < 0.025
    plan = tmp_path / "plan.gguf"
    _write(wg, vocab, plan, "--plan")
    assert not plan.exists()
    assert "blk.1.ffn_down_exps.weight" in capsys.readouterr().out


def test_reuse_and_force(wg: ModuleType, vocab: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = _write(wg, vocab, tmp_path / "r.gguf", "--seed", "5")
    assert (tmp_path / "r.gguf.args.json").is_file() and not (tmp_path / "r.gguf.part").exists()
    first = out.read_bytes()
    marked = bytearray(first)
    marked[len(marked) // 2] ^= 0xFF  # a marker inside the data: a reused file keeps it
    out.write_bytes(bytes(marked))
    capsys.readouterr()
    _write(wg, vocab, out, "--seed", "5")
    assert "already holds these weights" in capsys.readouterr().out
    assert out.read_bytes() == bytes(marked)
    _write(wg, vocab, out, "--seed", "5", "--force")
    assert out.read_bytes() == first
    _write(wg, vocab, out, "--seed", "6")
    assert out.read_bytes() != first


def _bf16_std(reader, name: str) -> float:  # type: ignore[no-untyped-def]
    t = next(t for t in reader.tensors if t.name == name)
    bits = np.frombuffer(np.ascontiguousarray(t.data).tobytes(), dtype=np.uint16).astype(np.uint32) << 16
    vals = bits.view(np.float32)
    assert np.all(np.isfinite(vals)), name
    return float(vals.std())
