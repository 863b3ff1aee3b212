"""Native executor at the Python boundary and in the engine: input checking, threads, concurrent
callers, fork and exit, ISA forcing by environment, the plain-read bound, and engine selection."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from native.formats import ExpertWeights, quantize
from tests.native.conftest import ALL_ISAS, CPU_ISAS, check_close

ROOT = Path(__file__).resolve().parents[2]


def _bank(gen: torch.Generator, R: int = 10, H: int = 130, inter: int = 70) -> ExpertWeights:
    return quantize(torch.randn(R, 2 * inter, H, generator=gen) / 10, torch.randn(R, H, inter, generator=gen) / 10,
                    "bf16")


def test_isa_detection(ft):
    assert ft.supported_isas() == CPU_ISAS
    assert ft.get_isa() == CPU_ISAS[0] or os.environ.get("FREETOKEN_NATIVE_ISA")
    with pytest.raises(ValueError, match="unknown ISA"):
        ft.set_isa("sse9")
    for name in ALL_ISAS:
        if name not in CPU_ISAS:
            with pytest.raises(ValueError, match="not supported"):
                ft.set_isa(name)


def test_thread_counts_and_concurrent_callers(ft):
    gen = torch.Generator().manual_seed(11)
    ew = _bank(gen)
    x, ids, w = torch.randn(6, 130, generator=gen), torch.randint(0, 10, (6, 3), generator=gen), torch.rand(6, 3)
    ft.set_isa("avx2" if "avx2" in CPU_ISAS else "scalar")
    n_before = ft.num_threads()
    try:
        base = ft.moe_layer(x, ids, w, ew)
        for n in (1, 2, 3, 5):
            ft.set_num_threads(n)
            assert ft.num_threads() == n
            check_close(ft.moe_layer(x, ids, w, ew), base.double(), 1e-6)
        errors: list[BaseException] = []

        def worker() -> None:
            try:
                for _ in range(20):
                    check_close(ft.moe_layer(x, ids, w, ew), base.double(), 1e-6)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=worker) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors[0]
    finally:
        ft.set_num_threads(n_before)
        ft.set_isa("auto")


def test_empty_batch(ft):
    ew = ExpertWeights("bf16", torch.zeros(3, 10, 8, dtype=torch.bfloat16), torch.zeros(3, 8, 5, dtype=torch.bfloat16))
    assert ft.moe_layer(torch.zeros(0, 8), torch.zeros(0, 2, dtype=torch.int64), torch.zeros(0, 2), ew).shape == (0, 8)


def _bad_calls():
    T, H, inter, R, k = 3, 32, 32, 4, 2
    x, ids, w = torch.randn(T, H), torch.zeros(T, k, dtype=torch.int64), torch.ones(T, k)
    ew = ExpertWeights("bf16", torch.zeros(R, 2 * inter, H, dtype=torch.bfloat16),
                       torch.zeros(R, H, inter, dtype=torch.bfloat16))
    good = dict(x=x, ids=ids, weights=w, experts=ew)
    return {
        "x float16": dict(good, x=x.half()),
        "x 1-d": dict(good, x=x[0]),
        "x transposed": dict(good, x=torch.randn(H, T).t()),
        "x hidden mismatch": dict(good, x=torch.randn(T, H + 1)),
        "x not a tensor": dict(good, x=x.tolist()),
        "ids int32": dict(good, ids=ids.int()),
        "ids wrong rows": dict(good, ids=ids[:2]),
        "ids non-contiguous": dict(good, ids=torch.zeros(k, T, dtype=torch.int64).t()),
        "ids out of range": dict(good, ids=torch.full((T, k), R)),
        "ids negative": dict(good, ids=torch.full((T, k), -1)),
        "id offset past the bank": dict(good, id_offset=R - 0),
        "id offset negative": dict(good, id_offset=-1),
        "weights float64": dict(good, weights=w.double()),
        "weights shape": dict(good, weights=torch.ones(T, k + 1)),
        "experts not ExpertWeights": dict(good, experts=(ew.w13, ew.w2)),
        "out shape": dict(good, out=torch.zeros(T, H + 1)),
        "out dtype": dict(good, out=torch.zeros(T, H, dtype=torch.float64)),
        "out transposed": dict(good, out=torch.zeros(H, T).t()),
    }


@pytest.mark.parametrize("case", list(_bad_calls()))
def test_bad_calls_raise_value_error(ft, case):
    with pytest.raises(ValueError):
        ft.moe_layer(**_bad_calls()[case])


def _bad_banks():
    R, H, inter = 4, 32, 32
    bf = torch.bfloat16
    w13, w2 = torch.zeros(R, 2 * inter, H, dtype=bf), torch.zeros(R, H, inter, dtype=bf)
    u13, u2 = torch.zeros(R, 2 * inter, H, dtype=torch.uint8), torch.zeros(R, H, inter, dtype=torch.uint8)
    s13, s2 = torch.ones(R, 2, 1), torch.ones(R, 1, 1)
    return {
        "unknown format": ("int4", w13, w2, None, None),
        "bf16 given float32": ("bf16", w13.float(), w2.float(), None, None),
        "bf16 with scales": ("bf16", w13, w2, s13, s2),
        "odd w13 rows": ("bf16", torch.zeros(R, 2 * inter + 1, H, dtype=bf), w2, None, None),
        "w13 inner stride": ("bf16", torch.zeros(R, H, 2 * inter, dtype=bf).transpose(1, 2), w2, None, None),
        "w2 shape": ("bf16", w13, torch.zeros(R, H, inter + 1, dtype=bf), None, None),
        "w2 experts": ("bf16", w13, torch.zeros(R - 1, H, inter, dtype=bf), None, None),
        "fp8 without scales": ("fp8", u13, u2, None, None),
        "fp8 scale shape": ("fp8", u13, u2, torch.ones(R, 1, 1), s2),
        "fp8 scale dtype": ("fp8", u13, u2, s13.double(), s2),
        "mxfp4 odd size": ("mxfp4", torch.zeros(R, 2 * 24, 16, dtype=torch.uint8),
                           torch.zeros(R, 32, 12, dtype=torch.uint8), None, None),
        "not on cpu": ("bf16", w13.to("meta"), w2, None, None),
    }


@pytest.mark.parametrize("case", list(_bad_banks()))
def test_bad_banks_raise_value_error(case):
    with pytest.raises(ValueError):
        ExpertWeights(*_bad_banks()[case])


def test_fp8_block_must_fit_the_kernel_tiles():
    with pytest.raises(ValueError, match="block"):
        ExpertWeights("fp8", torch.zeros(1, 64, 32, dtype=torch.uint8), torch.zeros(1, 32, 32, dtype=torch.uint8),
                      torch.ones(1, 2, 1), torch.ones(1, 1, 1), (30, 32))


def test_read_ranges_touches_every_byte(ft):
    gen = torch.Generator().manual_seed(4)
    t = torch.randint(-2**62, 2**62, (3, 100_000), dtype=torch.int64, generator=gen)
    want = 0
    for v in t.flatten().tolist():
        want ^= v & 0xFFFFFFFFFFFFFFFF
    assert ft.read_tensor(t) == want
    assert ft.read_ranges([(t[j].data_ptr(), t[j].numel() * 8) for j in range(3)]) == want
    assert ft.call_overhead_us(50) > 0


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    full = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])), **env)
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=300)


_ENV_CHECK = """
import torch
from engine.moe.native import apply_native_options
from engine.options import EngineOptions
apply_native_options(EngineOptions.resolve().native)  # the environment, read once, as an engine does
from native import ftnative as ft
from native.formats import quantize, dequantize
from tests.native.conftest import reference
g = torch.Generator().manual_seed(5)
ew = quantize(torch.randn(4, 66, 71, generator=g), torch.randn(4, 71, 33, generator=g), "bf16")
x = torch.randn(3, 71, generator=g); ids = torch.tensor([[0, 1], [2, 3], [3, 0]]); w = torch.rand(3, 2, generator=g)
o = ft.moe_layer(x, ids, w, ew)
r = reference(x, ids, w, *dequantize(ew))
print(ft.get_isa(), ft.num_threads(), float((o.double() - r).abs().max() / r.abs().max()))
"""


@pytest.mark.parametrize("name", ALL_ISAS)
def test_env_var_forces_isa(ft, name):
    """FREETOKEN_NATIVE_ISA / _THREADS reach the extension through the engine's options."""
    res = _run(_ENV_CHECK, FREETOKEN_NATIVE_ISA=name, FREETOKEN_NATIVE_THREADS="3")
    if name in CPU_ISAS:
        assert res.returncode == 0, res.stderr
        got, threads, rel = res.stdout.split()
        assert got == name and threads == "3"
        assert float(rel) < (2e-2 if name == "avx512bf16" else 2e-5)
    else:
        assert res.returncode != 0 and "not supported" in res.stderr


