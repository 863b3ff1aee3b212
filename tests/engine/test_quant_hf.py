"""Hugging Face quantized checkpoints load with packed experts and run losslessly (engine/weights/hf_quant.py).

A tiny random qwen3_moe is saved by transformers, then its tensors are quantized by the test:
- FP8 block-scaled (`quant_method: fp8`, 128x128 blocks, `weight_scale_inv`): every expert and the
  attention projections (dense tensors dequantize at load);
- ModelOpt NVFP4 (`quant_method: modelopt`, `quant_algo: NVFP4`: weight / weight_scale /
  weight_scale_2 / input_scale) for every expert, the global scale differing from expert to expert.
The reference is transformers loading a float checkpoint of the dequantized weights (fp8 by
transformers' own dequantization; nvfp4 by the float64-checked reference of engine/quant): the
engine's prefill logits equal it (rel. err <= 1e-4), and its experts stay packed at their stored
size. An unsupported `quant_method` is one line naming config.json and the method.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from checkpoints import (
    TinySpec,
    build,
    edit_config,
    hf_prefill_logits,
    load_tensors,
    qwen3_5_moe_text,
    qwen3_moe_text,
    rel_err,
    write_tensors,
)

from engine.errors import ConfigError
from engine.model.load import load_decoder
from engine.quant.formats import E2M1, FORMATS
from engine.quant.hf import nvfp4_rows
from engine.weights.layout import PackedExpertBanks

H, INTER, E, VOCAB = 128, 128, 4, 64
EXPERT = re.compile(r".*\.experts\.\d+\.(gate|up|down)_proj\.weight$")
ATTN = re.compile(r".*\.self_attn\.[qkvo]_proj\.weight$")


def _spec(family: str = "qwen3_moe") -> TinySpec:
    if family == "qwen3_5_moe":
        return TinySpec("hfq35", family, qwen3_5_moe_text(
            vocab_size=VOCAB, hidden_size=H, moe_intermediate_size=INTER, shared_expert_intermediate_size=64,
            num_experts=E, num_experts_per_tok=2), seed=5, std=0.05)
    return TinySpec("hfq", "qwen3_moe", qwen3_moe_text(
        vocab_size=VOCAB, hidden_size=H, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, moe_intermediate_size=INTER, num_experts=E, num_experts_per_tok=2), seed=4, std=0.05)


def quant_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w.shape
    blocks = w.reshape(-(-n // 128), min(n, 128), k // 128, 128)
    scale = blocks.abs().amax(dim=(1, 3)) / 448.0
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    return q.reshape(n, k), scale.float()


def quant_nvfp4(w: torch.Tensor) -> dict[str, torch.Tensor]:
    n, k = w.shape
    g = w.abs().max() / (6.0 * 448.0)
    blocks = w.reshape(n, k // 16, 16)
    s = (blocks.abs().amax(-1) / 6.0 / g).to(torch.float8_e4m3fn)
    scaled = blocks / (s.float() * g)[..., None]
    table = torch.tensor(E2M1[:8])
    nib = (scaled.abs()[..., None] - table).abs().argmin(-1) | ((scaled < 0).to(torch.int64) << 3)
    nib = nib.reshape(n, k // 2, 2).to(torch.uint8)
    return {"weight": nib[..., 0] | (nib[..., 1] << 4), "weight_scale": s,
            "weight_scale_2": g.reshape(()).float(), "input_scale": torch.tensor(1.0)}


def _quantized_pair(tmp: Path, method: str, family: str = "qwen3_moe") -> tuple[Path, Path]:
    """(quantized checkpoint, float checkpoint of its dequantized weights)."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    src, _ = build(_spec(family), tmp / "src")
    tensors = load_tensors(src)
    quant: dict[str, torch.Tensor] = {}
    deq: dict[str, torch.Tensor] = {}
    for name, w in tensors.items():
        fits = w.ndim == 2 and w.shape[1] % 128 == 0 and (w.shape[0] % 128 == 0 or w.shape[0] < 128)
        if method == "fp8" and (EXPERT.match(name) or ATTN.match(name)) and fits:
            q, s = quant_fp8(w.float())
            quant[name], quant[name + "_scale_inv"] = q, s
            deq[name] = _dequantize_fp8_weight(q, s, [128, 128], torch.float32)
        elif method == "nvfp4" and EXPERT.match(name):
            parts = quant_nvfp4(w.float())
            quant.update({name[: -len("weight")] + k: v for k, v in parts.items()})
            deq[name] = FORMATS["nvfp4"].dequantize(nvfp4_rows(parts["weight"], parts["weight_scale"]), w.shape[1],
                                                    parts["weight_scale_2"])
        else:
            quant[name] = deq[name] = w
    qdir, fdir = tmp / "quant", tmp / "float"
    for d, t in ((qdir, quant), (fdir, deq)):
        build(_spec(family), d)
        write_tensors(d, t)
    qc = ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"} if method == "fp8"
          else {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16})
    edit_config(qdir, lambda c: c.update(quantization_config=qc))
    return qdir, fdir


