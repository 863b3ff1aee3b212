"""Qwen3-MoE and Qwen3.5-MoE GGUFs (llama.cpp's format) load as models (engine/weights/gguf_reader.py).

The file is the peer benchmark's own (evals/peer/write_gguf.py, tiny shape, random weights):
- its metadata gives the config the shape was written with;
- every tensor lands in its role: the GGUF bytes of attention, router and expert tensors equal
  the decoder's weights at the matching place (GGUF lists dimensions fastest first);
- an engine on the GGUF gives bit-identical logits to an engine on a Hugging Face checkpoint
  holding the same tensors under their checkpoint names (itself checked against transformers by
  tests/engine/test_lossless.py);
- for the hybrid, each of llama.cpp's conventions is undone (norm multipliers, ssm_a, tiled value
  heads) and the engine runs the file;
- an unsupported architecture, a missing or unreadable file fail with clear errors;
- the file the side-by-side writes (--scales residual) routes random tokens over every expert of
  every layer, where --std everywhere (--scales uniform) collapses the deeper layers' routing.
evals/peer/check_logits.py compares the engine with llama.cpp itself on such files (it needs a
llama.cpp build, so it is not a CI test; its results are in evals/peer/README.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from peer_gguf import write_gguf_module, write_vocab
from safetensors.torch import save_file

from engine.engine import Engine
from engine.errors import ConfigError, WeightError
from engine.model.load import load_decoder
from engine.moe.base import ExpertExecutor
from engine.options import EngineOptions
from engine.sampling import SamplingParams
from engine.weights.gguf_reader import GgufReader

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed (pip install gguf)")

REPO = Path(__file__).resolve().parents[2]
L, E, K, H, INTER, HEADS, KV, HD, VOCAB = 2, 8, 2, 64, 32, 4, 2, 16, 300


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("gguf_model")
    out = tmp / "tiny-qwen3moe.gguf"
    args = ["--out", str(out), "--vocab-from", str(write_vocab(tmp / "vocab.gguf", VOCAB)), "--layers", str(L), "--experts", str(E),
            "--top-k", str(K), "--hidden", str(H), "--inter", str(INTER), "--heads", str(HEADS), "--kv-heads", str(KV),
            "--head-dim", str(HD), "--std", "0.1", "--seed", "4", "--threads", "1"]
    assert write_gguf_module("peer_write_gguf_model").main(args) == 0
    return out


def _raw(path: Path, name: str) -> np.ndarray:
    t = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == name)
    data = np.asarray(t.data)
    if t.tensor_type == gguf.GGMLQuantizationType.BF16:
        return torch.from_numpy(data.view(np.int16).copy()).view(torch.bfloat16).float().numpy()
    return data.astype(np.float32)


def test_config_comes_from_the_metadata(model: Path) -> None:
    cfg = GgufReader(model).config()
    want = {"model_type": "qwen3_moe", "num_hidden_layers": L, "num_experts": E, "num_experts_per_tok": K,
            "hidden_size": H, "moe_intermediate_size": INTER, "num_attention_heads": HEADS, "num_key_value_heads": KV,
            "head_dim": HD, "vocab_size": VOCAB, "norm_topk_prob": True, "torch_dtype": "bfloat16"}
    assert {k: cfg[k] for k in want} == want
    assert cfg["rope_theta"] == 1e6 and cfg["rms_norm_eps"] == pytest.approx(1e-6)


def test_tensors_land_in_their_roles(model: Path) -> None:
    dec = load_decoder(model, "cpu", torch.float32, executor="torch")
    w = dec.weights
    gate_up = w.experts.w13.view(L, E, 2 * INTER, H)
    for layer in range(L):
        gate = _raw(model, f"blk.{layer}.ffn_gate_exps.weight")  # [E, I, H] row-major
        up = _raw(model, f"blk.{layer}.ffn_up_exps.weight")
        down = _raw(model, f"blk.{layer}.ffn_down_exps.weight")  # [E, H, I]
        assert gate.shape == (E, INTER, H) and down.shape == (E, H, INTER)
        np.testing.assert_array_equal(gate_up[layer, :, :INTER].numpy(), gate)
        np.testing.assert_array_equal(gate_up[layer, :, INTER:].numpy(), up)
        np.testing.assert_array_equal(w.experts.w2.view(L, E, H, INTER)[layer].numpy(), down)
        lw = w.layers[layer]
        assert lw.moe is not None and lw.attention is not None
        np.testing.assert_array_equal(lw.moe.router.numpy(), _raw(model, f"blk.{layer}.ffn_gate_inp.weight"))
        np.testing.assert_array_equal(lw.attention.q_proj.numpy(), _raw(model, f"blk.{layer}.attn_q.weight"))
        np.testing.assert_array_equal(lw.attention.o_proj.numpy(), _raw(model, f"blk.{layer}.attn_output.weight"))
    np.testing.assert_array_equal(w.embed.numpy(), _raw(model, "token_embd.weight"))


def test_engine_on_gguf_equals_engine_on_the_same_checkpoint(model: Path, tmp_path: Path) -> None:
    reader = GgufReader(model)
    ckpt = tmp_path / "hf"
    ckpt.mkdir()
    tensors = {}
    for name in reader.names():
        t = reader.get(name).contiguous()
        if name.endswith("mlp.experts.gate_proj") or name.endswith("mlp.experts.up_proj") \
                or name.endswith("mlp.experts.down_proj"):
            prefix, kind = name.rsplit(".", 1)
            for e in range(E):  # the per-expert layout of Hugging Face checkpoints
                tensors[f"{prefix}.{e}.{kind}.weight"] = t[e].clone()
        else:
            tensors[name] = t
    save_file(tensors, str(ckpt / "model.safetensors"))
    config = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": VOCAB,
              "hidden_size": H, "intermediate_size": 4 * H, "num_hidden_layers": L, "num_attention_heads": HEADS,
              "num_key_value_heads": KV, "head_dim": HD, "num_experts": E, "num_experts_per_tok": K,
              "moe_intermediate_size": INTER, "norm_topk_prob": True, "rope_theta": 1e6, "rms_norm_eps": 1e-6,
              "max_position_embeddings": 40960, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
              "decoder_sparse_step": 1, "mlp_only_layers": []}
    (ckpt / "config.json").write_text(json.dumps(config))
    prompt = list(range(5, 40))
    runs = []
    for path in (model, ckpt):
        with Engine(path, EngineOptions(dtype="float32", kv_tokens=256, max_running=1, prefill_chunk=16,
                                        executor="torch")) as eng:
            h = eng.submit(prompt, SamplingParams(max_tokens=6, ignore_eos=True), capture_logits=True)
            tokens = h.result(timeout=120)
            runs.append((tokens, torch.stack([t.float() for t in h.logits])))
    assert runs[0][0] == runs[1][0]
    assert torch.equal(runs[0][1], runs[1][1])
    assert runs[0][1].abs().max() > 0  # the logits carry signal: the comparison can fail


def test_unsupported_and_missing_files_fail_clearly(model: Path, tmp_path: Path) -> None:
    other = tmp_path / "other.gguf"
    w = gguf.GGUFWriter(str(other), "llama")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConfigError, match="GGUF architecture 'llama' is not supported"):
        load_decoder(other)
    with pytest.raises(ConfigError, match="not found"):
        load_decoder(tmp_path / "absent.gguf")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all")
    with pytest.raises(WeightError, match="not a readable GGUF file"):
        load_decoder(junk)
    cut = tmp_path / "cut.gguf"  # a copy interrupted halfway
    cut.write_bytes(model.read_bytes()[: model.stat().st_size // 2])
    with pytest.raises(WeightError, match="not a readable GGUF file"):
        load_decoder(cut)


def test_bench_runs_on_the_gguf(model: Path, capsys: pytest.CaptureFixture[str], monkeypatch, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from freetoken_agent.cli import main

    monkeypatch.setenv("FREETOKEN_CACHE_DIR", str(tmp_path))
    assert main(["bench", "decode", "--model", str(model), "--device", "cpu", "--tokens", "4", "--reps", "1",
                 "--prompt-tokens", "8", "--cpu-threads", "1", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["weights"] == f"checkpoint {model}" and r["family"] == "qwen3_moe" and r["layers"] == L
    assert r["experts"] == E and r["tok_s"] > 0


def test_a_gguf_whose_tokenizer_cannot_be_read_is_refused_with_the_reason(model: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    from freetoken_agent.cli import main

    # the stand-in vocabulary's merges ("t 1") name tokens it does not hold
    assert main(["generate", "--model", str(model), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert f"{model}: its tokenizer metadata cannot be read by the tokenizers library" in err
    assert "Traceback" not in err


HYBRID = ["--arch", "qwen35moe", "--layers", "4", "--experts", "8", "--top-k", "2", "--hidden", "64", "--inter", "32",
          "--shared-inter", "24", "--heads", "4", "--kv-heads", "2", "--head-dim", "64", "--linear-key-heads", "2",
          "--linear-value-heads", "4", "--linear-head-dim", "16"]


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("gguf_hybrid")
    out = tmp / "tiny-qwen35moe.gguf"
    args = ["--out", str(out), "--vocab-from", str(write_vocab(tmp / "vocab.gguf", VOCAB)), *HYBRID, "--std", "0.1",
            "--seed", "2", "--threads", "1"]
    assert write_gguf_module("peer_write_gguf_hybrid").main(args) == 0
    return out


def test_hybrid_gguf_undoes_llama_cpp_conventions(hybrid: Path) -> None:
    """qwen35moe: norms stored as multipliers (checkpoint: 1 + w), ssm_a = -exp(A_log), value heads
    in tiled order (checkpoint: grouped). Whether the result computes llama.cpp's function is
    evals/peer/check_logits.py's job (it needs a llama.cpp build); here, each conversion."""
    reader = GgufReader(hybrid)
    cfg = reader.config()
    assert cfg["model_type"] == "qwen3_5_moe_text" and cfg["linear_num_key_heads"] == 2
    assert cfg["linear_num_value_heads"] == 4 and cfg["linear_value_head_dim"] == 16
    assert cfg["partial_rotary_factor"] == 0.25 and cfg["shared_expert_intermediate_size"] == 24
    lin = "model.layers.0.linear_attn."
    assert torch.equal(reader.get("model.layers.0.input_layernorm.weight"), torch.zeros(H))  # 1.0 stored
    assert torch.equal(reader.get(lin + "norm.weight"), torch.ones(16))  # the gated norm is a plain one
    assert torch.equal(reader.get(lin + "A_log"), torch.zeros(4))  # ssm_a = -1
    # value head j (grouped: key head j // 2) is GGUF head (j % 2) * 2 + j // 2 (tiled: key head h % 2)
    z = torch.from_numpy(_raw(hybrid, "blk.0.attn_gate.weight")).view(4, 16, H)
    assert torch.equal(reader.get(lin + "in_proj_z.weight").float().view(4, 16, H), z[[0, 2, 1, 3]])
    a = torch.from_numpy(_raw(hybrid, "blk.0.ssm_alpha.weight"))
    assert torch.equal(reader.get(lin + "in_proj_a.weight").float(), a[[0, 2, 1, 3]])
    conv = reader.get(lin + "conv1d.weight")
    raw_conv = torch.from_numpy(_raw(hybrid, "blk.0.ssm_conv1d.weight"))
    key_dim = 2 * 2 * 16
    assert conv.shape == (key_dim + 64, 1, 4) and torch.equal(conv[:key_dim, 0], raw_conv[:key_dim])
    assert torch.equal(conv[key_dim:, 0].view(4, 16, 4), raw_conv[key_dim:].view(4, 16, 4)[[0, 2, 1, 3]])
    out = torch.from_numpy(_raw(hybrid, "blk.0.ssm_out.weight")).view(H, 4, 16)
    assert torch.equal(reader.get(lin + "out_proj.weight").float().view(H, 4, 16), out[:, [0, 2, 1, 3]])


