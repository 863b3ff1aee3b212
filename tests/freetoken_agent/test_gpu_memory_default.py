"""--gpu-memory's default (issue 6: "what is free on the device, less a margin"): 'auto' resolves on
a CUDA device to free memory plus what this process already holds there, less 5 % of the device (at
least 1 GiB), and to no expert cache on a CPU engine; 'off' / 0 turn the cache off; a bad value is a
one-line CLI error. The arithmetic runs against stand-in device readings here; the real device
(the cache attached by default, its peak under the automatic cap) is the `gpu` test at the end."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.gpu.budget import auto_gpu_memory, auto_margin
from freetoken_agent.argtypes import gpu_memory_size, resolve_gpu_memory

REPO = Path(__file__).resolve().parents[2]
GIB = 2**30


def test_the_flag_reads_auto_off_and_sizes() -> None:
    assert gpu_memory_size("auto") is None and gpu_memory_size(" AUTO ") is None
    assert gpu_memory_size("off") == 0 and gpu_memory_size("0") == 0
    assert gpu_memory_size("24GiB") == 24 * GIB and gpu_memory_size("1.5G") == 1_500_000_000
    with pytest.raises(argparse.ArgumentTypeError, match="not a size: 'lots'"):
        gpu_memory_size("lots")


def test_auto_is_free_plus_held_less_the_margin(monkeypatch: pytest.MonkeyPatch) -> None:
    readings = {"free": 10 * GIB, "total": 24 * GIB, "reserved": 2 * GIB}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (readings["free"], readings["total"]))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: readings["reserved"])
    assert auto_margin(24 * GIB) == 24 * GIB // 20 and auto_margin(8 * GIB) == GIB  # 5 %, at least 1 GiB
    assert auto_gpu_memory("cuda") == 12 * GIB - 24 * GIB // 20
    assert auto_gpu_memory("cuda:0") == auto_gpu_memory("cuda")
    readings.update(free=GIB // 2, total=8 * GIB, reserved=0)
    assert auto_gpu_memory("cuda") == 0  # nothing left past the margin
    assert auto_gpu_memory("cpu") == 0


def test_resolution_keeps_explicit_values_and_gives_a_cpu_engine_no_cache() -> None:
    assert resolve_gpu_memory(None, "cpu") == 0
    assert resolve_gpu_memory(0, "cuda") == 0 and resolve_gpu_memory(12 * GIB, "cuda") == 12 * GIB


def test_bad_value_is_a_one_line_cli_error(tmp_path: Path) -> None:
    env = {**os.environ, "FREETOKEN_CACHE_DIR": str(tmp_path), "PYTHONPATH": os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.run([sys.executable, "-m", "freetoken_agent", "generate", "--prompt", "hi", "--gpu-memory",
                           "much"], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert proc.returncode != 0 and "--gpu-memory" in proc.stderr and "not a size: 'much'" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_engine_gets_an_expert_cache_by_default(tmp_path: Path) -> None:
    from engine.engine import Engine
    from engine.options import EngineOptions
    from engine.sampling import SamplingParams
    from freetoken_agent.demo import write_demo_model

    model = write_demo_model(tmp_path / "demo", arch="qwen3_moe")
    free, total = torch.cuda.mem_get_info()
    cap = resolve_gpu_memory(None, "cuda")
    assert 0 < cap <= free + torch.cuda.memory_reserved() - auto_margin(total) + 2**20
    torch.cuda.reset_peak_memory_stats()
    engine = Engine(model, EngineOptions(device="cuda", gpu_memory=cap, threads=2))
    try:
        assert "cached" in engine.decoder.executor.describe()
        out = list(engine.generate([1, 2, 3, 4], SamplingParams(max_tokens=4)))
        assert len(out) == 4
        assert torch.cuda.max_memory_allocated() <= cap
    finally:
        engine.close()
