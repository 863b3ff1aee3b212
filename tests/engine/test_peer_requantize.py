"""evals/peer/requantize.sh with llama.cpp's real llama-quantize (a CPU build of the peer's commit).

Marked `peer`: it runs `.peer-cpu/build/bin/llama-quantize`, which `evals/peer/fetch_source.sh` builds
from the packed tree (its verify step); the README's test command deselects `peer` (CI has no
llama.cpp build), and a selected test without that binary fails saying how to build it. Checked, on tiny qwen3moe shapes: requantize.sh
writes a Q8_0 source with write_gguf.py, requantizes it to Q4_K_M with `--allow-requantize`, deletes
the source and records both commands in OUT.args.json; every tensor's type in the result equals the
one `write_gguf.py --quant q4_k_m` writes directly for the same shape (our transcription of
llama_tensor_get_type against llama-quantize itself: rows of 256 with 4 experts, and the 8-expert /
fallback shape); and our engine's prefill logits on the requantized file are finite and equal
transformers' GGUF loader's (which dequantizes every tensor with gguf.quants) within 1e-4.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from checkpoints import hf_prefill_logits, rel_err
from peer_gguf import N_VOCAB, shape_args
from test_gguf_quant import _engine_logits

from engine.model.load import load_decoder

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed (pip install gguf)")

pytestmark = pytest.mark.peer
REPO = Path(__file__).resolve().parents[2]
QUANTIZE = REPO / ".peer-cpu" / "build" / "bin" / "llama-quantize"
TOL = 1e-4
SHAPES = {
    # rows of 256: every type reachable without fallbacks; 4 experts
    "rows256": {"layers": 6, "experts": 4, "top_k": 2, "hidden": 256, "inter": 256, "heads": 2, "kv_heads": 1,
                "head_dim": 128},
    # exactly 8 experts (attn_v / attn_k Q8_0, attn_output Q5_K) and rows of 64 / 32 / 48 (fallbacks)
    "fallbacks": {"layers": 2, "experts": 8, "top_k": 2, "hidden": 64, "inter": 32, "heads": 2, "kv_heads": 1,
                  "head_dim": 24},
}


@pytest.fixture(scope="module")
def quantize() -> Path:
    if not os.access(QUANTIZE, os.X_OK):
        pytest.fail(f"{QUANTIZE} not built (bash evals/peer/fetch_source.sh builds it; `-m 'not peer'` deselects these)")
    return QUANTIZE



def _requantize(quantize: Path, vocab: Path, out: Path, shape: dict[str, int]) -> list[str]:
    args = ["--vocab-from", str(vocab), *shape_args(shape), "--seed", "0", "--threads", "1"]
    cmd = ["bash", str(REPO / "evals/peer/requantize.sh"), "--out", str(out), "--type", "Q4_K_M", "--threads", "1",
           "--quantize", str(quantize), "--", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=os.environ | {"PYTHON": sys.executable})
    assert done.returncode == 0, done.stderr[-2000:]
    return args


@pytest.fixture(scope="module")
def requantized(quantize: Path, vocab: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for name, shape in SHAPES.items():
        path = tmp_path_factory.mktemp(name) / "rq.gguf"
        _requantize(quantize, vocab, path, shape)
        out[name] = path
    return out


def _types(path: Path) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}


def test_source_deleted_and_commands_recorded(requantized: dict[str, Path], quantize: Path) -> None:
    path = requantized["rows256"]
    assert sorted(p.name for p in path.parent.iterdir()) == ["rq.gguf", "rq.gguf.args.json", "rq.gguf.quantize.log"]
    rec = json.loads(path.with_name("rq.gguf.args.json").read_text())
    assert rec["command"] == [str(quantize), "--allow-requantize", f"{path}.q8_0.gguf", str(path), "Q4_K_M", "1"]
    assert rec["write_gguf"][2:6] == ["--quant", "q8_0", "--out", f"{path}.q8_0.gguf"]
    assert rec["source_args"]["quant"] == "q8_0" and rec["source_args"]["layers"] == 6
    assert gguf.GGUFReader(str(path)).fields["general.file_type"].contents() == 15  # LLAMA_FTYPE_MOSTLY_Q4_K_M


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_types_equal_write_gguf_q4_k_m(name: str, requantized: dict[str, Path], wg: ModuleType, vocab: Path,
                                       tmp_path: Path) -> None:
    ours = tmp_path / "ours.gguf"
    assert wg.main(["--out", str(ours), "--vocab-from", str(vocab), *shape_args(SHAPES[name]), "--quant", "q4_k_m",
                    "--threads", "1"]) == 0
    theirs, mine = _types(requantized[name]), _types(ours)
    assert set(theirs) == set(mine)
    diff = {k: (mine[k], theirs[k]) for k in mine if mine[k] != theirs[k]}
    assert not diff, f"write_gguf --quant q4_k_m vs llama-quantize (ours, theirs): {diff}"
    want = {"Q4_K", "Q6_K"} if name == "rows256" else {"Q8_0", "Q5_0"}  # the second: 8 experts, fallbacks
    assert want <= set(theirs.values())


def test_engine_logits_equal_dequantized_reference(requantized: dict[str, Path]) -> None:
    import transformers as tf

    path = requantized["rows256"]
    assert {"Q4_K", "Q6_K"} <= set(_types(path).values())
    # transformers' GGUF config map has no key for expert_feed_forward_length: given here
    ref_model = tf.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                        moe_intermediate_size=SHAPES["rows256"]["inter"]).eval()
    ids = torch.randint(0, N_VOCAB, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    ref = hf_prefill_logits(ref_model, ids)
    got = _engine_logits(load_decoder(path, "cpu", torch.float32, executor="torch"), ids)
    assert torch.isfinite(got).all() and got.abs().max() > 0
    assert rel_err(got, ref) <= TOL, f"prefill logits differ by {rel_err(got, ref):.2e}"
