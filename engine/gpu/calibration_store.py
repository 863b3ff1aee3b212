"""Measured bandwidths of one machine, and their JSON store.

Contract: `Calibration` (frozen) holds what engine/gpu/calibrate.py measures for one
`MachineKey` (GPU name, CPU model, CPU executor threads, expert format and shape): B_C, the CPU
expert executor's weight throughput at batch 1; B_P, pinned host->device expert copies in bulk
batches (what prefill streams, and the decode steps' host-issued fetches; the bounds use it); each
alone and while the CPU executor runs too (contended; None where not measured, e.g. no CUDA
device). `ratio()` is the fetch ratio the decode split uses (engine/gpu/policy.py): the contended
B_P' / (B_P' + B_C') when measured, else the paper's B_P / B_H from the rates alone, else 0 (no
copy path: every miss on the CPU). Records written before the fetch kernel was retired carry its
rate (B_F) too: read, and dropped.
`save(path, cal)` merges one record into the file (written atomically: a temporary file then a
rename), `load(path, key)` returns the record for a key or None, `load_all(path)` every record.
The file is {"version": 2, "machines": {key string: record}}; an unreadable or foreign file is
treated as empty on load and replaced on save. GB/s are 1e9 bytes per second.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from engine.gpu.policy import fetch_ratio

VERSION = 2  # version-1 files are measured again
# the retired fetch kernel's rates (docs/gpu-tier.md), in version-2 records written before it went
_RETIRED = ("b_fetch", "b_fetch_contended", "b_cpu_fetch_contended", "fetch_batch")


@dataclass(frozen=True)
class MachineKey:
    gpu: str  # torch.cuda.get_device_name, or "none"
    cpu: str  # CPU model name
    threads: int  # CPU executor threads
    fmt: str  # expert format: bf16, f32, or `packed GATE_UP/DOWN` (CalibrationSpec.key_format)
    hidden: int
    inter: int

    def as_string(self) -> str:
        return f"{self.gpu} | {self.cpu} | {self.threads} threads | {self.fmt} {self.hidden}x{self.inter}"


@dataclass(frozen=True)
class Calibration:
    key: MachineKey
    b_cpu: float  # GB/s, CPU executor alone
    b_pcie: float | None = None  # GB/s, host->device expert copies alone
    b_cpu_contended: float | None = None  # GB/s, CPU executor while copies run
    b_pcie_contended: float | None = None  # GB/s, copies while the CPU executor runs
    measured_at: str = ""
    note: str = ""

    def ratio(self) -> float:
        """The decode split: host-issued copies move at the bulk copies' contended rate B_P'."""
        if self.b_cpu_contended is not None and self.b_pcie_contended is not None:
            return fetch_ratio(self.b_pcie_contended, self.b_cpu_contended, contended=True)
        if self.b_pcie is not None:
            return fetch_ratio(self.b_pcie, self.b_cpu, contended=False)
        return 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Calibration:
        fields = {k: v for k, v in d.items() if k not in _RETIRED}
        return cls(**{**fields, "key": MachineKey(**d["key"])})


def load_all(path: Path) -> dict[str, Calibration]:
    try:
        data = json.loads(Path(path).read_text())
        if data.get("version") != VERSION:
            return {}
        return {k: Calibration.from_json(v) for k, v in data["machines"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def load(path: Path, key: MachineKey) -> Calibration | None:
    return load_all(path).get(key.as_string())


def save(path: Path, cal: Calibration) -> None:
    path = Path(path)
    records = load_all(path)
    records[cal.key.as_string()] = cal
    data = {"version": VERSION, "machines": {k: v.to_json() for k, v in records.items()}}
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".calibration-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
