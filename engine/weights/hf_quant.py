"""Hugging Face checkpoints with a `quantization_config`: experts packed, dense tensors dequantized.

Contract: `open_quantized(reader, config)` returns `reader` itself when config.json has no
`quantization_config`, else a `QuantizedReader` over it; an unsupported method is a `ConfigError`
naming config.json and the method. Supported:
- `quant_method: fp8` (block-scaled e4m3, `weight_block_size` [b0, 128]; `<name>_scale_inv` beside
  each quantized `<name>`): experts -> fp8 rows, dense tensors -> float32 (weight x scale, as
  transformers dequantizes);
- `quant_method: modelopt` with `quant_algo: NVFP4` (`weight` uint8 [N, K/2], `weight_scale` e4m3
  [N, K/16], `weight_scale_2` f32, `input_scale` unused): experts -> nvfp4 rows with the global
  scale in the bank's gscale, dense tensors -> float32;
- `quant_method: mxfp4` (gpt-oss: `experts.gate_up_proj_blocks` / `_scales` with gate and up rows
  interleaved, `experts.down_proj_blocks` / `_scales`): experts -> mxfp4 rows, gate rows first.
The reader answers like `CheckpointReader` (names, has, shape, get, ...) under the unquantized names,
plus `expert_format` / `expert_rows` for engine/weights/packed.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine.errors import ConfigError, WeightError
from engine.quant.formats import FORMATS
from engine.quant.hf import fp8_rows, mxfp4_rows, nvfp4_rows
from engine.weights.packed import check_rows
from engine.weights.reader import CheckpointReader

_METHODS = "fp8, mxfp4, modelopt (NVFP4)"


def open_quantized(reader: CheckpointReader, config: dict[str, Any], config_path: Path) -> Any:
    q = config.get("quantization_config") or config.get("text_config", {}).get("quantization_config")
    if not q:
        return reader
    method = str(q.get("quant_method", "")).lower()
    if method == "modelopt" and str(q.get("quant_algo", "")).upper() == "NVFP4":
        return QuantizedReader(reader, "nvfp4", q)
    if method in ("fp8", "mxfp4"):
        return QuantizedReader(reader, method, q)
    algo = f" (quant_algo {q.get('quant_algo')!r})" if q.get("quant_algo") else ""
    raise ConfigError(f"{config_path}: quantization_config.quant_method {method!r}{algo} is not supported "
                      f"(supported: {_METHODS})")


class QuantizedReader:
    def __init__(self, reader: CheckpointReader, fmt: str, qcfg: dict[str, Any]) -> None:
        self.reader, self.fmt = reader, fmt
        self.model_dir = reader.model_dir
        block = qcfg.get("weight_block_size") or [128, 128]
        self.block = (int(block[0]), int(block[1]))

    # ------------------------------------------------------------ CheckpointReader's interface
    def names(self) -> list[str]:
        return self.reader.names()

    def has(self, name: str) -> bool:
        return self.reader.has(name)

    def file_of(self, name: str) -> Path:
        return self.reader.file_of(name)

    def nbytes(self, name: str) -> int:
        return self.reader.nbytes(name)

    def close(self) -> None:
        self.reader.close()

    def _nvfp4(self, name: str) -> bool:
        return self.fmt == "nvfp4" and name.endswith(".weight") and self.reader.has(name + "_scale_2")

    def _fp8(self, name: str) -> bool:
        return self.fmt == "fp8" and self.reader.has(name + "_scale_inv")

    def shape(self, name: str) -> tuple[int, ...]:
        shape = self.reader.shape(name)
        return (*shape[:-1], shape[-1] * 2) if self._nvfp4(name) else shape

    def get(self, name: str) -> torch.Tensor:
        if self._fp8(name):
            w = self.reader.get(name)
            rows = fp8_rows(w, self.reader.get(name + "_scale_inv"), self.block, f"{self.file_of(name)}: {name}")
            return FORMATS["fp8"].dequantize(rows, w.shape[-1])
        if self._nvfp4(name):
            return FORMATS["nvfp4"].dequantize(self._nvfp4_rows(name), self.shape(name)[-1],
                                               self.reader.get(name + "_scale_2").float())
        return self.reader.get(name)

    def _nvfp4_rows(self, name: str) -> torch.Tensor:
        return nvfp4_rows(self.reader.get(name), self.reader.get(name[: -len("weight")] + "weight_scale"),
                          f"{self.file_of(name)}: {name}")

    # ------------------------------------------------------------ packed experts
    def expert_format(self, prefix: str) -> str | None:
        if self.fmt == "mxfp4":
            return "mxfp4" if self.reader.has(prefix + "gate_up_proj_blocks") else None
        first = prefix + "0.gate_proj.weight"
        return self.fmt if self._fp8(first) or self._nvfp4(first) else None

    def expert_rows(self, prefix: str, proj: str, experts: int, rows: int, cols: int) -> tuple[str, torch.Tensor, torch.Tensor]:
        if self.fmt == "mxfp4":
            return self._mxfp4_rows(prefix, proj, experts, rows, cols)
        fmt = FORMATS[self.fmt]
        out = torch.empty(experts, rows, fmt.row_bytes(cols, f"{prefix}{proj}"), dtype=torch.uint8)
        gscale = torch.ones(experts)
        for e in range(experts):
            name = f"{prefix}{e}.{proj}.weight"
            if not self.reader.has(name):
                raise WeightError(f"{self.model_dir}: missing tensor {name!r}")
            if self.shape(name) != (rows, cols):
                raise WeightError(f"{self.file_of(name)}: tensor {name!r} has shape {list(self.shape(name))}, "
                                  f"expected {[rows, cols]}")
            what = f"{self.file_of(name)}: tensor {name!r} ({self.fmt})"
            if self.fmt == "fp8":
                if not self._fp8(name):
                    raise WeightError(f"{what}: no {name}_scale_inv beside it")
                packed = fp8_rows(self.reader.get(name), self.reader.get(name + "_scale_inv"), self.block, what)
            else:
                if not self._nvfp4(name):
                    raise WeightError(f"{what}: no {name}_scale_2 beside it")
                packed = self._nvfp4_rows(name)
                gscale[e] = self.reader.get(name + "_scale_2").float().reshape(())
            out[e] = check_rows(what, self.fmt, packed, (rows,), cols)
        return self.fmt, out, gscale

    def _mxfp4_rows(self, prefix: str, proj: str, experts: int, rows: int, cols: int) -> tuple[str, torch.Tensor, torch.Tensor]:
        fused = proj != "down_proj"
        base = prefix + ("gate_up_proj" if fused else "down_proj")
        for sfx in ("_blocks", "_scales"):
            if not self.reader.has(base + sfx):
                raise WeightError(f"{self.model_dir}: missing tensor {base + sfx!r}")
        what = f"{self.file_of(base + '_blocks')}: tensor {base + '_blocks'!r} (mxfp4)"
        packed = mxfp4_rows(self.reader.get(base + "_blocks"), self.reader.get(base + "_scales"), what)
        if fused:  # gate and up rows interleave (gpt-oss): gate = even rows, up = odd rows
            packed = packed[:, 0::2] if proj == "gate_proj" else packed[:, 1::2]
        return "mxfp4", check_rows(what, "mxfp4", packed.contiguous(), (experts, rows), cols), torch.ones(experts)
