"""gpt-oss with MXFP4 experts kept packed: a Hugging Face checkpoint (`_blocks` / `_scales`,
`quantization_config.quant_method: mxfp4`) and a GGUF (`gpt-oss`, ffn_{gate,up,down}_exps in MXFP4
with their biases) load into `PackedExpertBanks` holding exactly the file's expert bytes, and the
engine's logits equal transformers 5.23's GptOssForCausalLM run on transformers' own dequantization
of the same blocks (f32, rel. err <= 1e-4): prefill at every position, continued from cached KV past
the sliding window, and the engine's decode steps, through the packed torch reference executor and
the native one. The GGUF's MXFP4 bytes are checked against gguf.quants' dequantization too.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from checkpoints import hf_prefill_logits, hf_step_logits, rel_err, write_tensors
from safetensors.torch import load_file
from test_gpt_oss import build, decoder_pass, pools, tokens

from engine.cache.pools import KVPool
from engine.config import ModelConfig
from engine.model.load import load_decoder
from engine.moe.packed import PackedExpertExecutor
from engine.quant.formats import FORMATS
from engine.quant.hf import mxfp4_rows
from engine.sampling import SamplingParams
from engine.weights.layout import PackedExpertBanks

TOL = 1e-4
E, H, INTER, LAYERS = 6, 64, 32, 2  # MXFP4 blocks hold 32 values: dims are multiples of 32
EXECUTORS = ("torch", "native")


def alloc(kv: KVPool, n: int) -> torch.Tensor:
    slots = kv.alloc(n)
    assert slots is not None
    return slots


def _blocks(g: torch.Generator, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random HF MXFP4 blocks [E, rows, cols/32, 16] and e8m0 scales near 1 (some values clamp)."""
    blocks = torch.randint(0, 256, (E, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
    return blocks, torch.randint(122, 130, (E, rows, cols // 32), generator=g, dtype=torch.uint8)


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, dict[str, torch.Tensor]]:
    """(checkpoint dir, the transformers model on the dequantized experts, the MXFP4 tensors)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    path = tmp_path_factory.mktemp("gpt_oss_mxfp4") / "ckpt"
    model: Any = build(path, seed=4, hidden_size=H, intermediate_size=INTER, num_hidden_layers=LAYERS,
                  layer_types=["sliding_attention", "full_attention"])
    tensors = load_file(str(path / "model.safetensors"))
    g = torch.Generator().manual_seed(9)
    quantized: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for li, layer in enumerate(model.model.layers):
            for name, out_dim, in_dim in (("gate_up_proj", 2 * INTER, H), ("down_proj", H, INTER)):
                key = f"model.layers.{li}.mlp.experts.{name}"
                blocks, scales = _blocks(g, out_dim, in_dim)
                getattr(layer.mlp.experts, name).copy_(convert_moe_packed_tensors(blocks, scales,
                                                                                   dtype=torch.float32))
                del tensors[key]
                quantized[key + "_blocks"], quantized[key + "_scales"] = blocks, scales
    write_tensors(path, {**tensors, **quantized})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                        "model.layers.*.mlp.router"]}
    (path / "config.json").write_text(json.dumps(config))
    return path, model, quantized


def test_experts_stay_packed_and_take_the_files_bytes(mxfp4, caplog: pytest.LogCaptureFixture) -> None:
    path, model, quantized = mxfp4
    with caplog.at_level(logging.INFO, logger="freetoken.engine"):
        dec = load_decoder(path, executor="torch")
    banks = dec.weights.experts
    assert isinstance(banks, PackedExpertBanks) and banks.fmt_gu == ["mxfp4"] * LAYERS == banks.fmt_d
    assert banks.w13.numel() == 0 and banks.w2.numel() == 0  # no float copy of an expert
    file_bytes = sum(t.numel() for t in quantized.values())  # uint8: bytes
    assert banks.total_bytes == banks.file_bytes == file_bytes
    assert f"{file_bytes / 2**30:.2f} GiB in the file" in caplog.text
    assert banks.b13 is not None and banks.b2 is not None and banks.b13.dtype == banks.b2.dtype == torch.float32
    for li, layer in enumerate(model.model.layers):  # the banks hold transformers' values, losslessly
        ex = layer.mlp.experts
        gate_up = FORMATS["mxfp4"].dequantize(banks.gate_up[li], H)  # [E, 2I, H]: gate rows, then up rows
        assert torch.equal(gate_up[:, :INTER], ex.gate_up_proj[..., 0::2].transpose(1, 2))
        assert torch.equal(gate_up[:, INTER:], ex.gate_up_proj[..., 1::2].transpose(1, 2))
        assert torch.equal(FORMATS["mxfp4"].dequantize(banks.down[li], INTER), ex.down_proj.transpose(1, 2))
        rows = slice(li * E, (li + 1) * E)
        assert torch.equal(banks.b13[rows], torch.cat([ex.gate_up_proj_bias[:, 0::2], ex.gate_up_proj_bias[:, 1::2]], 1))
        assert torch.equal(banks.b2[rows], ex.down_proj_bias)


def test_bad_expert_tensors_name_file_and_tensor(mxfp4, tmp_path: Path) -> None:
    from engine.errors import WeightError

    path, _, _ = mxfp4
    tensors = load_file(str(path / "model.safetensors"))
    key = "model.layers.1.mlp.experts."
    cases: dict[str, tuple[dict[str, torch.Tensor | None], str]] = {  # name: (changed tensors, the error)
        "scales": ({key + "gate_up_proj_scales": tensors[key + "gate_up_proj_scales"][..., :1]},
                   rf"model.safetensors: tensor '{key}gate_up_proj_scales' has shape \[6, 64, 1\], expected "
                   r"\[6, 64, 2\]"),
        "bias": ({key + "gate_up_proj_bias": None}, rf"missing tensor '{key}gate_up_proj_bias'"),
    }
    for name, (change, match) in cases.items():
        bad = tmp_path / name
        bad.mkdir()
        (bad / "config.json").write_text((path / "config.json").read_text())
        broken = {k: v for k, v in {**tensors, **change}.items() if v is not None}
        write_tensors(bad, broken)
        with pytest.raises(WeightError, match=match):
            load_decoder(bad, executor="torch")


@pytest.mark.parametrize("executor", EXECUTORS)
def test_prefill_logits(mxfp4, executor: str) -> None:
    path, model, _ = mxfp4
    dec = load_decoder(path, executor=executor)
    assert isinstance(dec.executor, PackedExpertExecutor) and dec.executor.name == executor
    a = tokens(20, 7)
    ref = hf_prefill_logits(model, a)
    kv, states = pools(dec.cfg, 64)
    assert rel_err(decoder_pass(dec, kv, states, [(a, 0, alloc(kv, 20))]), ref) <= TOL
    kv, states = pools(dec.cfg, 64)  # 11 cached (past the window of 8), then 9
    first = alloc(kv, 11)
    got = torch.cat([decoder_pass(dec, kv, states, [(a[:11], 0, first)]),
                     decoder_pass(dec, kv, states, [(a[11:], 11, torch.cat([first, alloc(kv, 9)]))])])
    assert rel_err(got, ref) <= TOL


@pytest.mark.parametrize("executor", EXECUTORS)
def test_decode_steps(mxfp4, make_engine, executor: str) -> None:  # type: ignore[no-untyped-def]
    path, model, _ = mxfp4
    engine = make_engine(path, device="cpu", executor=executor)
    prompt = tokens(6, 5)
    h = engine.submit(prompt, SamplingParams(max_tokens=6, ignore_eos=True), capture_logits=True)
    out = h.result(timeout=120)
    ref = hf_step_logits(model, prompt, out[:-1])
    assert rel_err(torch.stack(list(h.logits)), ref) <= TOL
    assert out == ref.argmax(-1).tolist()


# ---------------------------------------------------------------------------------------- GGUF
_ATT = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output"}


def write_gguf(model: Any, quantized: dict[str, torch.Tensor], path: Path, float_experts: bool = False) -> dict[str, int]:
    """The model as llama.cpp's converter lays out gpt-oss (experts MXFP4 from `quantized`, or F32
    with `float_experts`, every other tensor F32); returns the MXFP4 expert tensors' bytes."""
    import gguf

    c = model.config
    w = gguf.GGUFWriter(str(path), "gpt-oss")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_expert_count(c.num_local_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_expert_feed_forward_length(c.intermediate_size)
    w.add_sliding_window(c.sliding_window)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(c.rope_parameters["factor"])
    w.add_rope_scaling_orig_ctx_len(c.rope_parameters["original_max_position_embeddings"])
    sizes: dict[str, int] = {}

    def f32(name: str, t: torch.Tensor) -> None:
        w.add_tensor(name, t.detach().float().contiguous().numpy())

    def mx(name: str, rows: torch.Tensor) -> None:
        data = rows.contiguous().numpy()
        w.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType.MXFP4)
        sizes[name] = data.nbytes

    f32("token_embd.weight", model.model.embed_tokens.weight)
    f32("output_norm.weight", model.model.norm.weight)
    f32("output.weight", model.lm_head.weight)
    for li, layer in enumerate(model.model.layers):
        b = f"blk.{li}."
        f32(b + "attn_norm.weight", layer.input_layernorm.weight)
        f32(b + "post_attention_norm.weight", layer.post_attention_layernorm.weight)
        for hf, gg in _ATT.items():
            f32(b + gg + ".weight", getattr(layer.self_attn, hf).weight)
            f32(b + gg + ".bias", getattr(layer.self_attn, hf).bias)
        f32(b + "attn_sinks.weight", layer.self_attn.sinks)
        f32(b + "ffn_gate_inp.weight", layer.mlp.router.weight)
        f32(b + "ffn_gate_inp.bias", layer.mlp.router.bias)
        key = f"model.layers.{li}.mlp.experts."
        blocks, scales = quantized[key + "gate_up_proj_blocks"], quantized[key + "gate_up_proj_scales"]
        if float_experts:  # [E, out, in], gate and up apart
            ex = layer.mlp.experts
            f32(b + "ffn_gate_exps.weight", ex.gate_up_proj[..., 0::2].transpose(1, 2))
            f32(b + "ffn_up_exps.weight", ex.gate_up_proj[..., 1::2].transpose(1, 2))
            f32(b + "ffn_down_exps.weight", ex.down_proj.transpose(1, 2))
        else:
            mx(b + "ffn_gate_exps.weight", mxfp4_rows(blocks[:, 0::2], scales[:, 0::2]))
            mx(b + "ffn_up_exps.weight", mxfp4_rows(blocks[:, 1::2], scales[:, 1::2]))
            mx(b + "ffn_down_exps.weight", mxfp4_rows(quantized[key + "down_proj_blocks"],
                                                      quantized[key + "down_proj_scales"]))
        bias = layer.mlp.experts.gate_up_proj_bias
        f32(b + "ffn_gate_exps.bias", bias[:, 0::2])
        f32(b + "ffn_up_exps.bias", bias[:, 1::2])
        f32(b + "ffn_down_exps.bias", layer.mlp.experts.down_proj_bias)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return sizes


@pytest.fixture(scope="module")
def gguf_file(mxfp4, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, int]]:
    _, model, quantized = mxfp4
    path = tmp_path_factory.mktemp("gpt_oss_gguf") / "tiny-gpt-oss-mxfp4.gguf"
    return path, write_gguf(model, quantized, path)


def test_gguf_config_and_bytes(mxfp4, gguf_file) -> None:
    import gguf

    from engine.weights.gguf_reader import GgufReader

    _, model, _ = mxfp4
    path, sizes = gguf_file
    cfg = ModelConfig.from_dict(GgufReader(path).config(), source=str(path))
    hf = ModelConfig.from_dict(model.config.to_dict())
    for field in ("family", "layer_types", "sliding_window", "rope_scaling", "rope_theta", "num_experts", "top_k",
                  "moe_intermediate_size", "head_dim", "attention_bias", "attention_sinks", "expert_activation",
                  "swiglu_alpha", "swiglu_limit", "router_kind"):
        assert getattr(cfg, field) == getattr(hf, field), field
    reader = gguf.GGUFReader(str(path))  # the file's MXFP4 bytes are transformers' values (gguf.quants)
    ex = model.model.layers[1].mlp.experts
    t = next(t for t in reader.tensors if t.name == "blk.1.ffn_up_exps.weight")
    got = gguf.quants.dequantize(np.asarray(t.data), gguf.GGMLQuantizationType.MXFP4).reshape(E, INTER, H)
    np.testing.assert_array_equal(got, ex.gate_up_proj[..., 1::2].transpose(1, 2).detach().numpy())
    dec = load_decoder(path, executor="torch")
    banks = dec.weights.experts
    assert isinstance(banks, PackedExpertBanks)
    assert banks.total_bytes == banks.file_bytes == sum(sizes.values())


@pytest.mark.parametrize("executor", EXECUTORS)
def test_gguf_logits(mxfp4, gguf_file, executor: str) -> None:
    _, model, _ = mxfp4
    dec = load_decoder(gguf_file[0], dtype=torch.float32, executor=executor)
    assert isinstance(dec.executor, PackedExpertExecutor) and dec.executor.name == executor
    a = tokens(14, 8)
    kv, states = pools(dec.cfg, 64)
    first = alloc(kv, 10)  # prefill past the window, then decode steps of one token each
    rows = [decoder_pass(dec, kv, states, [(a[:10], 0, first)])]
    slots = first
    for pos in range(10, 14):
        slots = torch.cat([slots, alloc(kv, 1)])
        rows.append(decoder_pass(dec, kv, states, [(a[pos:pos + 1], pos, slots)]))
    assert rel_err(torch.cat(rows), hf_prefill_logits(model, a)) <= TOL


def test_gguf_with_float_experts(mxfp4, tmp_path: Path) -> None:
    """A gpt-oss GGUF with F32 experts loads into float banks (gate and up apart in the file)."""
    from engine.weights.layout import ExpertBanks

    _, model, quantized = mxfp4
    path = tmp_path / "tiny-gpt-oss-f32.gguf"
    write_gguf(model, quantized, path, float_experts=True)
    dec = load_decoder(path, dtype=torch.float32, executor="torch")
    assert type(dec.weights.experts) is ExpertBanks and dec.weights.experts.b13 is not None
    a = tokens(12, 9)
    kv, states = pools(dec.cfg, 32)
    assert rel_err(decoder_pass(dec, kv, states, [(a, 0, alloc(kv, 12))]), hf_prefill_logits(model, a)) <= TOL


# ---------------------------------------------------------------------------------------- bench shapes
def test_bench_shapes_keep_mxfp4_packed(monkeypatch: pytest.MonkeyPatch) -> None:
    """`bench --shape gpt-oss-*` builds random MXFP4 experts kept packed: the real shapes' bank bytes
    are the MXFP4 bytes (17 per 32 values), the tiny shape's blocks have rms ~0.02, do not depend on
    the fill threads, and run through both packed executors to the same logits."""
    from engine.moe.executor import create_executor
    from engine.weights import dummy
    from engine.weights.dummy import dummy_config, dummy_weights
    from engine.weights.shapes import SHAPES

    for name, gb in (("gpt-oss-20b", 10.15), ("gpt-oss-120b", 60.91)):
        shape = SHAPES[name]
        assert shape.expert_format == "mxfp4"
        assert round(shape.layers * shape.experts * 3 * shape.hidden * shape.inter * 17 / 32 / 1e9, 2) == gb
    cfg = dummy_config("tiny-gpt-oss")
    monkeypatch.setattr(dummy, "MXFP4_TASK", 17 * 8 * 3)  # many fill tasks per bank
    w = dummy_weights(cfg, "cpu", torch.float32, seed=2, fill_threads=1)
    banks = w.experts
    assert isinstance(banks, PackedExpertBanks) and set(banks.fmt_gu) | set(banks.fmt_d) == {"mxfp4"}
    assert banks.total_bytes == cfg.num_moe_layers * cfg.num_experts * 3 * 64 * 32 * 17 // 32
    assert banks.b13 is not None and banks.activation == "swiglu_clamped"
    gate_up = FORMATS["mxfp4"].dequantize(banks.gate_up[0], 64)
    assert 0.015 < float(gate_up.std()) < 0.03 and abs(float(gate_up.mean())) < 0.002
    again = dummy_weights(cfg, "cpu", torch.float32, seed=2, fill_threads=3).experts
    assert isinstance(again, PackedExpertBanks)
    assert all(torch.equal(a, b) for a, b in zip(banks.gate_up + banks.down, again.gate_up + again.down, strict=True))
    from engine.model.decoder import Decoder

    logits = []
    for executor in EXECUTORS:
        dec = Decoder(cfg, w, create_executor(executor, banks))
        assert isinstance(dec.executor, PackedExpertExecutor) and dec.executor.name == executor
        kv, states = pools(dec.cfg, 32)
        logits.append(decoder_pass(dec, kv, states, [(list(range(10)), 0, alloc(kv, 10))]))
    assert torch.isfinite(logits[0]).all() and rel_err(logits[1], logits[0]) <= TOL
