"""The peer benchmark's gpt-oss GGUF (evals/peer/write_gguf.py --arch gpt-oss) in our engine.

A tiny file of gpt-oss's layout (3 layers sliding / full / sliding, a window of 8, 6 query heads over
2 KV heads, 6 experts top-4, YaRN) as the released MXFP4 files store it: MXFP4 expert banks, Q8_0
attention / embedding / output, F32 router, norms, biases and sinks, general.file_type 38. Checked:
the tensor list, types and keys; the random MXFP4 blocks' spread; our GGUF reader's tensors equal the
gguf package's dequantization (gguf.quants); prefill logits and the engine's greedy decode equal
transformers 5.23's GptOssForCausalLM built from those dequantized tensors (f32, rel. err <= 1e-4);
--max-gib's layer count; and the built o200k_harmony tokenizer keys (201088 tokens, ids, template) encode
as bpe-openai's o200k_base.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from checkpoints import hf_prefill_logits, hf_step_logits, rel_err
from peer_gguf import field, shape_args, write_gguf_module, write_vocab
from test_gpt_oss import decoder_pass, pools

from engine.model.load import load_decoder
from engine.quant.formats import FORMATS
from engine.sampling import SamplingParams
from engine.weights.gguf_reader import GgufReader
from engine.weights.layout import PackedExpertBanks

gguf = pytest.importorskip("gguf")
TOL = 1e-4
VOCAB = 96
SHAPE = dict(layers=3, experts=6, top_k=4, hidden=64, inter=32, heads=6, kv_heads=2, head_dim=16, ctx=64,
             sliding_window=8, yarn_factor=4, yarn_orig_ctx=16)
STD = 0.25  # large enough that attention and the clamped SwiGLU do more than pass the residual through


def _write(tmp: Path, *extra: str, name: str = "tiny-gpt-oss.gguf") -> Path:
    wg = write_gguf_module()
    out = tmp / name
    vocab = [] if "--vocab-from" in extra or "o200k" in name else ["--vocab-from", str(write_vocab(tmp / "v.gguf", VOCAB))]
    wg.main(["--arch", "gpt-oss", "--out", str(out), *shape_args(SHAPE), "--std", str(STD), "--threads", "2",
             *vocab, *extra])
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write(tmp_path_factory.mktemp("gptoss_peer"))


def _tensors(path: Path) -> dict[str, tuple[str, np.ndarray]]:
    """{name: (ggml type name, float32 values in numpy order)} as the gguf package reads them."""
    out = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        kind = gguf.GGMLQuantizationType(t.tensor_type)
        out[t.name] = (kind.name, gguf.quants.dequantize(np.asarray(t.data), kind).astype(np.float32))
    return out


def test_layout_types_and_keys(tiny: Path) -> None:
    r = gguf.GGUFReader(str(tiny))
    a = "gpt-oss"
    assert field(r, "general.architecture") == a and field(r, "general.file_type") == 38
    keys = {"block_count": 3, "embedding_length": 64, "feed_forward_length": 32, "expert_feed_forward_length": 32,
            "attention.head_count": 6, "attention.head_count_kv": 2, "attention.key_length": 16,
            "attention.value_length": 16, "attention.sliding_window": 8, "expert_count": 6, "expert_used_count": 4,
            "rope.scaling.original_context_length": 16, "context_length": 64}
    for key, value in keys.items():
        assert field(r, f"{a}.{key}") == value, key
    assert field(r, f"{a}.rope.scaling.type") == "yarn" and field(r, f"{a}.rope.scaling.factor") == 4.0
    assert field(r, f"{a}.rope.freq_base") == 150000.0 and abs(field(r, f"{a}.attention.layer_norm_rms_epsilon") - 1e-5) < 1e-9
    assert f"{a}.rope.dimension_count" not in r.fields  # the whole head rotates, as in the released files
    types = {t.name: gguf.GGMLQuantizationType(t.tensor_type).name for t in r.tensors}
    per_layer = {"attn_norm.weight": "F32", "post_attention_norm.weight": "F32", "attn_sinks.weight": "F32",
                 **{f"attn_{x}.{w}": "Q8_0" if w == "weight" else "F32" for x in ("q", "k", "v", "output")
                    for w in ("weight", "bias")},
                 "ffn_gate_inp.weight": "F32", "ffn_gate_inp.bias": "F32",
                 **{f"ffn_{x}_exps.{w}": "MXFP4" if w == "weight" else "F32" for x in ("gate", "up", "down")
                    for w in ("weight", "bias")}}
    want = {"token_embd.weight": "Q8_0", "output.weight": "Q8_0", "output_norm.weight": "F32",
            **{f"blk.{i}.{k}": v for i in range(3) for k, v in per_layer.items()}}
    assert types == want  # exactly llama.cpp's openai-moe tensors, no more
    assert {t.name: tuple(int(d) for d in t.shape) for t in r.tensors} == _loader_ne()


def _loader_ne() -> dict[str, tuple[int, ...]]:
    """name -> ne as load_arch_tensors of llama.cpp's src/models/openai-moe.cpp creates them (separate q/k/v
    of n_head x n_rot, their optional biases present as in the released files)."""
    n_embd, n_head, n_kv, n_rot, n_expert, n_ff_exp = 64, 6, 2, 16, 6, 32
    want: dict[str, tuple[int, ...]] = {"token_embd.weight": (n_embd, VOCAB), "output_norm.weight": (n_embd,),
                                        "output.weight": (n_embd, VOCAB)}
    for i in range(3):
        b = f"blk.{i}."
        want |= {b + "attn_norm.weight": (n_embd,), b + "post_attention_norm.weight": (n_embd,),
                 b + "attn_q.weight": (n_embd, n_head * n_rot), b + "attn_k.weight": (n_embd, n_kv * n_rot),
                 b + "attn_v.weight": (n_embd, n_kv * n_rot), b + "attn_q.bias": (n_head * n_rot,),
                 b + "attn_k.bias": (n_kv * n_rot,), b + "attn_v.bias": (n_kv * n_rot,),
                 b + "attn_output.weight": (n_head * n_rot, n_embd), b + "attn_sinks.weight": (n_head,),
                 b + "ffn_gate_inp.weight": (n_embd, n_expert), b + "ffn_gate_exps.weight": (n_embd, n_ff_exp, n_expert),
                 b + "ffn_down_exps.weight": (n_ff_exp, n_embd, n_expert),
                 b + "ffn_up_exps.weight": (n_embd, n_ff_exp, n_expert), b + "attn_output.bias": (n_embd,),
                 b + "ffn_gate_inp.bias": (n_expert,), b + "ffn_gate_exps.bias": (n_ff_exp, n_expert),
                 b + "ffn_down_exps.bias": (n_embd, n_expert), b + "ffn_up_exps.bias": (n_ff_exp, n_expert)}
    return want


def test_mxfp4_blocks_spread_and_threads(tiny: Path, tmp_path: Path) -> None:
    vals = _tensors(tiny)
    for name in ("blk.0.ffn_gate_exps.weight", "blk.2.ffn_down_exps.weight"):
        kind, x = vals[name]
        std = STD if "gate" in name else STD / np.sqrt(2 * 3)  # down writes into the residual stream
        assert kind == "MXFP4" and std / 1.5 < float(x.std()) < std * 1.5 and abs(float(x.mean())) < std / 10
    again = _write(tmp_path, "--threads", "1")
    assert again.read_bytes() == tiny.read_bytes()  # values depend on the seed only


def test_reader_equals_gguf_package(tiny: Path) -> None:
    vals = _tensors(tiny)
    reader = GgufReader(tiny)
    assert reader.get("model.layers.1.self_attn.q_proj.weight").numpy().tolist() == \
        vals["blk.1.attn_q.weight"][1].tolist()
    assert np.array_equal(reader.get("model.embed_tokens.weight").numpy(), vals["token_embd.weight"][1])
    assert np.array_equal(reader.get("model.layers.2.self_attn.sinks").numpy(), vals["blk.2.attn_sinks.weight"][1])
    dec = load_decoder(tiny, dtype=torch.float32, executor="torch")
    banks = dec.weights.experts
    assert isinstance(banks, PackedExpertBanks) and banks.fmt_gu == ["mxfp4"] * 3 == banks.fmt_d
    for li in range(3):
        gate_up = FORMATS["mxfp4"].dequantize(banks.gate_up[li], 64).numpy()
        b = f"blk.{li}."
        assert np.array_equal(gate_up[:, :32], vals[b + "ffn_gate_exps.weight"][1])
        assert np.array_equal(gate_up[:, 32:], vals[b + "ffn_up_exps.weight"][1])
        assert np.array_equal(FORMATS["mxfp4"].dequantize(banks.down[li], 32).numpy(), vals[b + "ffn_down_exps.weight"][1])


def _reference(path: Path) -> Any:
    """transformers' GptOssForCausalLM holding the file's dequantized tensors."""
    from test_gpt_oss import tiny_config
    from transformers import GptOssForCausalLM

    cfg = tiny_config(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_attention_heads=6, head_dim=16,
                      num_local_experts=6, rms_norm_eps=1e-5,
                      rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                       "truncate": False, "original_max_position_embeddings": 16,
                                       "rope_theta": 150000.0})
    model = GptOssForCausalLM(cfg).float().eval()  # type: ignore[arg-type]
    v = {k: torch.from_numpy(x) for k, (_, x) in _tensors(path).items()}
    m = model.model
    with torch.no_grad():
        m.embed_tokens.weight.copy_(v["token_embd.weight"])
        m.norm.weight.copy_(v["output_norm.weight"])
        model.lm_head.weight.copy_(v["output.weight"])
        for i, layer in enumerate(m.layers):
            b, att, ex = f"blk.{i}.", layer.self_attn, layer.mlp.experts
            layer.input_layernorm.weight.copy_(v[b + "attn_norm.weight"])
            layer.post_attention_layernorm.weight.copy_(v[b + "post_attention_norm.weight"])
            for hf, gg in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("o_proj", "attn_output")):
                getattr(att, hf).weight.copy_(v[b + gg + ".weight"])
                getattr(att, hf).bias.copy_(v[b + gg + ".bias"])
            att.sinks.copy_(v[b + "attn_sinks.weight"])
            layer.mlp.router.weight.copy_(v[b + "ffn_gate_inp.weight"])
            layer.mlp.router.bias.copy_(v[b + "ffn_gate_inp.bias"])
            ex.gate_up_proj[..., 0::2] = v[b + "ffn_gate_exps.weight"].transpose(1, 2)
            ex.gate_up_proj[..., 1::2] = v[b + "ffn_up_exps.weight"].transpose(1, 2)
            ex.gate_up_proj_bias[:, 0::2] = v[b + "ffn_gate_exps.bias"]
            ex.gate_up_proj_bias[:, 1::2] = v[b + "ffn_up_exps.bias"]
            ex.down_proj.copy_(v[b + "ffn_down_exps.weight"].transpose(1, 2))
            ex.down_proj_bias.copy_(v[b + "ffn_down_exps.bias"])
    return model


def test_logits_and_greedy_decode_equal_transformers(tiny: Path, make_engine) -> None:  # type: ignore[no-untyped-def]
    model = _reference(tiny)
    ids = torch.randint(0, VOCAB - 1, (20,), generator=torch.Generator().manual_seed(5)).tolist()
    dec = load_decoder(tiny, dtype=torch.float32, executor="torch")
    kv, states = pools(dec.cfg, 64)
    slots = kv.alloc(20)
    assert slots is not None
    ref = hf_prefill_logits(model, ids)
    assert float(ref.std()) > 0.1  # the reference does depend on the weights
    assert rel_err(decoder_pass(dec, kv, states, [(ids, 0, slots)]), ref) <= TOL  # past the window of 8
    engine = make_engine(tiny, device="cpu", executor="torch", dtype="float32")
    prompt = ids[:10]
    h = engine.submit(prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), capture_logits=True)
    out = h.result(timeout=120)
    steps = hf_step_logits(model, prompt, out[:-1])
    assert rel_err(torch.stack(list(h.logits)), steps) <= TOL
    assert out == steps.argmax(-1).tolist()


def test_max_gib_picks_the_layer_count(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    wg = write_gguf_module()
    vocab = str(write_vocab(tmp_path / "v.gguf", VOCAB))

    def args(*extra: str) -> Any:
        return wg.parse_args(["--arch", "gpt-oss", "--vocab-from", vocab, *shape_args({**SHAPE, "layers": 8}),
                              "--out", str(tmp_path / "x.gguf"), *extra])

    six = args("--layers", "6")
    size = wg.file_bytes(six, wg.arch_specs(six, wg.model_shape(six, VOCAB)))
    for gib, layers in ((size / 2**30, 6), ((size - 1) / 2**30, 4), (1.0, 8)):  # even: sliding / full pairs
        a = args("--max-gib", str(gib))
        wg.fit_layers(a, VOCAB)
        assert a.layers == layers
    with pytest.raises(SystemExit):
        wg.parse_args(["--arch", "qwen3moe", "--quant", "mxfp4", "--out", "x"])
    assert "mxfp4 is gpt-oss's" in capsys.readouterr().err


def test_o200k_harmony_tokenizer_keys(tmp_path: Path) -> None:
    bpe_openai = pytest.importorskip("bpe_openai")
    from freetoken_agent.models import load_tokenizer
    from freetoken_agent.tokenizer.build import chat_template
    from freetoken_agent.tokenizer.gguf import _fields as gguf_fields

    path = _write(tmp_path, "--layers", "1", name="o200k.gguf")
    # read back with the metadata reader the loader uses: the gguf package's reader takes ~17 s on
    # 200k-entry arrays (it is the reference for the small vocabularies of the other tests)
    r = gguf_fields(path)
    assert r["tokenizer.ggml.model"] == "gpt2" and r["tokenizer.ggml.pre"] == "gpt-4o"
    tokens = r["tokenizer.ggml.tokens"]
    assert len(tokens) == 201088  # o200k_harmony: gpt-oss's embedding rows
    assert [tokens[r[f"tokenizer.ggml.{k}_token_id"]] for k in ("bos", "eos", "padding")] == \
        ["<|startoftext|>", "<|return|>", "<|endoftext|>"]
    types = r["tokenizer.ggml.token_type"]
    assert set(types[:199998]) == {1} and set(types[199998:]) == {3}
    assert r["tokenizer.chat_template"] == chat_template("gpt_oss")
    ours, ref = load_tokenizer(path), bpe_openai.build_encoding_from_name("o200k_base")
    for text in ("Hello, world! don't WE'LL 12345678", "def f(x):\n    return x  # ünïcödé 中文 🎉\r\n\n"):
        assert ours.encode(text) == ref.encode(text)
    assert ours.encode("<|start|>assistant<|channel|>final<|message|>") == \
        [200006, *ref.encode("assistant"), 200005, *ref.encode("final"), 200008]
