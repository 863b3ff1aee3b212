"""Calibration (engine/gpu/calibrate.py, calibration_store.py): the store round-trips records per
machine key, merges keys, survives a corrupt or foreign file, reads records that carry the retired
fetch kernel's rate; the fetch ratio picks the contended
form when it was measured, else the paper's, else 0; and on a machine without CUDA a real
measurement gives a positive B_C, no B_P and says why.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.gpu.calibrate import NO_GPU, CalibrationSpec, calibrate
from engine.gpu.calibration_store import Calibration, MachineKey, load, load_all, save
from engine.moe.native import native_unsupported
from engine.weights.layout import ExpertBanks

KEY = MachineKey("NVIDIA H200", "Xeon", 8, "bf16", 2048, 768)


def test_store_round_trip_and_merge(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "calibration.json"
    assert load(path, KEY) is None and load_all(path) == {}
    a = Calibration(KEY, 50.0, 55.0, 49.0, 52.0, measured_at="2026-11-30T10:00:00+00:00")
    save(path, a)
    assert load(path, KEY) == a
    other = MachineKey("none", "Xeon", 2, "bf16", 2048, 768)
    b = Calibration(other, 5.0, note=NO_GPU)
    save(path, b)
    assert load(path, KEY) == a and load(path, other) == b
    a2 = Calibration(KEY, 51.0, 54.0, 48.0, 50.0, measured_at="2026-11-30T11:00:00+00:00")
    save(path, a2)  # same machine: replaced, others kept
    assert load_all(path) == {KEY.as_string(): a2, other.as_string(): b}
    assert [p.name for p in path.parent.iterdir()] == ["calibration.json"]  # no temporary left


V1_RECORD = ('{"version": 1, "machines": {"k": {"key": {"gpu": "NVIDIA H200", "cpu": "Xeon", "threads": 8, "fmt": "bf16", '
             '"hidden": 2048, "inter": 768}, "b_cpu": 80.0, "b_pcie": 52.0, "b_cpu_contended": 66.0, '
             '"b_pcie_contended": 51.0, "measured_at": "", "note": ""}}}')


# a version-1 store (no decode fetch rate) is measured again rather than read with the bulk ratio
@pytest.mark.parametrize("text", ["not json", '{"version": 99, "machines": {}}', "[1, 2]", '{"version": 1}', V1_RECORD])
def test_unreadable_store_is_empty_and_replaced(tmp_path: Path, text: str) -> None:
    path = tmp_path / "calibration.json"
    path.write_text(text)
    assert load_all(path) == {}
    save(path, Calibration(KEY, 1.0))
    assert load(path, KEY) == Calibration(KEY, 1.0)


def test_ratio_forms() -> None:
    # host-issued copies move at the bulk copies' contended rate
    assert Calibration(KEY, 50.0, 55.0, 49.0, 52.0).ratio() == pytest.approx(52 / 101)  # contended
    assert Calibration(KEY, 110.0, 55.0).ratio() == pytest.approx(0.5)  # paper: B_P / B_H
    assert Calibration(KEY, 50.0, 55.0).ratio() == 1.0
    assert Calibration(KEY, 50.0).ratio() == 0.0  # no copy path


def test_measures_cpu_and_reports_missing_gpu() -> None:
    probe = ExpertBanks(torch.zeros(1, 2, 2, dtype=torch.bfloat16), torch.zeros(1, 2, 1, dtype=torch.bfloat16), 1)
    why = native_unsupported(probe, "cpu")
    if why:
        pytest.skip(why)
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA (test_gpu_cache_cuda.py measures B_P)")
    cal = calibrate(CalibrationSpec(hidden=128, inter=64, top_k=2, bank_bytes=4_000_000, seconds=0.02, rounds=1))
    assert cal.b_cpu > 0
    assert cal.b_pcie is None and cal.b_pcie_contended is None and cal.b_cpu_contended is None
    assert cal.note == NO_GPU and cal.ratio() == 0.0
    assert cal.key.gpu == "none" and cal.key.threads >= 1 and (cal.key.hidden, cal.key.inter) == (128, 64)


def test_a_record_with_the_retired_fetch_kernel_rate_is_read() -> None:
    """Version-2 records written while the fetch kernel ran carry its rate (B_F): read, dropped, and
    the ratio is the host-issued copies' (docs/gpu-tier.md "Retired paths")."""
    record = {"key": {"gpu": "NVIDIA H200", "cpu": "Xeon", "threads": 8, "fmt": "bf16", "hidden": 2048, "inter": 768},
              "b_cpu": 50.0, "b_pcie": 55.0, "b_cpu_contended": 49.0, "b_pcie_contended": 52.0, "b_fetch": 47.0,
              "b_fetch_contended": 43.0, "b_cpu_fetch_contended": 66.0, "fetch_batch": 2, "measured_at": "", "note": ""}
    cal = Calibration.from_json(record)
    assert cal == Calibration(KEY, 50.0, 55.0, 49.0, 52.0) and cal.ratio() == pytest.approx(52 / 101)


def test_packed_formats_are_calibrated_with_the_packed_executor(tmp_path: Path) -> None:
    """A packed bank's calibration runs its own formats through the packed executor (the CPU call
    computes the real layer: equal to the torch reference on the same experts), counts packed bytes,
    and is stored under a key naming the pair; the fetch ratio of a packed bank resolves to it."""
    from engine.gpu.calibrate import _Loops
    from engine.gpu.setup import resolve_fetch_ratio
    from engine.moe.packed import torch_moe_packed
    from engine.options import EngineOptions
    from engine.quant.formats import format_of
    from engine.weights.layout import PackedExpertBanks

    hidden, inter, k = 256, 256, 2
    spec = CalibrationSpec(fmt="q4_k", fmt_down="q6_k", packed=True, hidden=hidden, inter=inter, top_k=k,
                           bank_bytes=3_000_000, seconds=0.02, rounds=1, device="cpu")
    loops = _Loops(spec, gpu=False)
    gate_up, down = (format_of(f) for f in ("q4_k", "q6_k"))
    per_expert = 2 * inter * gate_up.row_bytes(hidden, "h") + hidden * down.row_bytes(inter, "i")
    assert loops.cpu_call() == k * per_expert
    ids = loops.sets[0].to(torch.int32)
    bank = loops.packed_banks
    want = torch.zeros(1, hidden)
    torch_moe_packed(loops.x, ids, loops.w, bank[0], "q4_k", bank[1], "q6_k", torch.ones(bank[0].shape[0], 3), want)
    torch.testing.assert_close(loops.out, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    cal = calibrate(spec)
    assert cal.b_cpu > 0 and cal.key.fmt == "packed q4_k/q6_k" and (cal.key.hidden, cal.key.inter) == (hidden, inter)

    banks = PackedExpertBanks.empty(4, hidden, inter)
    g = torch.Generator().manual_seed(1)
    for fd in ("q6_k", "q4_k", "q6_k"):  # the most common pair is q4_k / q6_k
        banks.gate_up.append(gate_up.random_rows((4, 2 * inter), hidden, g))
        banks.down.append(format_of(fd).random_rows((4, hidden), inter, g))
        banks.fmt_gu.append("q4_k")
        banks.fmt_d.append(fd)
        banks.gscale.append(torch.ones(4, 3))
    path = tmp_path / "calibration.json"
    opts = EngineOptions(calibration_file=str(path), device="cpu")
    assert resolve_fetch_ratio(banks, opts) == 0.0  # no CUDA here: every miss on the CPU
    (stored,) = load_all(path).values()
    assert stored.key.fmt == "packed q4_k/q6_k" and stored.b_cpu > 0

