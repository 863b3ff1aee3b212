"""Broken checkpoints fail with one-line `EngineError`s that name what is wrong; the radix cache
behaves as its contract says.

Loader part: a sharded index pointing at a removed shard, truncated files, a tensor listed in the
index but absent, missing tensors (dense, per-expert, fused), tensors of the wrong shape, an
unknown `model_type`, missing config fields (also inside the vision-language `text_config`), a
missing or malformed config.json: each raises the right `EngineError` subclass, at load time,
with a single-line message naming the file, tensor or field.

Radix part (`engine/cache/radix.py`, with fake free callbacks): match / insert / split, lock and
unlock across splits, LRU eviction that never touches locked nodes or their ancestors, snapshot
ownership (attach / displace / evict_state), and `need_state` matching only at snapshot positions.
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

from engine.cache.radix import RadixCache
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


# ================================================================================== radix cache
class Freed:
    """Fake pool callbacks recording what the cache hands back."""

    def __init__(self) -> None:
        self.kv: list[int] = []
        self.states: list[int] = []

    def free_kv(self, slots: torch.Tensor) -> None:
        self.kv.extend(slots.tolist())

    def free_state(self, slot: int) -> None:
        self.states.append(slot)


def _cache() -> tuple[RadixCache, Freed]:
    freed = Freed()
    return RadixCache(freed.free_kv, freed.free_state), freed


def _slots(*ids: int) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.long)


def _edges(cache: RadixCache) -> dict[tuple[int, ...], list[int]]:
    """Every node as (path tokens) -> its edge's slots."""
    out = {}
    stack = [(cache.root, ())]
    while stack:
        node, path = stack.pop()
        for child in node.children.values():
            p = path + tuple(child.key)
            out[p] = child.value.tolist()
            stack.append((child, p))
    return out


def test_radix_empty_match() -> None:
    cache, _ = _cache()
    m = cache.match([1, 2, 3], 3, need_state=False)
    assert m.length == 0 and m.node is cache.root and m.slots.numel() == 0 and m.state_slot == -1


def test_radix_insert_and_match() -> None:
    cache, freed = _cache()
    node, existing = cache.insert([1, 2, 3, 4], _slots(10, 11, 12, 13))
    assert existing == 0 and node.depth == 4 and cache.cached_tokens == 4
    m = cache.match([1, 2, 3, 4, 5], 5, need_state=False)
    assert m.length == 4 and m.node is node and m.slots.tolist() == [10, 11, 12, 13]
    # limit caps the match even when more is cached
    m = cache.match([1, 2, 3, 4], 3, need_state=False)
    assert m.length == 3 and m.slots.tolist() == [10, 11, 12]
    # a diverging token stops it
    m = cache.match([1, 2, 9, 4], 4, need_state=False)
    assert m.length == 2 and m.slots.tolist() == [10, 11]
    assert cache.match([7, 1, 2], 3, need_state=False).length == 0
    assert freed.kv == [] and cache.cached_tokens == 4


def test_radix_split_and_shared_prefix() -> None:
    cache, _ = _cache()
    cache.insert([1, 2, 3, 4], _slots(10, 11, 12, 13))
    m = cache.match([1, 2, 7], 3, need_state=False)  # splits [1,2,3,4] at 2
    assert m.length == 2 and m.node.key == [1, 2] and m.node.depth == 2
    assert _edges(cache) == {(1, 2): [10, 11], (1, 2, 3, 4): [12, 13]}
    node, existing = cache.insert([1, 2, 5, 6], _slots(90, 91, 20, 21))
    assert existing == 2 and node.depth == 4 and node.value.tolist() == [20, 21]
    assert cache.cached_tokens == 6
    assert _edges(cache) == {(1, 2): [10, 11], (1, 2, 3, 4): [12, 13], (1, 2, 5, 6): [20, 21]}
    # inserting a prefix of a cached path splits it and adds nothing
    node, existing = cache.insert([1, 2, 3], _slots(90, 91, 92))
    assert existing == 3 and node.depth == 3 and cache.cached_tokens == 6
    assert cache.match([1, 2, 3, 4], 4, need_state=False).slots.tolist() == [10, 11, 12, 13]
    assert cache.match([1, 2, 5, 6, 0], 5, need_state=False).slots.tolist() == [10, 11, 20, 21]


def test_radix_lock_survives_split() -> None:
    cache, _ = _cache()
    leaf, _ = cache.insert([1, 2, 3, 4], _slots(10, 11, 12, 13))
    cache.lock(leaf)
    cache.match([1, 2, 9], 3, need_state=False)  # splits the locked edge
    upper = leaf.parent
    assert upper is not None and upper is not cache.root and upper.lock == 1
    cache.unlock(leaf)
    assert leaf.lock == 0 and upper.lock == 0 and cache.root.lock == 1


def test_radix_evict_is_lru() -> None:
    cache, freed = _cache()
    cache.insert([1, 2, 3], _slots(10, 11, 12))
    cache.insert([4, 5], _slots(20, 21))
    cache.insert([6, 7, 8, 9], _slots(30, 31, 32, 33))
    cache.match([1, 2, 3], 3, need_state=False)  # [1,2,3] is now the most recent
    assert cache.evict(1) == 2
    assert freed.kv == [20, 21]
    assert cache.evict(1) == 4
    assert freed.kv == [20, 21, 30, 31, 32, 33]
    assert cache.cached_tokens == 3
    assert cache.match([1, 2, 3], 3, need_state=False).length == 3


