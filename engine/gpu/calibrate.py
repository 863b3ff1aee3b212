"""Measure B_C (CPU expert executor) and B_P (host->device expert copies), alone and together.

Contract: `calibrate(CalibrationSpec)` -> `Calibration` (engine/gpu/calibration_store.py).
- B_C: the native CPU executor (`native.ftnative.moe_layer`) at batch 1, top-k experts per call,
  on a bank of random experts (`native.formats.random_experts`) far larger than the CPU caches,
  consecutive calls on disjoint expert sets (every call streams from DRAM, as decode does); GB/s
  counts the experts' weight (and scale) bytes. Best of `rounds`. With `packed` the experts are
  random valid blocks of `fmt` (gate_up) and `fmt_down` (down, default `fmt`) and the executor is
  the packed one the engine runs them with (`engine.moe.packed`: the native `moe_packed` kernel when
  built): a packed format's CPU rate per byte differs from bf16's, and so does the fetch ratio.
- B_P: per-row `copy_(non_blocking=True)` of every tensor of an expert (packed: its stored bytes)
  from a pinned host bank into
  a small device slot pool, as ExpertSlots.apply_copies and the prefill streamer copy, top-k
  experts per batch, synchronised per batch. Needs CUDA: without it, B_P is None and `note` says
  so (`NO_GPU`).
- contended: the copy loop together with the CPU loop (the CPU executor in a thread: moe_layer
  releases the GIL), each rate taken over its own calls during the shared window. Where the CPU
  alone does not saturate host memory these stay near the alone rates; where it does they split
  DRAM (BENCHMARKS.md).
`machine_key(spec, threads)` names the hardware the figures belong to.
"""

from __future__ import annotations

import platform
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

import torch

from engine.gpu.calibration_store import Calibration, MachineKey

NO_GPU = "no CUDA device: B_P (PCIe copies) not measured; every miss runs on the CPU (fetch ratio 0)"


@dataclass(frozen=True)
class CalibrationSpec:
    fmt: str = "bf16"
    hidden: int = 2048
    inter: int = 768
    top_k: int = 8
    threads: int = 0  # CPU executor threads; 0 = one per physical core
    bank_bytes: int = 2 * 10 ** 9  # host bank size: far beyond the CPU caches
    seconds: float = 1.0  # per measurement per round
    rounds: int = 3
    device: str = "cuda"  # where B_P copies go; ignored (no B_P) when CUDA is unavailable
    packed: bool = False  # fmt / fmt_down are packed formats (engine/quant/formats.py), run as stored
    fmt_down: str = ""  # packed: the down projection's format ("": fmt)

    @property
    def key_format(self) -> str:
        """The format part of the machine key: `fmt`, or `packed FMT_GU/FMT_D`."""
        return f"packed {self.fmt}/{self.fmt_down or self.fmt}" if self.packed else self.fmt


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def machine_key(spec: CalibrationSpec, threads: int, gpu: bool) -> MachineKey:
    name = torch.cuda.get_device_name(torch.device(spec.device)) if gpu else "none"
    return MachineKey(name, cpu_model(), threads, spec.key_format, spec.hidden, spec.inter)


def _rate(fn: Callable[[], int], seconds: float) -> float:
    """GB/s of fn (which returns the bytes it moved), over at least `seconds` and 3 calls."""
    fn()
    moved, n, t0 = 0, 0, time.perf_counter()
    while True:
        moved += fn()
        n += 1
        dt = time.perf_counter() - t0
        if n >= 3 and dt >= seconds:
            return moved / dt / 1e9


