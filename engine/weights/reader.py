"""Read tensors from a Hugging Face checkpoint directory (single or sharded safetensors).

Contract: `CheckpointReader(model_dir)` indexes every tensor name to its file, checking each
file's header against its size first, so a missing or truncated shard fails at open with a
`WeightError` naming the file. `get(name)` returns the tensor (CPU, stored dtype); `has(name)`,
`shape(name)` and `names()` answer without reading data.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from engine.errors import WeightError

_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def _read_header(path: Path) -> dict[str, Any]:
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            raw_len = f.read(8)
            if len(raw_len) < 8:
                raise WeightError(f"{path}: truncated safetensors file ({size} bytes, no header)")
            (hlen,) = struct.unpack("<Q", raw_len)
            if hlen > size - 8:
                raise WeightError(f"{path}: truncated safetensors file (header of {hlen} bytes, file {size})")
            header = json.loads(f.read(hlen))
    except FileNotFoundError:
        raise WeightError(f"{path}: file not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise WeightError(f"{path}: not a safetensors file (bad header)") from None
    end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + hlen + end > size:
        raise WeightError(f"{path}: truncated safetensors file (expected {8 + hlen + end} bytes, found {size})")
    return header


class CheckpointReader:
    def __init__(self, model_dir: Path) -> None:
        self.model_dir = Path(model_dir)
        self._where: dict[str, Path] = {}
        self._meta: dict[str, dict[str, Any]] = {}
        self._handles: dict[Path, Any] = {}
        index = self.model_dir / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError):
                raise WeightError(f"{index}: malformed index (no weight_map)") from None
            files = sorted({self.model_dir / f for f in weight_map.values()})
        else:
            files = sorted(self.model_dir.glob("*.safetensors"))
            if not files:
                raise WeightError(f"{self.model_dir}: no model.safetensors or model.safetensors.index.json")
        for path in files:
            header = _read_header(path)
            for name, meta in header.items():
                if name != "__metadata__":
                    self._where[name] = path
                    self._meta[name] = meta
        if index.exists():
            for name, fname in weight_map.items():
                if name not in self._where:
                    raise WeightError(f"{self.model_dir / fname}: tensor {name!r} listed in the index is missing")

    def names(self) -> list[str]:
        return list(self._where)

    def has(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._meta[name]["shape"])

    def file_of(self, name: str) -> Path:
        return self._where[name]

    def nbytes(self, name: str) -> int:
        n = _DTYPE_BYTES.get(self._meta[name]["dtype"], 4)
        for d in self._meta[name]["shape"]:
            n *= d
        return n

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise WeightError(f"{self.model_dir}: missing tensor {name!r}")
        path = self._where[name]
        handle = self._handles.get(path)
        if handle is None:
            try:
                handle = self._handles[path] = safe_open(str(path), framework="pt")
            except Exception as e:  # safetensors raises its own error types
                raise WeightError(f"{path}: cannot open ({e})") from None
        return handle.get_tensor(name)

    def close(self) -> None:
        self._handles.clear()