@pytest.mark.parametrize(("method", "family"), [("fp8", "qwen3_moe"), ("nvfp4", "qwen3_moe"), ("fp8", "qwen3_5_moe")])
def test_quantized_checkpoint_equals_transformers(tmp_path: Path, method: str, family: str) -> None:
    import transformers as tf
    from test_gguf_quant import _engine_logits

    qdir, fdir = _quantized_pair(tmp_path, method, family)
    ref_model = tf.AutoModelForCausalLM.from_pretrained(str(fdir), dtype=torch.float32).eval()
    dec = load_decoder(qdir, "cpu", torch.float32, executor="torch")
    banks = dec.weights.experts
    assert isinstance(banks, PackedExpertBanks) and set(banks.fmt_gu) == {method}
    fmt = FORMATS[method]
    layers = 2 if family == "qwen3_moe" else 4
    assert banks.total_bytes == layers * E * 3 * INTER * fmt.row_bytes(H)
    if method == "nvfp4":  # each expert's own global scale, gate / up / down
        t = load_tensors(qdir)
        assert float(banks.gscale[1][2, 2]) == float(t["model.layers.1.mlp.experts.2.down_proj.weight_scale_2"])
    ids = torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(6)).tolist()
    ref = hf_prefill_logits(ref_model, ids)
    got = _engine_logits(dec, ids)
    assert rel_err(got, ref) <= 1e-4, f"{method}: {rel_err(got, ref):.2e}"


def test_unsupported_method_is_named(tmp_path: Path) -> None:
    src, _ = build(_spec(), tmp_path / "ckpt")
    edit_config(src, lambda c: c.update(quantization_config={"quant_method": "gptq", "bits": 4}))
    with pytest.raises(ConfigError, match=r"config\.json: quantization_config\.quant_method 'gptq' is not supported"):
        load_decoder(src, "cpu", torch.float32)
    assert json.loads((src / "config.json").read_text())["quantization_config"]["bits"] == 4


def test_gpt_oss_mxfp4_experts_pack_gate_rows_first(tmp_path: Path) -> None:
    """gpt-oss's fused `gate_up_proj_blocks` interleaves gate and up rows; the packed bank holds the gate
    rows, then the up rows, each equal to transformers' dequantization of the checkpoint's tensors."""
    from safetensors.torch import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from engine.weights.hf_quant import open_quantized
    from engine.weights.reader import CheckpointReader

    g = torch.Generator().manual_seed(2)
    e, inter, h = 2, 32, 64
    p = "model.layers.0.mlp.experts."
    t = {p + "gate_up_proj_blocks": torch.randint(0, 256, (e, 2 * inter, h // 32, 16), dtype=torch.uint8, generator=g),
         p + "gate_up_proj_scales": torch.randint(115, 135, (e, 2 * inter, h // 32), dtype=torch.uint8, generator=g),
         p + "down_proj_blocks": torch.randint(0, 256, (e, h, inter // 32, 16), dtype=torch.uint8, generator=g),
         p + "down_proj_scales": torch.randint(115, 135, (e, h, inter // 32), dtype=torch.uint8, generator=g)}
    save_file(t, str(tmp_path / "model.safetensors"))
    reader = open_quantized(CheckpointReader(tmp_path), {"quantization_config": {"quant_method": "mxfp4"}},
                            tmp_path / "config.json")
    assert reader.expert_format(p) == "mxfp4"
    full = convert_moe_packed_tensors(t[p + "gate_up_proj_blocks"], t[p + "gate_up_proj_scales"],
                                      dtype=torch.float32).transpose(1, 2)  # [E, 2I, H], rows interleaved
    mx = FORMATS["mxfp4"]
    for proj, rows in (("gate_proj", full[:, 0::2]), ("up_proj", full[:, 1::2])):
        fmt, packed, gscale = reader.expert_rows(p, proj, e, inter, h)
        assert fmt == "mxfp4" and torch.equal(gscale, torch.ones(e))
        assert torch.equal(mx.dequantize(packed, h), rows)
    down = convert_moe_packed_tensors(t[p + "down_proj_blocks"], t[p + "down_proj_scales"],
                                      dtype=torch.float32).transpose(1, 2)
    _, packed, _ = reader.expert_rows(p, "down_proj", e, h, inter)
    assert torch.equal(mx.dequantize(packed, inter), down)
