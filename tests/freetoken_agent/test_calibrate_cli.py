"""`freetoken-agent calibrate` as a user runs it (subprocess): it measures, stores the record in
FREETOKEN_CACHE_DIR, prints it (text and --json), `--show` reads it back, and without a CUDA
device it says that B_P was not measured. Bad arguments are one `error:` line (those cases, and
`--show` with nothing stored, call the CLI's `main` in the test process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def run_cli(*args: str, cache: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.update(FREETOKEN_CACHE_DIR=str(cache), PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "freetoken_agent", *args], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=300)


def test_calibrate_stores_and_shows(tmp_path: Path) -> None:
    try:
        from native import ftnative  # noqa: F401
    except ImportError as exc:
        pytest.skip(str(exc))
    fast = ("--shape", "qwen3.6-35b-a3b", "--bank-gb", "0.03", "--seconds", "0.02", "--rounds", "1")
    proc = run_cli("calibrate", *fast, "--json", cache=tmp_path)
    assert proc.returncode == 0, proc.stderr
    rec = json.loads(proc.stdout)
    assert rec["path"] == str(tmp_path / "calibration.json") and rec["b_cpu"] > 0
    assert rec["key"]["hidden"] == 2048 and rec["key"]["inter"] == 512 and rec["key"]["fmt"] == "bf16"
    # the ratio shown is the decode split's: the host-issued copies' contended form
    from engine.gpu.calibration_store import Calibration

    stored = Calibration.from_json({k: v for k, v in rec.items() if k not in ("ratio", "path")})
    assert rec["ratio"] == stored.ratio()
    if not torch.cuda.is_available():
        assert rec["b_pcie"] is None and rec["ratio"] == 0.0 and "no CUDA device" in rec["note"]

    shown = run_cli("calibrate", "--show", "--json", cache=tmp_path)
    assert shown.returncode == 0, shown.stderr
    machines = json.loads(shown.stdout)["machines"]
    assert len(machines) == 1 and next(iter(machines.values()))["b_cpu"] == rec["b_cpu"]

    text = run_cli("calibrate", *fast, "--threads", "1", cache=tmp_path)
    assert text.returncode == 0, text.stderr
    assert "B_C  CPU experts alone:" in text.stdout and "stored in" in text.stdout
    if not torch.cuda.is_available():
        assert "not measured" in text.stdout and "no CUDA device" in text.stdout
    assert len(json.loads((tmp_path / "calibration.json").read_text())["machines"]) == 2  # 1 thread: another key


def run_main(*args: str) -> subprocess.CompletedProcess[str]:
    """`main(args)` in the test process (what the subprocess runs; an exception it lets escape fails
    the test), with the exit status and output the subprocess would give; the caller sets
    FREETOKEN_CACHE_DIR and passes capsys' readouterr."""
    from freetoken_agent.cli import main

    try:
        code = main(list(args))
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    return subprocess.CompletedProcess(["freetoken-agent", *args], code)


def test_show_without_records_and_bad_args(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FREETOKEN_CACHE_DIR", str(tmp_path))
    assert run_main("calibrate", "--show").returncode == 0
    assert "no calibration stored" in capsys.readouterr().out
    assert run_main("calibrate", "--threads", "-2").returncode != 0
    err = capsys.readouterr().err
    assert err.strip().startswith("error:") and "Traceback" not in err
    assert run_main("calibrate", "--shape", "nope").returncode == 2
    assert capsys.readouterr().err.count("\n") == 1
    assert run_main("calibrate", "--format", "bf16", "--format-down", "q6_k").returncode != 0
    err = capsys.readouterr().err
    assert err.strip().startswith("error:") and "--format-down" in err and err.count("\n") == 1


def test_calibrate_a_packed_format(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """`--format q4_k --format-down q6_k` measures the packed executor on those formats and stores the
    record under the key a packed model's load looks up."""
    monkeypatch.setenv("FREETOKEN_CACHE_DIR", str(tmp_path))
    fast = ("--shape", "qwen3.6-35b-a3b", "--bank-gb", "0.03", "--seconds", "0.02", "--rounds", "1", "--threads", "1")
    assert run_main("calibrate", "--format", "q4_k", "--format-down", "q6_k", *fast, "--json").returncode == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["key"]["fmt"] == "packed q4_k/q6_k" and rec["b_cpu"] > 0 and rec["key"]["threads"] == 1
    from engine.quant.formats import FORMATS
    from freetoken_agent.calibrate import PACKED_FORMATS

    assert sorted(PACKED_FORMATS) == sorted(set(FORMATS) - {"bf16"})  # the CLI's torch-free list is complete
