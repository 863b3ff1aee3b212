"""`--gpu-memory`: how the cap is split (dense, KV, states, workspace, experts), the sizes the CLI
accepts, and the clear errors when the cap is too small or there is no GPU."""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from safetensors import safe_open

from engine.config import ModelConfig
from engine.engine import Engine
from engine.errors import ConfigError
from engine.gpu.budget import dense_bytes, split_gpu_memory
from engine.model.load import load_decoder
from engine.options import EngineOptions
from freetoken_agent.argtypes import byte_size

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def demo(demo_model: Callable[[str], Path]) -> Path:
    return demo_model("qwen3_5_moe")


def test_byte_sizes():
    assert byte_size("24GiB") == 24 * 2**30
    assert byte_size("24G") == 24 * 10**9
    assert byte_size("1.5 gib") == int(1.5 * 2**30)
    assert byte_size("512MiB") == 512 * 2**20
    assert byte_size("1000") == 1000
    for bad in ("lots", "12 parsecs", "-1G", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            byte_size(bad)


def test_dense_bytes_are_the_checkpoint_minus_the_expert_banks(demo: Path):
    decoder = load_decoder(demo, "cpu", executor="torch")
    banks = decoder.weights.experts
    bank_bytes = banks.w13.numel() * banks.w13.element_size() + banks.w2.numel() * banks.w2.element_size()
    total = 0
    for f in demo.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():  # noqa: SIM118 (safe_open has no __iter__)
                t = st.get_tensor(name)
                total += t.numel() * t.element_size()
    assert dense_bytes(decoder.weights) + bank_bytes == total


def test_split_sums_to_the_cap_and_names_every_part_when_too_small(demo: Path):
    import torch

    cfg = ModelConfig.from_file(demo / "config.json")
    opts = EngineOptions(kv_tokens=4096, max_running=4, prefill_chunk=256)
    b = split_gpu_memory(2 * 2**30, cfg, opts, torch.bfloat16, dense=10**8, expert_bytes=10**6)
    assert b.dense + b.kv + b.states + b.workspace + b.experts == b.total == 2 * 2**30
    assert b.kv > 0 and b.states > 0 and b.workspace > 0 and b.experts > 0
    more_kv = split_gpu_memory(2 * 2**30, cfg, EngineOptions(kv_tokens=8192, max_running=4, prefill_chunk=256),
                               torch.bfloat16, dense=10**8, expert_bytes=10**6)
    # a longer context costs its KV pages and the attention temporaries over it (workspace)
    assert more_kv.kv == 2 * b.kv and more_kv.workspace > b.workspace
    assert more_kv.experts == b.experts - b.kv - (more_kv.workspace - b.workspace)
    with pytest.raises(ConfigError, match=r"too small: dense weights .* KV cache .* states .* workspace"):
        split_gpu_memory(2**28, cfg, opts, torch.bfloat16, dense=10**8, expert_bytes=10**6)


def test_gpu_memory_needs_a_cuda_engine(demo: Path):
    with pytest.raises(ConfigError, match="caps GPU memory"):
        Engine(demo, EngineOptions(gpu_memory=8 * 2**30))
    with pytest.raises(ConfigError):
        EngineOptions(gpu_memory=-1)


def test_cli_reports_a_bad_size_and_no_gpu_in_one_line(demo: Path):
    base = [sys.executable, "-m", "freetoken_agent", "generate", "--model", str(demo), "--prompt", "hi"]
    # no visible GPU even on a GPU machine: the second call must meet a machine without one
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": ""}
    bad = subprocess.run([*base, "--gpu-memory", "lots"], capture_output=True, text=True, env=env, timeout=300)
    assert bad.returncode == 2 and "not a size" in bad.stderr
    cpu = subprocess.run([*base, "--gpu-memory", "8GiB"], capture_output=True, text=True, env=env, timeout=300)
    assert cpu.returncode == 2 and cpu.stderr.strip().splitlines()[-1].startswith("error: --gpu-memory caps GPU")


def test_workspace_counts_gated_deltanet_temporaries(demo: Path, demo_model: Callable[[str], Path]):
    import torch

    from engine.gpu.budget import linear_attention_bytes, workspace_bytes

    hybrid = ModelConfig.from_file(demo / "config.json")
    dense_only = ModelConfig.from_file(demo_model("qwen3_moe") / "config.json")
    small, large = EngineOptions(prefill_chunk=256, max_running=4), EngineOptions(prefill_chunk=1024, max_running=4)
    assert linear_attention_bytes(dense_only, large, 2) == 0
    # a longer chunk holds more of them, and they are part of the workspace
    assert 0 < linear_attention_bytes(hybrid, small, 2) < linear_attention_bytes(hybrid, large, 2)
    assert workspace_bytes(hybrid, large, torch.bfloat16) > linear_attention_bytes(hybrid, large, 2)


def test_workspace_counts_the_grouped_prefill_buffers(demo: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import torch

    from engine.gpu import budget
    from engine.gpu.budget import grouped_prefill_bytes, workspace_bytes

    cfg = ModelConfig.from_file(demo / "config.json")
    opts = EngineOptions(prefill_chunk=512, max_running=4)
    extra = grouped_prefill_bytes(cfg, opts, 2)
    with monkeypatch.context() as m:  # the rest of the estimate, without the grouped buffers
        m.setattr(budget, "grouped_prefill_bytes", lambda *a: 0)
        loop = workspace_bytes(cfg, opts, torch.bfloat16)
    assert extra > 512 * cfg.top_k * cfg.hidden_size * 2  # at least every entry's output
    assert workspace_bytes(cfg, opts, torch.bfloat16) == loop + extra


def test_device_checkpoint_slots_follow_the_cap() -> None:
    """checkpoint_slots -1 (the default): 32 without a cap; under one, as many state slots as fit in
    1/16 of it, 2 to 32 (Qwen3.6-35B-A3B: 61.4 MiB a slot, so 12 at 12 GiB: the cap's split gives the
    expert slots the difference); an explicit count is kept."""
    import torch

    from engine.cache.pools import StatePool
    from engine.gpu.budget import resolve_checkpoint_slots
    from engine.weights.dummy import dummy_config

    cfg = dummy_config("qwen3.6-35b-a3b")
    per_slot = StatePool.bytes_per_slot(cfg, torch.bfloat16)
    assert 60e6 < per_slot < 66e6  # 61.4 MiB

    def slots(**kw: object) -> int:
        return resolve_checkpoint_slots(EngineOptions.of(**kw), cfg, torch.bfloat16).checkpoint_slots

    gib = 2**30
    assert slots() == 32 and slots(checkpoint_slots=5) == 5 and slots(checkpoint_slots=5, gpu_memory=12 * gib) == 5
    assert slots(gpu_memory=12 * gib) == 12 * gib // 16 // per_slot == 12
    assert slots(gpu_memory=4 * gib) == 4 and slots(gpu_memory=1 * gib) == 2 and slots(gpu_memory=80 * gib) == 32
    auto = split_gpu_memory(12 * gib, cfg, EngineOptions.of(kv_tokens=32768), torch.bfloat16, 3 * gib, 2 * 2**20)
    fixed = split_gpu_memory(12 * gib, cfg, EngineOptions.of(kv_tokens=32768, checkpoint_slots=32), torch.bfloat16,
                             3 * gib, 2 * 2**20)
    assert fixed.states - auto.states == 20 * per_slot == auto.experts - fixed.experts
    with pytest.raises(ConfigError, match="checkpoint_slots"):
        EngineOptions.of(checkpoint_slots=-2)
