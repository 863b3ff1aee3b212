"""Open a model directory: config, checkpoint, weights, decoder.

Contract: `load_decoder(model_dir, device, dtype=None, executor="auto", progress=None, threads=0)`
returns a ready `Decoder`; dtype defaults to the checkpoint's; `threads` sizes the CPU executor's pool.
All user-caused failures are `EngineError`s.
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine.config import ModelConfig
from engine.errors import ConfigError
from engine.model.decoder import Decoder
from engine.moe.executor import create_executor
from engine.weights.loader import Progress, load_weights
from engine.weights.reader import CheckpointReader

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
    if not model_dir.is_dir():
        raise ConfigError(f"{model_dir}: model directory not found")
    cfg = ModelConfig.from_file(model_dir / "config.json")
    dtype = dtype or parse_dtype(cfg.torch_dtype)
    reader = CheckpointReader(model_dir)
    try:
        weights = load_weights(cfg, reader, torch.device(device), dtype, progress)
    finally:
        reader.close()
    return Decoder(cfg, weights, create_executor(executor, weights.experts, device, threads))