def test_env_var_unknown_isa(ft):
    res = _run("from engine.options import EngineOptions; EngineOptions.resolve()", FREETOKEN_NATIVE_ISA="sse9")
    assert res.returncode != 0 and "FREETOKEN_NATIVE_ISA='sse9'" in res.stderr


def test_exit_and_fork_with_a_live_pool(ft):
    code = _ENV_CHECK + """
import os
pid = os.fork()
if pid == 0:  # the child has no worker threads of its parent: it must start its own pool
    o2 = ft.moe_layer(x, ids, w, ew)
    os._exit(0 if torch.equal(o, o2) else 3)
_, status = os.waitpid(pid, 0)
print("child", os.waitstatus_to_exitcode(status))
"""
    res = _run(code, FREETOKEN_NATIVE_THREADS="4")
    assert res.returncode == 0, res.stderr  # exit with four live workers: joined at exit, no hang or crash
    assert "child 0" in res.stdout


def test_engine_executor_selection(ft):
    from engine.errors import ConfigError
    from engine.moe.executor import TorchExpertExecutor, create_executor
    from engine.moe.native import NativeExpertExecutor
    from engine.weights.layout import ExpertBanks

    gen = torch.Generator().manual_seed(3)
    L, E, H, inter, T, k = 2, 6, 64, 48, 5, 2
    banks = ExpertBanks(w13=(torch.randn(L * E, 2 * inter, H, generator=gen) / 8).bfloat16(),
                        w2=(torch.randn(L * E, H, inter, generator=gen) / 7).bfloat16(), num_experts=E)
    assert isinstance(create_executor("auto", banks, "cpu"), NativeExpertExecutor)
    assert isinstance(create_executor("auto", banks, "meta"), TorchExpertExecutor)  # not a CPU engine
    with pytest.raises(ConfigError, match="cannot be used"):
        create_executor("native", banks, "meta")
    half = ExpertBanks(banks.w13.half(), banks.w2.half(), E)
    assert isinstance(create_executor("auto", half, "cpu"), TorchExpertExecutor)
    with pytest.raises(ConfigError, match="float16"):
        create_executor("native", half, "cpu")
    with pytest.raises(ConfigError, match="unknown expert executor"):
        create_executor("cuda-magic", banks, "cpu")
    x = torch.randn(T, H, generator=gen).bfloat16()
    ids = torch.randint(0, E, (T, k), generator=gen)
    weights = torch.rand(T, k, generator=gen)
    got = create_executor("native", banks, "cpu")(x, ids, weights, 1)
    want = TorchExpertExecutor(banks)(x, ids, weights, 1)
    assert got.dtype == want.dtype == torch.bfloat16
    check_close(got, want.double(), 3e-2)


