"""Quantized GGUF experts run packed and losslessly (engine/weights/packed.py, engine/moe/packed.py).

A tiny random qwen3_moe (transformers, float32) is written as a GGUF by the test (gguf.GGUFWriter):
dense tensors in F32, each layer's routed experts in a quant type (Q4_K gate/up with Q6_K down, as
Q4_K_M files mix them; Q8_0; Q5_K with Q4_0 down; IQ4_XS; MXFP4; ...): quantized with
gguf.quants.quantize where the package can, random valid blocks otherwise. Then:
- the engine keeps the experts packed, byte for byte as in the file, reports their bytes, and no
  float copy of an expert exists (the float banks are empty);
- its logits (every prefill position, and 8 cached decode steps) equal transformers' on the same
  model with the experts replaced by gguf.quants' dequantization (rel. err <= 1e-4), greedy tokens equal;
- for a Q8_0 file, equal to transformers' own GGUF loading of the same file;
- a split set (-00001-of-00002.gguf) loads as the single file does;
- bad input is one line naming the file, tensor and type: a truncated file, a quant type without a
  packed format, a gate and up of different types.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from checkpoints import TinySpec, hf_prefill_logits, hf_step_logits, make_hf_model, qwen3_moe_text, rel_err

from engine.errors import WeightError
from engine.model.load import load_decoder
from engine.moe.packed import PackedExpertExecutor
from engine.weights.layout import PackedExpertBanks

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType
H, INTER, E, L, VOCAB = 256, 256, 4, 2, 96
TOL = 1e-4
# byte offsets of the half scales in a block, for random valid blocks of the types gguf cannot quantize
HALVES = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,), T.IQ4_NL: (0,),
          T.IQ4_XS: (0,)}


def _spec(seed: int) -> TinySpec:
    return TinySpec(f"gguf{seed}", "qwen3_moe", qwen3_moe_text(
        vocab_size=VOCAB, hidden_size=H, num_hidden_layers=L, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, moe_intermediate_size=INTER, num_experts=E, num_experts_per_tok=2, norm_topk_prob=True,
        rms_norm_eps=1e-6, rope_theta=1e6), seed=seed, std=0.05)


def _quantize(w: np.ndarray, qtype: Any, rng: np.random.Generator) -> np.ndarray:
    """Packed bytes of `w` [.., K] in `qtype` (random valid blocks of the same shape where gguf cannot quantize)."""
    try:
        return gguf.quants.quantize(w.astype(np.float32), qtype)
    except NotImplementedError:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        nb = w.shape[-1] // block
        raw = rng.integers(0, 256, size=(*w.shape[:-1], nb, size), dtype=np.uint8)
        for off in HALVES[qtype]:
            raw[..., off:off + 2] = rng.uniform(-3e-4, 3e-4, size=(*w.shape[:-1], nb, 1)).astype(np.float16).view(np.uint8)
        return raw.reshape(*w.shape[:-1], nb * size)


def write_quant_gguf(model: Any, out: Path, types: list[tuple[Any, Any]], seed: int = 0,
                     split: bool = False, fused: bool = False) -> list[Path]:
    """Writes `model` as a qwen3moe GGUF with layer l's experts in types[l] = (gate/up type, down type);
    sets the model's experts to their dequantized values (the reference). Returns the files written."""
    rng = np.random.default_rng(seed)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    cfg = model.config
    tensors: list[tuple[str, np.ndarray, Any]] = [("token_embd.weight", sd["model.embed_tokens.weight"], None),
                                                       ("output_norm.weight", sd["model.norm.weight"], None),
                                                       ("output.weight", sd["lm_head.weight"], None)]
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp"}
    with torch.no_grad():
        for li in range(cfg.num_hidden_layers):
            p = f"model.layers.{li}."
            tensors += [(f"blk.{li}.{g}.weight", sd[f"{p}{h}.weight"], None) for h, g in names.items()]
            experts = model.model.layers[li].mlp.experts
            gu = experts.gate_up_proj.detach().float().numpy()  # [E, 2I, H]
            dn = experts.down_proj.detach().float().numpy()  # [E, H, I]
            t_gu, t_d = types[li]
            packed = {"gate": _quantize(gu[:, :INTER], t_gu, rng), "up": _quantize(gu[:, INTER:], t_gu, rng),
                      "down": _quantize(dn, t_d, rng)}
            if fused:  # one ffn_gate_up_exps tensor, gate rows first
                tensors.append((f"blk.{li}.ffn_gate_up_exps.weight",
                                np.concatenate([packed["gate"], packed["up"]], axis=1), t_gu))
            for kind, qtype in (("gate", t_gu), ("up", t_gu), ("down", t_d))[2 if fused else 0:]:
                tensors.append((f"blk.{li}.ffn_{kind}_exps.weight", packed[kind], qtype))
            deq = {k: torch.from_numpy(gguf.quants.dequantize(v, t_gu if k != "down" else t_d)) for k, v in packed.items()}
            experts.gate_up_proj.copy_(torch.cat([deq["gate"], deq["up"]], dim=1))
            experts.down_proj.copy_(deq["down"])
    parts = [tensors] if not split else [tensors[:len(tensors) // 2], tensors[len(tensors) // 2:]]
    files = [out] if not split else [out.with_name(f"{out.stem}-{i + 1:05d}-of-{len(parts):05d}.gguf")
                                     for i in range(len(parts))]
    for i, (path, part) in enumerate(zip(files, parts, strict=True)):
        w = gguf.GGUFWriter(str(path), "qwen3moe")
        if i == 0:
            _metadata(w, cfg)
        if split:
            w.add_uint16("split.no", i)
            w.add_uint16("split.count", len(parts))
        for name, arr, qtype in part:
            w.add_tensor(name, arr if qtype is not None else arr.astype(np.float32), raw_dtype=qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return files


def _metadata(w: object, cfg: object) -> None:
    a = "qwen3moe"
    c: dict[str, int | float] = {"context_length": 512, "embedding_length": H, "block_count": L,
                                 "feed_forward_length": 1, "attention.head_count": 4, "attention.head_count_kv": 2,
                                 "attention.key_length": 16, "attention.value_length": 16,
                                 "rope.dimension_count": 16, "expert_count": E, "expert_used_count": 2,
                                 "expert_feed_forward_length": INTER}
    for k, v in c.items():
        w.add_uint32(f"{a}.{k}", int(v))  # type: ignore[attr-defined]
    w.add_float32(f"{a}.rope.freq_base", 1e6)  # type: ignore[attr-defined]
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)  # type: ignore[attr-defined]
    w.add_tokenizer_model("gpt2")  # type: ignore[attr-defined]
    w.add_tokenizer_pre("qwen2")  # type: ignore[attr-defined]
    # printable ASCII, the byte-level space, an end token: any ASCII text encodes (one token per character)
    w.add_token_list([chr(c) for c in range(33, 127)] + ["\u0120", "<|im_end|>"])  # type: ignore[attr-defined]
    w.add_token_types([1] * (VOCAB - 1) + [3])  # type: ignore[attr-defined]
    w.add_token_merges([])  # type: ignore[attr-defined]
    w.add_eos_token_id(VOCAB - 1)  # type: ignore[attr-defined]
    w.add_chat_template("{% for m in messages %}{{ m['content'] }} {% endfor %}")  # type: ignore[attr-defined]


CASES = {
    "q4_k_m": [(T.Q4_K, T.Q6_K), (T.Q4_K, T.Q4_K)],
    "q8_0": [(T.Q8_0, T.Q8_0), (T.Q8_0, T.Q8_0)],
    "q5_k_q4_0": [(T.Q5_K, T.Q4_0), (T.Q4_1, T.Q5_0)],
    "iq4_mxfp4": [(T.IQ4_XS, T.IQ4_NL), (T.MXFP4, T.Q3_K)],
    "q2_k_q5_1": [(T.Q2_K, T.Q5_1), (T.Q5_1, T.Q2_K)],
}


@pytest.fixture(scope="module", params=list(CASES))
def quant_file(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, torch.nn.Module]:
    model = make_hf_model(_spec(seed=3))
    path = tmp_path_factory.mktemp("gguf_quant") / f"tiny-{request.param}.gguf"
    write_quant_gguf(model, path, CASES[request.param], seed=len(request.param))
    return request.param, path, model


def _engine_logits(dec: object, ids: list[int]) -> torch.Tensor:
    from engine.cache.pools import KVPool, StatePool
    from engine.model.batch import ForwardBatch, SeqEntry

    d: Any = dec
    kv = KVPool(d.cfg, 64, torch.float32, torch.device("cpu"))
    st = StatePool(d.cfg, 1, torch.float32, torch.device("cpu"))
    slots = kv.alloc(len(ids))
    assert slots is not None
    state: int = -1
    if d.cfg.is_hybrid:
        got = st.alloc()
        assert got is not None
        state = got
        st.reset(state)
    batch = ForwardBatch(torch.tensor(ids), torch.arange(len(ids)), [SeqEntry(0, len(ids), 0, slots, state)])
    return d.logits(d.forward(batch, kv, st))  # type: ignore[no-any-return]


def test_packed_logits_equal_transformers(quant_file: tuple[str, Path, torch.nn.Module]) -> None:
    name, path, model = quant_file
    dec = load_decoder(path, "cpu", torch.float32, executor="torch")
    banks = dec.weights.experts
    assert isinstance(banks, PackedExpertBanks) and isinstance(dec.executor, PackedExpertExecutor)
    r = gguf.GGUFReader(str(path))
    raw = {t.name: np.asarray(t.data) for t in r.tensors}
    for li, (t_gu, t_d) in enumerate(CASES[name]):
        assert (banks.fmt_gu[li], banks.fmt_d[li]) == (t_gu.name.lower(), t_d.name.lower())
        assert np.array_equal(banks.gate_up[li][:, :INTER].numpy(), raw[f"blk.{li}.ffn_gate_exps.weight"])
        assert np.array_equal(banks.down[li].numpy(), raw[f"blk.{li}.ffn_down_exps.weight"])
    assert banks.total_bytes == banks.file_bytes == sum(v.nbytes for k, v in raw.items() if "_exps." in k)
    ids = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = hf_prefill_logits(model, ids)
    got = _engine_logits(dec, ids)
    assert rel_err(got, ref) <= TOL, f"{name}: prefill logits differ by {rel_err(got, ref):.2e}"


def test_decode_and_greedy_equal_transformers(make_engine, quant_file: tuple[str, Path, torch.nn.Module]) -> None:  # type: ignore[no-untyped-def]
    from engine.sampling import SamplingParams

    name, path, model = quant_file
    engine = make_engine(path, dtype="float32", executor="auto")  # the native kernel when built
    prompt = torch.randint(0, VOCAB, (7,), generator=torch.Generator().manual_seed(2)).tolist()
    handle = engine.submit(prompt, SamplingParams(max_tokens=8, ignore_eos=True), capture_logits=True)
    out = handle.result(timeout=120)
    ref = hf_step_logits(model, prompt, out[:-1])
    for j, row in enumerate(handle.logits):
        assert rel_err(row, ref[j]) <= TOL, f"{name}: decode step {j} differs by {rel_err(row, ref[j]):.2e}"
    assert out == ref.argmax(-1).tolist()


def test_q8_0_equals_transformers_gguf_loader(tmp_path: Path) -> None:
    import transformers as tf

    model = make_hf_model(_spec(seed=5))
    path = tmp_path / "q8.gguf"
    write_quant_gguf(model, path, [(T.Q8_0, T.Q8_0)] * L, seed=1)
    # transformers' GGUF config map has no key for expert_feed_forward_length: given here
    theirs = tf.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32,
                                                     moe_intermediate_size=INTER).eval()
    ids = torch.randint(0, VOCAB, (10,), generator=torch.Generator().manual_seed(3)).tolist()
    ref = hf_prefill_logits(theirs, ids)
    assert rel_err(ref, hf_prefill_logits(model, ids)) <= TOL  # their loader reads what we wrote
    got = _engine_logits(load_decoder(path, "cpu", torch.float32, executor="torch"), ids)
    assert rel_err(got, ref) <= TOL


def test_fused_gate_up_tensor(tmp_path: Path) -> None:
    """ffn_gate_up_exps (gate rows, then up rows) packs as the two tensors would."""
    model = make_hf_model(_spec(seed=3))
    path = tmp_path / "fused.gguf"
    write_quant_gguf(model, path, [(T.Q4_K, T.Q6_K), (T.Q8_0, T.Q8_0)], fused=True)
    assert any(t.name == "blk.0.ffn_gate_up_exps.weight" for t in gguf.GGUFReader(str(path)).tensors)
    dec = load_decoder(path, "cpu", torch.float32, executor="auto")
    assert isinstance(dec.weights.experts, PackedExpertBanks)
    ids = [5, 3, 9, 1, 7, 2]
    assert rel_err(_engine_logits(dec, ids), hf_prefill_logits(model, ids)) <= TOL


def test_split_set_loads_as_one_file(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model = make_hf_model(_spec(seed=3))
    files = write_quant_gguf(model, tmp_path / "tiny.gguf", [(T.Q4_K, T.Q6_K)] * L, split=True)
    assert [f.name for f in files] == ["tiny-00001-of-00002.gguf", "tiny-00002-of-00002.gguf"]
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    with caplog.at_level("INFO", logger="freetoken.engine"):
        dec = load_decoder(files[0], "cpu", torch.float32, executor="torch")
    # the experts' bytes as in the file, next to bf16's: q4_k gate/up (144 B / 256) and q6_k down (210 B / 256)
    packed = L * E * INTER * (2 * 144 + 210)
    assert dec.weights.experts.total_bytes == packed
    assert f"{packed / 2**30:.2f} GiB in host memory ({L * E * 3 * H * INTER * 2 / 2**30:.2f} GiB in bf16" in caplog.text
    got = _engine_logits(dec, ids)
    assert rel_err(got, hf_prefill_logits(model, ids)) <= TOL
    files[1].unlink()
    with pytest.raises(WeightError, match=r"tiny-00002-of-00002\.gguf: file not found"):
        load_decoder(files[0], "cpu", torch.float32)


def test_bad_files_are_named(tmp_path: Path) -> None:
    model = make_hf_model(_spec(seed=3))
    path = tmp_path / "mixed.gguf"
    write_quant_gguf(model, path, [(T.Q4_K, T.Q6_K)] * L)
    data = path.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) - 1000])
    with pytest.raises(WeightError, match=r"cut\.gguf: .*tensor 'blk\.1\.ffn_down_exps\.weight' \(Q6_K\) ends at byte"):
        load_decoder(tmp_path / "cut.gguf", "cpu", torch.float32)
    # a type with no packed format (TQ2_0) for the experts
    w = gguf.GGUFWriter(str(tmp_path / "tq.gguf"), "qwen3moe")
    _metadata(w, model.config)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("blk.0.ffn_gate_exps.weight", gguf.quants.quantize(np.zeros((E, INTER, H), np.float32), T.TQ2_0),
                 raw_dtype=T.TQ2_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(WeightError, match=r"tq\.gguf: tensor 'blk\.0\.ffn_gate_exps\.weight' is TQ2_0"):
        load_decoder(tmp_path / "tq.gguf", "cpu", torch.float32)


def requantize_experts(src: Path, dst: Path, qtype: Any, seed: int = 0) -> dict[str, np.ndarray]:
    """Copies GGUF `src` to `dst` with every `*_exps` tensor in `qtype` (its values re-quantized where gguf
    can, random valid blocks otherwise); returns each such tensor's dequantized values [E, rows, cols]."""
    rng = np.random.default_rng(seed)
    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), str(r.fields["general.architecture"].contents()))
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = f.types[1] if len(f.types) > 1 else None
        w.add_key_value(key, f.contents(), f.types[0], sub)
    deq: dict[str, np.ndarray] = {}
    for t in r.tensors:
        data = np.asarray(t.data)
        if "_exps." in t.name:
            values = torch.from_numpy(data.view(np.int16).copy()).view(torch.bfloat16).float().numpy()
            q = _quantize(values, qtype, rng)
            deq[t.name] = gguf.quants.dequantize(q, qtype)
            w.add_tensor(t.name, q, raw_dtype=qtype)
        else:
            w.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return deq


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K])
def test_qwen35moe_packed_equals_float_experts(tmp_path: Path, qtype: Any) -> None:
    """The hybrid family: a qwen35moe file (evals/peer/write_gguf.py) with its experts quantized runs
    packed with the logits of the float engine holding the same experts dequantized (itself equal to
    transformers: test_gguf_model.py)."""
    from peer_gguf import write_gguf_module, write_vocab

    src = tmp_path / "hybrid.gguf"
    args = ["--out", str(src), "--vocab-from", str(write_vocab(tmp_path / "vocab.gguf", 300)), "--arch", "qwen35moe",
            "--layers", "4", "--experts", "4", "--top-k", "2", "--hidden", "256", "--inter", "256",
            "--shared-inter", "32", "--heads", "4", "--kv-heads", "2", "--head-dim", "64", "--linear-key-heads", "2",
            "--linear-value-heads", "4", "--linear-head-dim", "16", "--std", "0.05", "--seed", "3", "--threads", "1"]
    assert write_gguf_module("peer_write_gguf_q35").main(args) == 0
    deq = requantize_experts(src, tmp_path / "hybrid-q.gguf", qtype)
    packed = load_decoder(tmp_path / "hybrid-q.gguf", "cpu", torch.float32, executor="auto")
    assert isinstance(packed.weights.experts, PackedExpertBanks)
    dense = load_decoder(src, "cpu", torch.float32, executor="torch")
    banks = dense.weights.experts
    i = banks.w2.shape[2]
    for li in range(4):
        rows = slice(li * 4, (li + 1) * 4)
        banks.w13[rows, :i] = torch.from_numpy(deq[f"blk.{li}.ffn_gate_exps.weight"])
        banks.w13[rows, i:] = torch.from_numpy(deq[f"blk.{li}.ffn_up_exps.weight"])
        banks.w2[rows] = torch.from_numpy(deq[f"blk.{li}.ffn_down_exps.weight"])
    ids = torch.randint(0, 300, (20,), generator=torch.Generator().manual_seed(4)).tolist()
    ref = _engine_logits(dense, ids)
    got = _engine_logits(packed, ids)
    assert rel_err(got, ref) <= TOL, f"{qtype.name}: {rel_err(got, ref):.2e}"