def test_engine_runs_the_hybrid_gguf(hybrid: Path) -> None:
    with Engine(hybrid, EngineOptions(dtype="float32", kv_tokens=256, max_running=1, prefill_chunk=16,
                                      executor="torch")) as eng:
        h = eng.submit(list(range(5, 30)), SamplingParams(max_tokens=4, ignore_eos=True), capture_logits=True)
        assert len(h.result(timeout=120)) == 4
        logits = torch.stack([t.float() for t in h.logits])
    assert torch.isfinite(logits).all() and logits.abs().max() > 0


def test_a_type_without_a_format_is_refused_with_its_name(tmp_path: Path) -> None:
    path = tmp_path / "tq.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    for key, value in (("embedding_length", 32), ("block_count", 1), ("attention.head_count", 2),
                       ("attention.head_count_kv", 1), ("expert_count", 2), ("expert_used_count", 1),
                       ("expert_feed_forward_length", 32), ("context_length", 64)):
        w.add_uint32(f"qwen3moe.{key}", value)
    w.add_float32("qwen3moe.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    tq = gguf.quants.quantize(np.ones((2, 32, 256), dtype=np.float32), gguf.GGMLQuantizationType.TQ2_0)
    w.add_tensor("blk.0.ffn_gate_exps.weight", tq, raw_shape=tq.shape, raw_dtype=gguf.GGMLQuantizationType.TQ2_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(WeightError, match=r"tq\.gguf: tensor 'blk\.0\.ffn_gate_exps\.weight' is TQ2_0; supported: F32, F16, BF16, Q8_0"):
        load_decoder(path)


def _routing_spread(path: Path, tokens: int) -> list[tuple[int, float]]:
    """Per MoE layer, over one prefill of random tokens: (distinct experts routed, the most common
    top-1 expert's share of the tokens)."""
    seen: dict[int, list[torch.Tensor]] = {}
    with Engine(path, EngineOptions(device="cpu", dtype="bfloat16", kv_tokens=512, max_running=1,
                                    prefill_chunk=tokens)) as eng:
        inner = eng.decoder.executor

        class Record(ExpertExecutor):
            def __call__(self, x, ids, weights, moe_index):  # type: ignore[no-untyped-def]
                seen.setdefault(moe_index, []).append(ids.clone())
                return inner(x, ids, weights, moe_index)

        eng.decoder.executor = Record()
        prompt = torch.randint(0, 1999, (tokens,), generator=torch.Generator().manual_seed(1)).tolist()
        eng.submit(prompt, SamplingParams(max_tokens=1, ignore_eos=True)).result(timeout=300)
    out = []
    for layer in sorted(seen):
        ids = torch.cat(seen[layer])
        out.append((int(ids.unique().numel()), torch.bincount(ids[:, 0]).max().item() / ids.shape[0]))
    return out


def test_the_peer_gguf_routes_like_a_cache_test(tmp_path: Path) -> None:
    """The side-by-side GGUF (write_gguf.py, default --scales residual) routes random tokens over
    every expert of every layer, as the engine's own random weights do; with --std everywhere
    (--scales uniform, the files before the fifth H200 session) the deeper layers send most tokens to
    a few experts, which an expert cache hits almost always (98 % on the H200)."""
    vocab = write_vocab(tmp_path / "vocab.gguf", 2000)
    spreads = {}
    for scales in ("residual", "uniform"):
        out = tmp_path / f"{scales}.gguf"
        args = ["--out", str(out), "--vocab-from", str(vocab), "--layers", "8", "--experts", "64", "--top-k", "8",
                "--hidden", "256", "--inter", "64", "--heads", "4", "--kv-heads", "2", "--head-dim", "64",
                "--seed", "0", "--threads", "2", "--scales", scales]
        assert write_gguf_module("peer_write_gguf_scales").main(args) == 0
        spreads[scales] = _routing_spread(out, 64)
    assert all(distinct >= 60 and top1 <= 0.2 for distinct, top1 in spreads["residual"]), spreads["residual"]
    deep = spreads["uniform"][-2:]
    assert all(distinct <= 40 and top1 >= 0.4 for distinct, top1 in deep), spreads["uniform"]