@pytest.mark.slow
def test_cpu_generate_uses_the_native_executor(ft, demo_model):
    """A CPU-only engine picks the native executor and generates what the torch executor generates."""
    from engine.engine import Engine
    from engine.moe.native import NativeExpertExecutor
    from engine.options import EngineOptions
    from engine.sampling import SamplingParams

    model = demo_model("qwen3_moe")
    prompt = list(range(100, 140))
    outs = {}
    for name in ("auto", "torch"):
        with Engine(model, EngineOptions(executor=name)) as eng:
            if name == "auto":
                assert isinstance(eng.decoder.executor, NativeExpertExecutor)
            outs[name] = list(eng.generate(prompt, SamplingParams(max_tokens=24, ignore_eos=True)))
    assert outs["auto"] == outs["torch"]


@pytest.mark.slow
def test_cli_generate_reports_and_uses_the_native_executor(ft, demo_model, capsys):
    """The real CLI process with the native executor; the torch executor's reference run goes
    through the same `main` in the test process."""
    from freetoken_agent.cli import main

    model = demo_model("qwen3_5_moe")
    # --device cpu: on a GPU host `auto` picks cuda, where the experts run on the GPU tier's executor
    argv = ["generate", "--model", str(model), "--device", "cpu", "--prompt", "hi", "--max-tokens", "12",
            "--output-ids", "--executor"]
    res = subprocess.run([sys.executable, "-m", "freetoken_agent", *argv, "native"],
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "expert executor: native (" in res.stderr
    capsys.readouterr()
    assert main([*argv, "torch"]) == 0
    torch_run = capsys.readouterr()
    assert "expert executor: torch (" in torch_run.err
    assert res.stdout.strip().splitlines()[-1] == torch_run.out.strip().splitlines()[-1]


def _worker_cpu_s() -> float:
    """CPU seconds of the native pool's workers (threads named ft-worker): the process's other
    threads (torch's OpenMP threads spin after an op) do not count."""
    total = 0
    for task in Path("/proc/self/task").iterdir():
        try:
            if (task / "comm").read_text().strip() != "ft-worker":
                continue
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (clock ticks)
    return total / os.sysconf("SC_CLK_TCK")


def test_worker_spin_is_settable_and_keeps_workers_busy(ft):
    """Idle workers spin for worker_spin_us() before they sleep: with a long spin a worker keeps
    burning CPU after a call, with none it does not. Bad values are refused."""
    import time

    spin_before, n_before = ft.worker_spin_us(), ft.num_threads()
    t = torch.ones(1 << 16, dtype=torch.uint8)
    busy = {}
    try:
        ft.set_num_threads(2)
        for spin in (0, 200_000):
            ft.set_worker_spin_us(spin)
            assert ft.worker_spin_us() == spin
            ft.read_tensor(t)  # wakes the worker; it goes idle again at once
            ft.read_tensor(t)  # the second call finds it in its idle spin (or asleep, with 0)
            cpu0, wall0 = _worker_cpu_s(), time.perf_counter()
            time.sleep(0.15)
            busy[spin] = (_worker_cpu_s() - cpu0) / (time.perf_counter() - wall0)
        for bad in (-1, 1_000_001, 1.5, True):
            with pytest.raises(ValueError, match="worker spin"):
                ft.set_worker_spin_us(bad)
    finally:
        ft.set_worker_spin_us(spin_before)
        ft.set_num_threads(n_before)
    assert busy[0] < 0.15 and busy[200_000] > 0.3, busy