def test_radix_evict_walks_up_to_emptied_parents() -> None:
    cache, freed = _cache()
    cache.insert([1, 2, 3], _slots(10, 11, 12))
    cache.insert([1, 2, 4], _slots(10, 11, 22))
    assert cache.cached_tokens == 4
    assert cache.evict(4) == 4
    assert sorted(freed.kv) == [10, 11, 12, 22]
    assert cache.cached_tokens == 0 and not cache.root.children


def test_radix_locked_nodes_and_ancestors_never_evicted() -> None:
    cache, freed = _cache()
    cache.insert([1, 2, 3], _slots(10, 11, 12))
    cache.insert([1, 2, 4], _slots(10, 11, 22))
    cache.insert([5, 6], _slots(50, 51))
    m = cache.match([1, 2, 3], 3, need_state=False)
    cache.lock(m.node)
    assert cache.evict(100) == 3  # [1,2,4]'s leaf and [5,6]
    assert sorted(freed.kv) == [22, 50, 51]
    assert cache.evict(100) == 0
    assert cache.match([1, 2, 3], 3, need_state=False).slots.tolist() == [10, 11, 12]
    cache.unlock(m.node)
    assert cache.evict(100) == 3
    assert sorted(freed.kv) == [10, 11, 12, 22, 50, 51]
    assert cache.cached_tokens == 0


def test_radix_need_state_matches_only_at_snapshots() -> None:
    cache, freed = _cache()
    node, _ = cache.insert([1, 2, 3, 4], _slots(10, 11, 12, 13))
    # no snapshot anywhere: nothing reusable for a recurrent model, everything for attention
    assert cache.match([1, 2, 3, 4, 5], 5, need_state=True).length == 0
    assert cache.attach_state(node, 7) == -1
    assert cache.num_snapshots == 1
    m = cache.match([1, 2, 3, 4, 5], 5, need_state=True)
    assert (m.length, m.state_slot, m.slots.tolist()) == (4, 7, [10, 11, 12, 13])
    # the limit stops before the snapshot, or the tokens diverge before it: nothing
    assert cache.match([1, 2, 3, 4, 5], 3, need_state=True).length == 0
    assert cache.match([1, 2, 3, 9, 5], 5, need_state=True).length == 0
    # a longer path with a snapshot only at its end
    node6, existing = cache.insert([1, 2, 3, 4, 5, 6], _slots(10, 11, 12, 13, 14, 15))
    assert existing == 4
    m = cache.match([1, 2, 3, 4, 5, 6, 0], 7, need_state=True)
    assert (m.length, m.state_slot) == (4, 7)  # falls back to the snapshot at 4
    cache.attach_state(node6, 8)
    m = cache.match([1, 2, 3, 4, 5, 6, 0], 7, need_state=True)
    assert (m.length, m.state_slot) == (6, 8)
    m = cache.match([1, 2, 3, 4, 5, 6], 5, need_state=True)
    assert (m.length, m.state_slot) == (4, 7)
    # splitting an edge keeps its snapshot at the edge's end, never at the cut
    cache.match([1, 2, 9], 3, need_state=False)
    m = cache.match([1, 2, 3, 4, 0], 5, need_state=True)
    assert (m.length, m.state_slot) == (4, 7)
    assert cache.match([1, 2, 0], 3, need_state=True).length == 0
    assert freed.states == []


def test_radix_attach_state_displaces() -> None:
    cache, _ = _cache()
    node, _ = cache.insert([1, 2], _slots(10, 11))
    assert cache.attach_state(node, 3) == -1
    assert cache.attach_state(node, 4) == 3
    assert cache.num_snapshots == 1
    assert cache.match([1, 2, 0], 3, need_state=True).state_slot == 4


def test_radix_evict_state_lru_and_locks() -> None:
    cache, freed = _cache()
    a, _ = cache.insert([1, 2], _slots(10, 11))
    b, _ = cache.insert([3, 4], _slots(30, 31))
    c, _ = cache.insert([5, 6], _slots(50, 51))
    for node, slot in ((a, 1), (b, 2), (c, 3)):
        cache.attach_state(node, slot)
    cache.match([1, 2, 0], 3, need_state=True)  # a is now the most recent; b the least
    cache.lock(b)
    assert cache.evict_state() is True
    assert freed.states == [3]  # c: least recent among the unlocked
    assert cache.evict_state() is True
    assert freed.states == [3, 1]
    assert cache.evict_state() is False  # only b's, locked
    assert cache.num_snapshots == 1 and freed.kv == []
    assert cache.match([3, 4, 0], 3, need_state=True).state_slot == 2
    cache.unlock(b)
    assert cache.evict_state() is True and freed.states == [3, 1, 2]
    assert cache.num_snapshots == 0
    assert cache.match([3, 4, 0], 3, need_state=True).length == 0
    assert cache.match([3, 4, 0], 3, need_state=False).length == 2  # KV stays


def test_radix_evicting_a_leaf_frees_its_snapshot() -> None:
    cache, freed = _cache()
    node, _ = cache.insert([1, 2, 3], _slots(10, 11, 12))
    cache.attach_state(node, 5)
    assert cache.evict(1) == 3
    assert freed.kv == [10, 11, 12] and freed.states == [5] and cache.num_snapshots == 0


def test_radix_reset_frees_everything() -> None:
    cache, freed = _cache()
    node, _ = cache.insert([1, 2, 3], _slots(10, 11, 12))
    cache.insert([1, 2, 4], _slots(10, 11, 22))
    cache.attach_state(node, 6)
    cache.reset()
    assert sorted(freed.kv) == [10, 11, 12, 22] and freed.states == [6]
    assert cache.cached_tokens == 0 and cache.num_snapshots == 0
    assert cache.match([1, 2, 3], 3, need_state=False).length == 0
