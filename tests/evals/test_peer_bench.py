"""evals/peer/run_bench.py without llama.cpp: the command it builds, the parsing of llama-bench's
JSON (also from a run cut short) and the summary (TTFT = n_prompt / prefill tok/s)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def rb() -> ModuleType:
    spec = importlib.util.spec_from_file_location("peer_run_bench", REPO / "evals" / "peer" / "run_bench.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _record(n_prompt: int, n_gen: int, ts: float) -> dict[str, object]:
    return {"build_commit": "0c1e57098", "n_prompt": n_prompt, "n_gen": n_gen, "n_depth": 0, "n_cpu_moe": 16,
            "avg_ns": int(1e9 * max(n_prompt, n_gen) / ts), "avg_ts": ts, "stddev_ts": 1.0,
            "samples_ts": [ts - 1, ts + 1]}


def test_command(rb: ModuleType) -> None:
    args = rb.parse_args(["--model", "m.gguf", "--bench", "lb"])
    assert rb.bench_command(args, "16") == [
        "lb", "-m", "m.gguf", "-ngl", "99", "-fa", "1", "-t", "8", "-ncmoe", "16", "-p", "1024,4096,16384",
        "-n", "256", "-ub", "2048", "-r", "3", "-lm", "none", "-o", "json"]
    args = rb.parse_args(["--model", "m.gguf", "--bench", "lb", "--ngl", "", "--load-mode", "", "--fa", "0",
                          "--extra", "--no-warmup -v"])
    cmd = rb.bench_command(args, "")
    assert "-ngl" not in cmd and "-lm" not in cmd and "-ncmoe" not in cmd
    assert cmd[-2:] == ["--no-warmup", "-v"]


def test_parse_complete_and_cut(rb: ModuleType) -> None:
    recs = [_record(1024, 0, 3000.0), _record(0, 256, 30.0)]
    text = "[\n" + ",\n".join("  " + json.dumps(r) for r in recs) + "\n]\n"
    assert rb.parse_bench_json(text) == recs
    cut = text[: text.rindex("{") + 20]  # the second record cut in the middle
    assert rb.parse_bench_json(cut) == recs[:1]
    assert rb.parse_bench_json("") == []
    assert rb.parse_bench_json("error: failed to load model\n") == []


def test_summary_and_table(rb: ModuleType) -> None:
    res = rb.ConfigResult(ncmoe="16", command=["lb"], returncode=0, gpu_mem_before_mib=500.0,
                          gpu_mem_peak_mib=17000.0,
                          records=[_record(1024, 0, 2048.0), _record(4096, 0, 4096.0), _record(0, 256, 32.0)])
    s = res.summary()
    assert s["prefill"]["1024"]["ttft_s"] == pytest.approx(0.5)
    assert s["prefill"]["4096"]["ttft_s"] == pytest.approx(1.0)
    assert s["decode"]["256"]["tok_s"] == 32.0
    assert s["decode"]["256"]["ms_per_token"] == pytest.approx(31.25)
    assert s["gpu_mem_peak_mib"] == 16500.0
    assert s["settings"]["n_cpu_moe"] == 16
    table = rb.table([s])
    assert "pp4096 t/s" in table and "tg256 t/s" in table and "16500" in table


def test_sampler_without_smi(rb: ModuleType) -> None:
    sampler = rb.GpuMemSampler("no-such-nvidia-smi-here", 0, 100)
    assert not sampler.available
    assert sampler.read_once() is None
    sampler.start()
    assert sampler.stop() is None
