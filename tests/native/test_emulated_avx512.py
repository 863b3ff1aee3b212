"""The AVX-512 kernels, tested where the CPU has only AVX2 (CI and most desktops): the native module
rebuilt by `native/build.py --emulate-avx512` from the same kernel sources, every AVX-512 intrinsic
taken from SIMDe (native/src/avx512_target.h), runs the avx512 / avx512bf16 cases of the native
kernel tests in a subprocess, against the same float64 references. Where the CPU has AVX-512 those
cases also run natively in the main suite."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.native.conftest import _cpu_flags

ROOT = Path(__file__).resolve().parents[2]
TESTS = ["tests/native/test_moe_packed.py", "tests/native/test_kernels.py", "tests/native/test_executor.py"]
# the subprocess imports the emulated `native` package before pytest puts the repository on sys.path
LAUNCH = "import sys; sys.path.insert(0, sys.argv[1]); import native, pytest; sys.exit(pytest.main(sys.argv[2:]))"


@pytest.mark.slow
@pytest.mark.skipif(not {"avx2", "fma", "f16c"} <= _cpu_flags(), reason="the emulation runs on AVX2")
def test_avx512_kernels_pass_under_emulation() -> None:
    sys.path.insert(0, str(ROOT))
    try:
        from native.build import build
    finally:
        sys.path.remove(str(ROOT))
    out = ROOT / "native" / "build" / "emulate-avx512"
    build(jobs=2, verbose=False, emulate_avx512=out)
    env = dict(os.environ, FREETOKEN_NATIVE_EMULATED_AVX512="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    env.pop("PYTEST_XDIST_WORKER", None)
    cmd = [sys.executable, "-c", LAUNCH, str(out), "-p", "no:cacheprovider", "-q", "-rs", *TESTS, "-k", "avx512 and not env_var"]  # (that test starts its own interpreter)
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    tail = run.stdout[-4000:] + run.stderr[-2000:]
    assert run.returncode == 0, tail
    passed = int(re.search(r"(\d+) passed", run.stdout).group(1))  # type: ignore[union-attr]
    assert passed >= 120, tail  # every format on both AVX-512 paths, not a handful
    assert "skipped" not in run.stdout.splitlines()[-1], tail  # none skipped for want of the ISA