class _Loops:
    """The two measured loops, each one call = one batch of top-k experts."""

    def __init__(self, spec: CalibrationSpec, gpu: bool) -> None:
        from engine.moe.native import load_native
        from native.formats import random_experts

        self.ft = load_native()
        if spec.threads > 0 and self.ft.num_threads() != spec.threads:
            self.ft.set_num_threads(spec.threads)
        k = spec.top_k
        self.x = torch.randn(1, spec.hidden).to(torch.bfloat16)
        self.w = torch.rand(1, k)
        self.k, self.cpu_step, self.copy_step = k, 0, 0
        self.host: list[torch.Tensor] = []
        self.dev: list[torch.Tensor] = []
        self.packed_run: Callable[[torch.Tensor], None] | None = None
        self.packed_banks: list[torch.Tensor] = []  # packed: the gate_up and down banks
        if spec.packed:
            tensors = self._packed_bank(spec)
        else:
            probe = random_experts(spec.fmt, 1, spec.hidden, spec.inter)
            self.per_expert = probe.expert_nbytes()
            rows = max(int(spec.bank_bytes // self.per_expert), 2 * k)
            self.bank = random_experts(spec.fmt, rows, spec.hidden, spec.inter, seed=0)
            self.out = torch.empty(1, spec.hidden, dtype=torch.bfloat16)
            tensors = [t for t in (self.bank.w13, self.bank.w2, self.bank.s13, self.bank.s2) if t is not None]
        self.sets = [torch.arange(j * k, (j + 1) * k).reshape(1, k) for j in range(tensors[0].shape[0] // k)]
        if gpu:
            # the fetch path reads a pinned bank; a second copy of the bank, pinned, stands in for it
            self.host = [t.pin_memory() for t in tensors]
            self.dev = [torch.empty((k, *t.shape[1:]), dtype=t.dtype, device=spec.device) for t in tensors]
            self.stream = torch.cuda.Stream(torch.device(spec.device))

    def _packed_bank(self, spec: CalibrationSpec) -> list[torch.Tensor]:
        """Random valid packed experts (gate_up and down banks) and the packed executor."""
        from engine.moe.packed import native_moe_packed, torch_moe_packed
        from engine.quant.formats import format_of

        fgu, fd = format_of(spec.fmt), format_of(spec.fmt_down or spec.fmt)
        self.per_expert = (2 * spec.inter * fgu.row_bytes(spec.hidden, "hidden size")
                           + spec.hidden * fd.row_bytes(spec.inter, "expert intermediate size"))
        rows = max(int(spec.bank_bytes // self.per_expert), 2 * spec.top_k)
        gen = torch.Generator().manual_seed(0)
        gate_up = fgu.random_rows((rows, 2 * spec.inter), spec.hidden, gen)
        down = fd.random_rows((rows, spec.hidden), spec.inter, gen)
        gscale = torch.ones(rows, 3)
        kernel = native_moe_packed() or torch_moe_packed
        self.out = torch.zeros(1, spec.hidden)
        w = self.w

        def run(ids: torch.Tensor) -> None:
            kernel(self.x, ids.to(torch.int32), w, gate_up, fgu.name, down, fd.name, gscale, self.out)

        self.packed_run = run
        self.packed_banks = [gate_up, down]
        return self.packed_banks

    def cpu_call(self) -> int:
        ids = self.sets[self.cpu_step % len(self.sets)]
        self.cpu_step += 1
        if self.packed_run is not None:
            self.packed_run(ids)
        else:
            self.ft.moe_layer(self.x, ids, self.w, self.bank, out=self.out)
        return self.k * self.per_expert

    def copy_call(self) -> int:
        n = len(self.sets)
        # walk the bank from the far end so that a concurrent CPU loop reads other experts
        first = (n - 1 - self.copy_step % n) * self.k
        self.copy_step += 1
        with torch.cuda.stream(self.stream):
            for slot in range(self.k):
                for d, h in zip(self.dev, self.host, strict=True):
                    d[slot].copy_(h[first + slot], non_blocking=True)
        self.stream.synchronize()
        return self.k * self.per_expert

    def together(self, seconds: float, gpu_call: Callable[[], int]) -> tuple[float, float]:
        """(CPU GB/s, GPU loop GB/s) while the CPU loop and `gpu_call`'s loop run."""
        stop = threading.Event()
        cpu: list[float] = []

        def cpu_loop() -> None:
            moved, t0 = 0, time.perf_counter()
            while not stop.is_set():
                moved += self.cpu_call()
            cpu.append(moved / (time.perf_counter() - t0) / 1e9)

        t = threading.Thread(target=cpu_loop, daemon=True)
        t.start()
        try:
            pcie = _rate(gpu_call, seconds)
        finally:
            stop.set()
            t.join()
        return cpu[0], pcie


def calibrate(spec: CalibrationSpec) -> Calibration:
    gpu = spec.device.startswith("cuda") and torch.cuda.is_available()
    loops = _Loops(spec, gpu)
    b_cpu = max(_rate(loops.cpu_call, spec.seconds) for _ in range(spec.rounds))
    b_pcie = cpu_c = pcie_c = None
    if gpu:
        b_pcie = max(_rate(loops.copy_call, spec.seconds) for _ in range(spec.rounds))
        pairs = [loops.together(spec.seconds, loops.copy_call) for _ in range(spec.rounds)]
        cpu_c, pcie_c = max(pairs, key=lambda p: p[0] + p[1])  # best combined round
    return Calibration(
        key=machine_key(spec, loops.ft.num_threads(), gpu),
        b_cpu=round(b_cpu, 3), b_pcie=_round(b_pcie), b_cpu_contended=_round(cpu_c), b_pcie_contended=_round(pcie_c),
        measured_at=datetime.now(UTC).isoformat(timespec="seconds"),
        note="" if gpu else NO_GPU,
    )


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 3)
