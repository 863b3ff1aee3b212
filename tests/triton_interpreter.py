"""Run a test module's kernel checks under Triton's interpreter, on the CPU: the module is run as a
script in a child process with TRITON_INTERPRET=1 (read when kernels are defined, hence the child)
and must print "ok" last. Skips when triton is not installed (CI); on the GPU machine it runs too."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_in_interpreter(script: str) -> None:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(REPO), *sys.path[1:]])}
    run = subprocess.run([sys.executable, script], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout[-2000:] + run.stderr[-4000:]
