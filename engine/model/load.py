"""Open a model directory: config, checkpoint, weights, decoder.

Contract: `load_decoder(model_dir, device, dtype=None, executor="auto", progress=None, threads=0)`
returns a ready `Decoder`; dtype defaults to the checkpoint's; `threads` sizes the CPU executor's pool.
`model_dir` is a Hugging Face checkpoint directory (a `quantization_config` read by
engine/weights/hf_quant.py), or a `.gguf` file (engine/weights/gguf_reader.py: the config comes from
its metadata). Quantized experts stay packed; their bytes are logged next to bf16's. All user-caused
failures are `EngineError`s.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from engine.config import ModelConfig
from engine.errors import ConfigError
from engine.model.decoder import Decoder
from engine.moe.executor import create_executor
from engine.weights.gguf_reader import GgufReader
from engine.weights.hf_quant import open_quantized
from engine.weights.layout import PackedExpertBanks
from engine.weights.loader import Progress, load_weights
from engine.weights.reader import CheckpointReader

log = logging.getLogger("freetoken.engine")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name.removeprefix("torch.")]
    except KeyError:
        raise ConfigError(f"unsupported dtype {name!r} (supported: {', '.join(_DTYPES)})") from None


def load_decoder(
    model_dir: Path | str,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    executor: str = "auto",
    progress: Progress | None = None,
    threads: int = 0,
) -> Decoder:
    model_dir = Path(model_dir)
    reader: Any  # CheckpointReader, GgufReader or a QuantizedReader over a CheckpointReader
    if model_dir.suffix == ".gguf" and model_dir.is_file():
        reader = GgufReader(model_dir)
        cfg = ModelConfig.from_dict(reader.config(), source=str(model_dir))
    elif model_dir.is_dir():
        cfg = ModelConfig.from_file(model_dir / "config.json")
        raw = json.loads((model_dir / "config.json").read_text())
        reader = open_quantized(CheckpointReader(model_dir), raw, model_dir / "config.json")
    else:
        raise ConfigError(f"{model_dir}: model directory (or .gguf file) not found")
    dtype = dtype or parse_dtype(cfg.torch_dtype)
    try:
        weights = load_weights(cfg, reader, torch.device(device), dtype, progress)
    finally:
        reader.close()
    banks = weights.experts
    if isinstance(banks, PackedExpertBanks):
        fmts = "/".join(sorted({*banks.fmt_gu, *banks.fmt_d}))
        in_file = f", {banks.file_bytes / 2**30:.2f} GiB in the file" if banks.file_bytes else ""
        log.info("experts packed as stored (%s): %.2f GiB in host memory (%.2f GiB in bf16%s)", fmts,
                 banks.total_bytes / 2**30, banks.bf16_bytes / 2**30, in_file)
    return Decoder(cfg, weights, create_executor(executor, banks, device, threads))
