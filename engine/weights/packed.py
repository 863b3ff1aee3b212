"""Fill packed expert banks (engine/weights/layout.py `PackedExpertBanks`) from a checkpoint.

Contract: `packed_format(reader, cfg)` says whether the checkpoint's routed experts are quantized
(their format name, or None for float experts, which load into `ExpertBanks` as before).
`load_packed_experts(reader, cfg, progress_layer)` returns the banks, one MoE layer at a time, each
layer's bytes copied as they are stored (a GGUF tensor's rows; an HF checkpoint's blocks rearranged
losslessly by engine/quant/hf.py), so host memory for the experts is their bytes in the file and no
float copy of an expert exists at any point. Each layer keeps its own formats (Q4_K_M mixes q4_k and
q6_k). Errors name the file, the tensor and its type: a gate and up of different types, a row size
that does not match the type, a type without a packed format. The banks' `file_bytes` counts the
rows read: a GGUF file's tensor bytes exactly (an HF checkpoint's fp8 / nvfp4 experts: their rows
with the scales folded in, within a few percent of the file's).
"""

from __future__ import annotations

from typing import Protocol

import torch

from engine.config import ModelConfig
from engine.errors import WeightError
from engine.quant.formats import FORMATS
from engine.weights.layout import PackedExpertBanks


class PackedSource(Protocol):
    """A reader that can hand out an expert matrix's packed rows (GgufReader, QuantizedReader)."""

    def expert_format(self, prefix: str) -> str | None: ...

    def expert_rows(self, prefix: str, proj: str, experts: int, rows: int, cols: int) -> tuple[str, torch.Tensor, torch.Tensor]:
        """(format, uint8 [E, rows, row_bytes], global scales f32 [E]) of `{prefix}{proj}` ("gate_proj",
        "up_proj", "down_proj"), each expert's matrix [rows, cols]."""
        ...


def _layer_prefix(cfg: ModelConfig, li: int) -> str:
    return f"{cfg.weight_prefix}layers.{li}.mlp.experts."


def packed_format(reader: object, cfg: ModelConfig) -> str | None:
    if not cfg.moe_layer_ids or not hasattr(reader, "expert_format"):
        return None
    fmt: str | None = reader.expert_format(_layer_prefix(cfg, cfg.moe_layer_ids[0]))
    return fmt


def load_packed_experts(reader: PackedSource, cfg: ModelConfig) -> PackedExpertBanks:
    h, e, i = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    banks = PackedExpertBanks.empty(e, h, i)
    for li in cfg.moe_layer_ids:
        ep = _layer_prefix(cfg, li)
        fg, gate, sg = reader.expert_rows(ep, "gate_proj", e, i, h)
        fu, up, su = reader.expert_rows(ep, "up_proj", e, i, h)
        fd, down, sd = reader.expert_rows(ep, "down_proj", e, h, i)
        if fg != fu:
            raise WeightError(f"{ep}gate_proj is {fg} but {ep}up_proj is {fu}: a layer's gate and up must share "
                              "one format (they are one packed matrix)")
        gate_up = torch.empty(e, 2 * i, gate.shape[-1], dtype=torch.uint8)
        gate_up[:, :i] = gate
        gate_up[:, i:] = up
        banks.gate_up.append(gate_up)
        owned = torch.empty(down.shape, dtype=torch.uint8)
        owned.copy_(down)  # out of the mapped file into the bank
        banks.down.append(owned)
        banks.fmt_gu.append(fg)
        banks.fmt_d.append(fd)
        banks.gscale.append(torch.stack([sg, su, sd], dim=1).float().contiguous())
        banks.file_bytes += gate.numel() + up.numel() + down.numel()
    return banks


def check_rows(what: str, fmt: str, rows: torch.Tensor, shape: tuple[int, ...], cols: int) -> torch.Tensor:
    """`rows` must be uint8 [*shape, row_bytes(fmt, cols)]; else a WeightError naming `what` and its type."""
    want = (*shape, FORMATS[fmt].row_bytes(cols, what))
    if rows.dtype != torch.uint8 or tuple(rows.shape) != want:
        raise WeightError(f"{what}: {fmt} data of shape {list(rows.shape)}, expected {list(want)} "
                          f"({cols} values per row in {fmt})")
    return rows
