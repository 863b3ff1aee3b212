"""gpt-oss's routed experts into host banks: quantized experts kept packed as stored, float ones in
float banks.

Contract:
- `gpt_oss_packed(reader, cfg)` returns `PackedExpertBanks` when the checkpoint stores the experts
  quantized, else None. Hugging Face MXFP4: `{p}gate_up_proj_blocks` [E, 2I, H/32, 16] uint8 and
  `_scales` [E, 2I, H/32] (gate and up rows interleaved: gate = even rows, up = odd rows),
  `{p}down_proj_blocks` [E, H, I/32, 16] and `_scales`, re-nibbled losslessly into ggml's mxfp4
  blocks (engine/quant/hf.py `mxfp4_rows`) one expert at a time, so the only transient beside the
  banks is one stored tensor. A GGUF (`gpt-oss`): `{p}gate_proj` / `up_proj` [E, I, H] and
  `down_proj` [E, H, I] in any packed type, their rows copied as they are. Biases go to the banks'
  `b13` [L*E, 2I] (gate biases, then up biases) and `b2` [L*E, H] in float32 (HF: `gate_up_proj_bias`
  interleaved like the rows, `down_proj_bias`; GGUF: `gate_proj_bias`, `up_proj_bias`,
  `down_proj_bias`); the activation is cfg's (swiglu_clamped, alpha, limit). `file_bytes` is the
  expert weights' bytes in the file, which `total_bytes` (host memory) equals.
- `gpt_oss_experts(fetch, cfg, prefix, banks, moe_index)` fills float banks' layer `moe_index` rows
  of `w13` (gate rows, then up rows, [out, in]) / `w2` / `b13` / `b2` from a bf16 checkpoint's
  `{prefix}gate_up_proj` [E, H, 2I] (gate and up interleaved by column), `down_proj` [E, I, H] and
  their `_bias`, or a float GGUF's `gate_proj` / `up_proj` [E, I, H], `down_proj` [E, H, I] and biases.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.config import ModelConfig
from engine.errors import WeightError
from engine.quant.hf import mxfp4_rows
from engine.weights.layout import ExpertBanks, PackedExpertBanks


def _prefix(cfg: ModelConfig, li: int) -> str:
    return f"{cfg.weight_prefix}layers.{li}.mlp.experts."


def _tensor(reader: Any, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    if not reader.has(name):
        raise WeightError(f"{reader.model_dir}: missing tensor {name!r}")
    if tuple(reader.shape(name)) != shape:
        raise WeightError(f"{reader.file_of(name)}: tensor {name!r} has shape {list(reader.shape(name))}, "
                          f"expected {list(shape)}")
    t: torch.Tensor = reader.get(name)
    return t


def _hf_mxfp4(reader: Any, base: str, experts: int, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(blocks, scales, their bytes in the file) of `{base}_blocks` / `_scales`, shapes checked."""
    if cols % 32:
        raise WeightError(f"{reader.file_of(base + '_blocks')}: tensor {base + '_blocks'!r} (mxfp4): rows of {cols} "
                          "values are not whole 32-value blocks")
    blocks = _tensor(reader, base + "_blocks", (experts, rows, cols // 32, 16))
    scales = _tensor(reader, base + "_scales", (experts, rows, cols // 32))
    return blocks, scales, reader.nbytes(base + "_blocks") + reader.nbytes(base + "_scales")


def _hf_layer(reader: Any, cfg: ModelConfig, p: str, banks: PackedExpertBanks, rows: slice) -> int:
    h, e, i = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    what = f"{reader.file_of(p + 'gate_up_proj_blocks')}: tensor {p + 'gate_up_proj_blocks'!r} (mxfp4)"
    blocks, scales, nbytes = _hf_mxfp4(reader, p + "gate_up_proj", e, 2 * i, h)
    gate_up = torch.empty(e, 2 * i, h // 32 * 17, dtype=torch.uint8)
    for x in range(e):  # gate = even rows, up = odd rows
        gate_up[x, :i] = mxfp4_rows(blocks[x, 0::2], scales[x, 0::2], what)
        gate_up[x, i:] = mxfp4_rows(blocks[x, 1::2], scales[x, 1::2], what)
    del blocks, scales
    what = f"{reader.file_of(p + 'down_proj_blocks')}: tensor {p + 'down_proj_blocks'!r} (mxfp4)"
    blocks, scales, more = _hf_mxfp4(reader, p + "down_proj", e, h, i)
    down = torch.empty(e, h, i // 32 * 17, dtype=torch.uint8)
    for x in range(e):
        down[x] = mxfp4_rows(blocks[x], scales[x], what)
    _append(banks, gate_up, "mxfp4", down, "mxfp4", torch.ones(e, 3))
    bias = _tensor(reader, p + "gate_up_proj_bias", (e, 2 * i)).float()
    assert banks.b13 is not None and banks.b2 is not None
    banks.b13[rows, :i], banks.b13[rows, i:] = bias[:, 0::2], bias[:, 1::2]
    banks.b2[rows] = _tensor(reader, p + "down_proj_bias", (e, h)).float()
    return nbytes + more


def _packed_layer(reader: Any, cfg: ModelConfig, p: str, banks: PackedExpertBanks, rows: slice) -> int:
    h, e, i = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    fg, gate, sg = reader.expert_rows(p, "gate_proj", e, i, h)
    fu, up, su = reader.expert_rows(p, "up_proj", e, i, h)
    fd, down, sd = reader.expert_rows(p, "down_proj", e, h, i)
    if fg != fu:
        raise WeightError(f"{reader.file_of(p + 'gate_proj')}: {p}gate_proj is {fg} but {p}up_proj is {fu}: a "
                          "layer's gate and up must share one format (they are one packed matrix)")
    gate_up = torch.empty(e, 2 * i, gate.shape[-1], dtype=torch.uint8)
    gate_up[:, :i], gate_up[:, i:] = gate, up
    owned = torch.empty(down.shape, dtype=torch.uint8)
    owned.copy_(down)  # out of the mapped file into the bank
    _append(banks, gate_up, fg, owned, fd, torch.stack([sg, su, sd], dim=1).float())
    assert banks.b13 is not None and banks.b2 is not None
    banks.b13[rows, :i] = _tensor(reader, p + "gate_proj_bias", (e, i)).float()
    banks.b13[rows, i:] = _tensor(reader, p + "up_proj_bias", (e, i)).float()
    banks.b2[rows] = _tensor(reader, p + "down_proj_bias", (e, h)).float()
    return sum(int(reader.nbytes(p + n)) for n in ("gate_proj", "up_proj", "down_proj"))


def _append(banks: PackedExpertBanks, gate_up: torch.Tensor, fmt_gu: str, down: torch.Tensor, fmt_d: str,
            gscale: torch.Tensor) -> None:
    banks.gate_up.append(gate_up)
    banks.down.append(down)
    banks.fmt_gu.append(fmt_gu)
    banks.fmt_d.append(fmt_d)
    banks.gscale.append(gscale.contiguous())


def gpt_oss_packed(reader: Any, cfg: ModelConfig) -> PackedExpertBanks | None:
    if not cfg.moe_layer_ids:
        return None
    first = _prefix(cfg, cfg.moe_layer_ids[0])
    hf = reader.has(first + "gate_up_proj_blocks")
    if not hf and (not hasattr(reader, "expert_format") or reader.expert_format(first) is None):
        return None
    h, e, i = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    banks = PackedExpertBanks.empty(e, h, i)
    banks.activation, banks.alpha, banks.limit = cfg.expert_activation, cfg.swiglu_alpha, cfg.swiglu_limit
    banks.b13 = torch.zeros(cfg.num_moe_layers * e, 2 * i)
    banks.b2 = torch.zeros(cfg.num_moe_layers * e, h)
    layer = _hf_layer if hf else _packed_layer
    for m, li in enumerate(cfg.moe_layer_ids):
        banks.file_bytes += layer(reader, cfg, _prefix(cfg, li), banks, slice(m * e, (m + 1) * e))
    return banks


def _float(fetch: Any, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    t: torch.Tensor = fetch.raw(name, shape)
    return t.float()


def gpt_oss_experts(fetch: Any, cfg: ModelConfig, prefix: str, banks: ExpertBanks, moe_index: int) -> None:
    h, e, i = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    rows = slice(moe_index * e, (moe_index + 1) * e)
    dtype = banks.w13.dtype
    assert banks.b13 is not None and banks.b2 is not None
    if fetch.reader.has(prefix + "gate_up_proj"):  # Hugging Face: [E, in, out], gate and up interleaved
        gate_up = _float(fetch, prefix + "gate_up_proj", (e, h, 2 * i)).transpose(1, 2)
        banks.w13[rows, :i] = gate_up[:, 0::2].to(dtype)
        banks.w13[rows, i:] = gate_up[:, 1::2].to(dtype)
        banks.w2[rows] = _float(fetch, prefix + "down_proj", (e, i, h)).transpose(1, 2).to(dtype)
        bias = _float(fetch, prefix + "gate_up_proj_bias", (e, 2 * i))
        banks.b13[rows, :i] = bias[:, 0::2].to(dtype)
        banks.b13[rows, i:] = bias[:, 1::2].to(dtype)
    else:  # a float GGUF: separate gate and up, [E, out, in]
        banks.w13[rows, :i] = _float(fetch, prefix + "gate_proj", (e, i, h)).to(dtype)
        banks.w13[rows, i:] = _float(fetch, prefix + "up_proj", (e, i, h)).to(dtype)
        banks.w2[rows] = _float(fetch, prefix + "down_proj", (e, h, i)).to(dtype)
        banks.b13[rows, :i] = _float(fetch, prefix + "gate_proj_bias", (e, i)).to(dtype)
        banks.b13[rows, i:] = _float(fetch, prefix + "up_proj_bias", (e, i)).to(dtype)
    banks.b2[rows] = _float(fetch, prefix + "down_proj_bias", (e, h)).to(dtype)
