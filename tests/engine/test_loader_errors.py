"""Broken checkpoints fail with one-line `EngineError`s that name what is wrong: a sharded index
pointing at a removed shard, truncated files, a tensor listed in the index but absent, missing
tensors (dense, per-expert, fused), tensors of the wrong shape, an unknown `model_type`, missing
config fields (also inside the vision-language `text_config`), a missing or malformed config.json:
each raises the right `EngineError` subclass, at load time, with a single-line message naming the
file, tensor or field. (The radix cache's tests: tests/engine/test_radix_cache.py.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from checkpoints import (
    LIN,
    TinySpec,
    copy_checkpoint,
    edit_config,
    load_tensors,
    qwen3_5_moe_text,
    qwen3_moe_text,
    shard,
    weight_files,
    write_tensors,
)

from engine.engine import Engine
from engine.errors import ConfigError, EngineError, WeightError
from engine.model.load import load_decoder

Q3 = TinySpec("err_q3", "qwen3_moe", qwen3_moe_text(num_hidden_layers=2), seed=11)
Q3_FUSED = TinySpec("err_q3_fused", "qwen3_moe", qwen3_moe_text(num_hidden_layers=2), layout="fused", seed=12)
VL = TinySpec("err_vl", "qwen3_5_moe", qwen3_5_moe_text(num_hidden_layers=2, layer_types=[LIN, "full_attention"]),
              vl=True, seed=13)


def _load_error(path: Path, kind: type[EngineError]) -> str:
    """Loads `path` expecting `kind`; returns the message after checking it is one line."""
    with pytest.raises(kind) as info:
        load_decoder(path)
    msg = str(info.value)
    assert msg and "\n" not in msg, f"message is not one line: {msg!r}"
    return msg


@pytest.fixture
def q3(tiny_checkpoint, tmp_path: Path) -> Path:  # type: ignore[no-untyped-def]
    return copy_checkpoint(tiny_checkpoint(Q3)[0], tmp_path / "q3")


def test_intact_checkpoint_loads(q3: Path) -> None:
    dec = load_decoder(q3)
    assert dec.cfg.family == "qwen3_moe" and dec.cfg.num_layers == 2


def test_dense_weights_own_aligned_memory(q3: Path) -> None:
    """Tensors are read from the file in place when no conversion is needed; those that sit at an
    offset the file chose are copied to 64-byte-aligned memory (CPU BLAS orders its sums by the
    pointer's alignment: the same weights must give the same logits from any file)."""
    dec = load_decoder(q3, dtype=torch.float32)
    w = dec.weights
    dense = {"embed": w.embed, "lm_head": w.lm_head, "final_norm": w.final_norm}
    for i, lw in enumerate(w.layers):
        dense[f"{i}.input_norm"] = lw.input_norm
        assert lw.moe is not None and lw.attention is not None
        dense[f"{i}.router"] = lw.moe.router
        dense |= {f"{i}.{k}": v for k, v in vars(lw.attention).items() if isinstance(v, torch.Tensor)}
    unaligned = {k: t.data_ptr() % 64 for k, t in dense.items() if t.data_ptr() % 64}
    assert unaligned == {}


# ------------------------------------------------------------------------------------------ files
def test_sharded_index_pointing_to_missing_shard(q3: Path) -> None:
    files = shard(q3, 3)
    files[1].unlink()
    msg = _load_error(q3, WeightError)
    assert files[1].name in msg


def test_sharded_checkpoint_without_index_entry_file(q3: Path) -> None:
    """The index lists a tensor that no shard holds."""
    shard(q3, 2)
    index = q3 / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"]["model.layers.0.self_attn.ghost.weight"] = "model-00001-of-00002.safetensors"
    index.write_text(json.dumps(data))
    msg = _load_error(q3, WeightError)
    assert "model.layers.0.self_attn.ghost.weight" in msg


def test_malformed_index(q3: Path) -> None:
    shard(q3, 2)
    (q3 / "model.safetensors.index.json").write_text("{not json")
    msg = _load_error(q3, WeightError)
    assert "model.safetensors.index.json" in msg


@pytest.mark.parametrize("keep", ["half", "header_only", "4_bytes", "empty"])
def test_truncated_file(q3: Path, keep: str) -> None:
    path = q3 / "model.safetensors"
    data = path.read_bytes()
    hlen = int.from_bytes(data[:8], "little")
    cut = {"half": len(data) // 2, "header_only": 8 + hlen, "4_bytes": 4, "empty": 0}[keep]
    path.write_bytes(data[:cut])
    msg = _load_error(q3, WeightError)
    assert str(path) in msg


def test_truncated_shard(q3: Path) -> None:
    files = shard(q3, 3)
    files[2].write_bytes(files[2].read_bytes()[:-9])
    msg = _load_error(q3, WeightError)
    assert files[2].name in msg


def test_no_weights_at_all(q3: Path) -> None:
    for f in weight_files(q3):
        f.unlink()
    msg = _load_error(q3, WeightError)
    assert str(q3) in msg


def test_model_dir_missing(tmp_path: Path) -> None:
    msg = _load_error(tmp_path / "nowhere", ConfigError)
    assert "nowhere" in msg


# ------------------------------------------------------------------------------------------ tensors
@pytest.mark.parametrize("name", [
    "model.layers.1.self_attn.k_proj.weight",
    "model.layers.0.mlp.experts.2.up_proj.weight",
    "model.layers.1.mlp.gate.weight",
    "model.norm.weight",
    "lm_head.weight",
])
def test_missing_tensor(q3: Path, name: str) -> None:
    tensors = load_tensors(q3)
    del tensors[name]
    write_tensors(q3, tensors)
    msg = _load_error(q3, WeightError)
    assert name in msg


@pytest.mark.parametrize("name", [
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.1.mlp.experts.0.down_proj.weight",
    "model.embed_tokens.weight",
])
def test_wrong_shape(q3: Path, name: str) -> None:
    tensors = load_tensors(q3)
    t = tensors[name]
    tensors[name] = torch.zeros(t.shape[0] + 1, *t.shape[1:])
    write_tensors(q3, tensors)
    msg = _load_error(q3, WeightError)
    assert name in msg and "model.safetensors" in msg
    assert str(list(t.shape)) in msg  # the expected shape


def test_wrong_shape_in_a_shard_names_that_shard(q3: Path) -> None:
    name = "model.layers.1.self_attn.o_proj.weight"
    tensors = load_tensors(q3)
    tensors[name] = torch.zeros(3, 5)
    write_tensors(q3, tensors)
    files = shard(q3, 3)
    owner = json.loads((q3 / "model.safetensors.index.json").read_text())["weight_map"][name]
    assert owner in {f.name for f in files}
    msg = _load_error(q3, WeightError)
    assert name in msg and owner in msg


@pytest.mark.parametrize("which", ["gate_up_proj", "down_proj"])
def test_fused_experts_wrong_shape_or_missing(tiny_checkpoint, tmp_path: Path, which: str) -> None:  # type: ignore[no-untyped-def]
    path = copy_checkpoint(tiny_checkpoint(Q3_FUSED)[0], tmp_path / "fused")
    name = f"model.layers.1.mlp.experts.{which}"
    tensors = load_tensors(path)
    assert name in tensors
    tensors[name] = tensors[name][:-1].clone()  # one expert short
    write_tensors(path, tensors)
    msg = _load_error(path, WeightError)
    assert name in msg
    del tensors[name]
    write_tensors(path, tensors)
    msg = _load_error(path, WeightError)
    assert "missing" in msg and "model.layers.1.mlp.experts." in msg  # names what the loader looked for


def test_engine_surfaces_weight_error(q3: Path) -> None:
    (q3 / "model.safetensors").write_bytes(b"\x10")
    with pytest.raises(WeightError):
        Engine(q3)


# ------------------------------------------------------------------------------------------ config
def test_unknown_model_type(q3: Path) -> None:
    edit_config(q3, lambda c: c.update(model_type="llama"))
    msg = _load_error(q3, ConfigError)
    assert "model_type" in msg and "llama" in msg


@pytest.mark.parametrize("field", ["hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                                   "moe_intermediate_size", "num_experts_per_tok"])
def test_missing_config_field(q3: Path, field: str) -> None:
    edit_config(q3, lambda c: c.pop(field))
    msg = _load_error(q3, ConfigError)
    assert repr(field) in msg and "config.json" in msg


@pytest.mark.parametrize("field", ["linear_num_key_heads", "linear_value_head_dim", "hidden_size"])
def test_missing_field_in_text_config(tiny_checkpoint, tmp_path: Path, field: str) -> None:  # type: ignore[no-untyped-def]
    path = copy_checkpoint(tiny_checkpoint(VL)[0], tmp_path / "vl")
    load_decoder(path)  # intact: loads
    edit_config(path, lambda c: c["text_config"].pop(field))
    msg = _load_error(path, ConfigError)
    assert repr(field) in msg


def test_missing_and_malformed_config_json(q3: Path) -> None:
    cfg = q3 / "config.json"
    cfg.write_text("{")
    assert "config.json" in _load_error(q3, ConfigError)
    cfg.unlink()
    assert "config.json" in _load_error(q3, ConfigError)


def test_layer_types_default_by_interval_and_are_checked() -> None:
    from engine.config import FULL_ATTENTION, LINEAR_ATTENTION, ModelConfig

    raw = {"model_type": "qwen3_5_moe_text", **qwen3_5_moe_text(num_hidden_layers=8, full_attention_interval=4)}
    del raw["layer_types"]
    assert ModelConfig.from_dict(raw).layer_types == ((LINEAR_ATTENTION,) * 3 + (FULL_ATTENTION,)) * 2
    with pytest.raises(ConfigError, match=r"config\.json: layer_types has 3 entries for 8 layers"):
        ModelConfig.from_dict({**raw, "layer_types": [LIN, LIN, FULL_ATTENTION]})
    with pytest.raises(ConfigError, match=r"config\.json: unknown layer type 'sliding_attention' in layer_types"):
        ModelConfig.from_dict({**raw, "layer_types": [LIN] * 7 + ["sliding_attention"]})