def test_generate_runs_a_quantized_gguf(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`generate --model FILE.gguf` (as `serve`): engine, tokenizer and chat template all from the file."""
    from freetoken_agent.cli import main

    path = tmp_path / "chat-q4_k_m.gguf"
    write_quant_gguf(make_hf_model(_spec(seed=3)), path, CASES["q4_k_m"])
    assert main(["generate", "--model", str(path), "--prompt", "hi there", "--max-tokens", "5", "--temperature", "0",
                 "--device", "cpu", "--dtype", "float32", "--output-ids"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    ids = json.loads(out[-1])
    assert len(ids) == 5 and all(0 <= i < VOCAB for i in ids)


def test_a_packed_model_reaches_the_gpu_expert_cache(tmp_path: Path, make_engine) -> None:  # type: ignore[no-untyped-def]
    """Packed experts are not refused by the GPU expert cache (its packed slot pool holds them): a
    packed model under --gpu-memory on a CPU engine gets the cache's own device check, one line."""
    from engine.errors import ConfigError

    path = tmp_path / "q4_k_m.gguf"
    write_quant_gguf(make_hf_model(_spec(seed=4)), path, CASES["q4_k_m"])
    with pytest.raises(ConfigError, match=r"--gpu-memory caps GPU memory, but the engine runs on cpu"):
        make_engine(path, device="cpu", dtype="float32", gpu_memory=2**30)
