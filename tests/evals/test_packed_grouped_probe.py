"""evals/gpu/packed_grouped_probe.py (the A/B timing of the packed grouped prefill kernels: the
engine's "tf32x3" kernel against the bf16 candidate of engine/gpu/quant/grouped_bf16.py) on a CPU:
its --help, its argument checks, and a tiny run of both through Triton's interpreter (groups of 32
and 16, offset formats, f32 and bf16 x): one JSON line per case, both results finite and within
float32 rounding of each other, and the table last."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from triton_interpreter import run_in_interpreter

REPO = Path(__file__).resolve().parents[2]
TINY = ["--device", "cpu", "--tokens", "8", "--hidden", "64", "--inter", "32", "--experts", "4", "--k", "2",
        "--iters", "1", "--rounds", "1", "--cases", "q4_1/nvfp4,q8_0/q8_0", "--dtype", "f32"]


def test_probe_help_on_a_cpu_machine() -> None:
    r = subprocess.run([sys.executable, "-m", "evals.gpu.packed_grouped_probe", "--help"], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "--tokens" in r.stdout and "--cases" in r.stdout


def test_probe_arguments() -> None:
    from evals.gpu.packed_grouped_probe import Case, parse

    a = parse([])
    assert (a.hidden, a.inter, a.experts, a.k, a.tokens) == (2048, 768, 128, 8, 8192)
    assert a.pairs == [("q4_k", "q6_k"), ("q8_0", "q8_0"), ("mxfp4", "mxfp4")]
    for bad in (["--cases", "q4_k"], ["--cases", "q4_k/q7_k"], ["--cases", "bf16/bf16"]):
        with pytest.raises(SystemExit):
            parse(bad)
    tiny = parse(TINY)
    c = Case("q4_1", "nvfp4", tiny)  # builds on the CPU without running a kernel
    assert c.x.shape == (8, 64) and c.ids.shape == (8, 2) and c.slots.data.shape[0] == 5
    assert all(len(set(row)) == 2 for row in c.ids.tolist())


def test_probe_tiny_run_in_triton_interpreter() -> None:
    run_in_interpreter(__file__)


if __name__ == "__main__":  # the interpreter test's child
    import contextlib
    import io

    from evals.gpu.packed_grouped_probe import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rows = main(TINY)
    lines = out.getvalue().strip().splitlines()
    assert [json.loads(line)["case"] for line in lines[:2]] == ["q4_1/nvfp4", "q8_0/q8_0"]
    assert lines[2].startswith("case") and len(lines) == 5
    for r in rows:
        assert r["finite"] and r["max_rel_diff"] < 1e-5 and r["old_ms"] > 0 and r["new_ms"] > 0, r
    print("ok")
