"""evals/gpu/cap_plan.py: the tensor table read from a GGUF header equals the gguf package's, and the
caps / -ncmoe it pairs keep the full model's resident share of experts on a file with fewer layers."""

from __future__ import annotations

from pathlib import Path

import pytest
from peer_gguf import shape_args, write_gguf_module, write_vocab

from evals.gpu import cap_plan

gguf = pytest.importorskip("gguf")
GIB = 2**30


def test_table_and_sizes_equal_the_gguf_reader(tmp_path: Path) -> None:
    out = tmp_path / "g.gguf"
    shape = dict(layers=4, experts=4, top_k=2, hidden=64, inter=64, heads=4, kv_heads=2, head_dim=16)
    write_gguf_module().main(["--arch", "gpt-oss", "--out", str(out), *shape_args(shape), "--threads", "1",
                              "--vocab-from", str(write_vocab(tmp_path / "v.gguf", 96))])
    reader = gguf.GGUFReader(str(out))
    assert cap_plan.tensor_table(out) == [(t.name, int(t.n_bytes)) for t in reader.tensors]
    sizes = cap_plan.file_sizes(out)
    by_name = {t.name: int(t.n_bytes) for t in reader.tensors}
    assert sizes["layers"] == 4
    assert sizes["expert_bytes"][2] == sum(n for k, n in by_name.items() if k.startswith("blk.2.ffn_") and "_exps." in k)
    dense = sum(n for k, n in by_name.items() if "_exps." not in k and k != "token_embd.weight")
    assert sizes["dense_outside"] + 4 * sizes["dense_per_layer"] == dense
    assert sizes["dense_outside"] == by_name["output.weight"] + by_name["output_norm.weight"]


def test_plan_keeps_the_full_models_share() -> None:
    sizes = {"layers": 24, "expert_bytes": [GIB] * 24, "dense_outside": GIB // 2, "dense_per_layer": GIB / 32}
    full = cap_plan.plan(sizes, 12 * GIB, 36, 1.5 * GIB)
    # the full model: 12 - 1.5 - 0.5 - 36/32 = 8.875 layers of 36 resident
    assert full["share"] == pytest.approx(8.875 / 36)
    assert full["peer_gpu_layers"] == round(8.875 / 36 * 24) == 6 and full["ncmoe"] == 18
    assert full["ours_gib"] == pytest.approx(12 - 12 * (1 / 32 + 8.875 / 36), abs=0.01)
    same = cap_plan.plan({**sizes, "layers": 36, "expert_bytes": [GIB] * 36}, 12 * GIB, 36, 1.5 * GIB)
    assert same["ours_gib"] == 12.0 and same["ncmoe"] == 36 - 9
    none = cap_plan.plan(sizes, 2 * GIB, 36, 1.5 * GIB)  # a card smaller than the dense part: no expert fits
    assert none["share"] == 0.0 and none["ncmoe"] == 24
    assert cap_plan.parse_size("12GiB") == 12 * GIB and cap_plan.parse_size("512MiB") == GIB / 2
