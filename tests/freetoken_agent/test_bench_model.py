"""Dummy (random) weights of a shape, `Engine.from_decoder`, and `bench decode` / `bench prefill`.

The tiny test shapes of both families (`tiny-qwen3`, `tiny-hybrid`) build on the CPU: their
decoders run, are deterministic per seed (independent of the fill threads and of the dtype's
path), and have the banks and config their `MoeShape` promises; the real shapes give the configs
of the released models without building weights. The two benches run through the real CLI
(subprocess) and print one JSON object with the documented keys; with a stored calibration they
report a bound. The expert-cache counters are exercised with a CPU-resident cache. Bad arguments
are one `error:` line and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from engine.config import FULL_ATTENTION, LINEAR_ATTENTION
from engine.engine import Engine
from engine.errors import ConfigError
from engine.options import EngineOptions
from engine.sampling import SamplingParams
from engine.weights import dummy
from engine.weights.dummy import dummy_config, dummy_decoder, dummy_weights
from engine.weights.shapes import SHAPES

REPO = Path(__file__).resolve().parents[2]
TINY = ("tiny-qwen3", "tiny-hybrid")
FACT_KEYS = {"bench", "weights", "seed", "shape", "family", "layers", "experts", "top_k", "hidden", "expert_inter",
             "dtype", "device", "gpu", "cpu", "cpu_threads", "executor", "gpu_memory", "gpu_budget",
             "peak_gpu_bytes", "expert_bytes", "expert_bank_bytes", "kv_bytes_per_token", "dense_bytes", "load_s", "calibration",
             "bandwidth_gbps", "bound_note"}
DECODE_KEYS = FACT_KEYS | {"prompt_tokens", "tokens", "reps", "temperature", "tok_s", "tok_s_reps", "ms_per_token", "distinct_tokens",
                           "hit_rate", "hits_per_token", "misses_per_token", "fetched_per_token",
                           "split_per_token", "cpu_misses_per_token", "cpu_branch_ms_per_token", "layer_timeline", "step_rest_ms", "dense_ms",
                           "dense_ms_reps", "bound_ms",
                           "measured_over_bound", "overlapped_share"}
PREFILL_KEYS = FACT_KEYS | {"chunk", "reps", "expert_cache", "runs"}
RUN_KEYS = {"prompt_tokens", "ttft_s", "ttft_s_reps", "prefill_tok_s", "passes", "bound_s", "measured_over_bound",
            "hit_rate", "streamed_experts", "streamed_unused_share"}


def native_built() -> bool:
    try:
        from native import ftnative  # noqa: F401
    except ImportError:
        return False
    return True


def run_cli(*args: str, cache: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "FREETOKEN_CACHE_DIR": str(cache), "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "freetoken_agent", *args], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=120)


def greedy_logits(engine: Engine, prompt: list[int], tokens: int = 3) -> torch.Tensor:
    handle = engine.submit(prompt, SamplingParams(max_tokens=tokens), capture_logits=True)
    handle.result()
    return torch.stack(handle.logits)


def small_engine(decoder: object) -> Engine:
    return Engine.from_decoder(decoder, EngineOptions(kv_tokens=128, max_running=1, checkpoint_slots=0,  # type: ignore[arg-type]
                                                      host_checkpoint_slots=0, threads=1))


@pytest.fixture(autouse=True)
def _keep_torch_threads() -> Iterator[None]:
    """Engines with `threads` set torch's thread count process-wide: put it back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


# ------------------------------------------------------------------------------- weights and configs
@pytest.mark.parametrize("name", TINY)
def test_dummy_decoder_runs_and_is_deterministic(name: str) -> None:
    cfg = dummy_config(name)
    prompt = list(range(3, 40, 3))
    logits = []
    for seed in (7, 7, 8):
        engine = small_engine(dummy_decoder(cfg, "cpu", torch.float32, seed, executor="torch"))
        try:
            logits.append(greedy_logits(engine, prompt))
        finally:
            engine.close()
    assert all(bool(torch.isfinite(x).all()) for x in logits)
    assert torch.equal(logits[0], logits[1])
    assert not torch.allclose(logits[0], logits[2])


@pytest.mark.parametrize("name", TINY)
def test_banks_and_config_match_the_shape(name: str) -> None:
    shape = SHAPES[name]
    cfg = dummy_config(shape)
    w = dummy_weights(cfg, "cpu", torch.bfloat16, seed=0)
    L, E, H, I = shape.layers, shape.experts, shape.hidden, shape.inter  # noqa: E741
    banks = w.experts
    assert banks.w13.shape == (L * E, 2 * I, H) and banks.w2.shape == (L * E, H, I) and banks.num_experts == E
    assert banks.w13.is_contiguous() and banks.w2.is_contiguous() and banks.w13.device.type == "cpu"
    assert banks.expert_bytes == shape.expert_bytes(2)
    assert banks.expert_bytes * banks.w13.shape[0] == shape.bank_bytes(itemsize=2)
    assert (cfg.num_layers, cfg.num_experts, cfg.top_k, cfg.hidden_size, cfg.moe_intermediate_size) == (L, E, shape.top_k, H, I)
    assert cfg.vocab_size == shape.vocab == w.embed.shape[0] and cfg.eos_token_ids == ()
    assert cfg.family == shape.family and (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        shape.heads, shape.kv_heads, shape.head_dim)
    for bank in (banks.w13, banks.w2):
        x = bank.float()
        assert bool(torch.isfinite(x).all()) and abs(float(x.mean())) < 0.01
    assert 0.01 < float(banks.w13.float().std()) < 0.04  # ~0.02, like a real init
    if shape.family == "qwen3_5_moe":
        assert cfg.layer_types == (LINEAR_ATTENTION,) * 3 + (FULL_ATTENTION,)
        assert cfg.shared_expert_intermediate_size == shape.shared_inter and w.layers[0].moe.shared is not None
        assert cfg.attn_output_gate and cfg.rotary_dim == shape.head_dim // 4


def test_weights_do_not_depend_on_threads_chunks_path_or_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = dummy_config("tiny-hybrid", layers=2)
    monkeypatch.setattr(dummy, "CHUNK", 4096)  # many chunks per tensor, some not a multiple of 4 long
    one = dummy_weights(cfg, "cpu", torch.bfloat16, seed=3, fill_threads=1)
    three = dummy_weights(cfg, "cpu", torch.bfloat16, seed=3, fill_threads=3)
    wide = dummy_weights(cfg, "cpu", torch.float32, seed=3, fill_threads=2)
    for a, b, c in ((one.experts.w13, three.experts.w13, wide.experts.w13),
                    (one.experts.w2, three.experts.w2, wide.experts.w2), (one.embed, three.embed, wide.embed),
                    (one.layers[0].linear_attention.conv, three.layers[0].linear_attention.conv,
                     wide.layers[0].linear_attention.conv)):
        assert torch.equal(a, b) and torch.equal(a.float(), c)


def test_real_shapes_give_the_released_configs() -> None:
    q3 = dummy_config("qwen3-30b-a3b", layers=24)
    assert (q3.num_layers, q3.num_experts, q3.top_k, q3.hidden_size, q3.moe_intermediate_size) == (24, 128, 8, 2048, 768)
    assert (q3.num_heads, q3.num_kv_heads, q3.head_dim, q3.rotary_dim, q3.vocab_size) == (32, 4, 128, 128, 151936)
    assert q3.rope_theta == 1e6 and q3.norm_topk_prob and not q3.is_hybrid
    assert SHAPES["qwen3-30b-a3b"].bank_bytes() == 48 * 128 * 3 * 2048 * 768 * 2  # ~58 GB
    q36 = dummy_config(SHAPES["qwen3.6-35b-a3b"])
    assert (q36.num_layers, q36.num_experts, q36.num_heads, q36.num_kv_heads, q36.head_dim) == (40, 256, 16, 2, 256)
    assert len(q36.full_attention_layer_ids) == 10 and q36.full_attention_layer_ids[0] == 3
    assert (q36.linear_num_key_heads, q36.linear_num_value_heads, q36.linear_key_head_dim) == (16, 32, 128)
    assert q36.rotary_dim == 64 and q36.shared_expert_intermediate_size == 512 and q36.linear_conv_kernel_dim == 4
    oss = dummy_config("gpt-oss-120b")
    assert (oss.num_layers, oss.num_experts, oss.top_k, oss.hidden_size, oss.window_of(0), oss.window_of(1)) == (
        36, 128, 4, 2880, 128, None)
    with pytest.raises(ConfigError, match="unknown shape"):
        dummy_config("nope")
    with pytest.raises(ConfigError, match="layers"):
        dummy_config("tiny-qwen3", layers=0)


def test_from_decoder_checks_the_device() -> None:
    decoder = dummy_decoder(dummy_config("tiny-qwen3"), "cpu", torch.float32, 0, executor="torch")
    with pytest.raises(ConfigError, match="weights are on cpu"):
        Engine.from_decoder(decoder, EngineOptions(device="cuda"))


# ------------------------------------------------------------------------------- benches
def bench_args(**kw: object) -> argparse.Namespace:
    base: dict[str, object] = dict(shape="tiny-qwen3", layers=None, dummy=True, seed=0, device="cpu", threads=1,
                                   executor="torch", dtype=None, gpu_memory=0, fetch_ratio=-1.0, cuda_graphs=True, overlap_decode=True, json=True,
                                   tokens=6, reps=2, prompt_tokens=12, temperature=0.0)
    return argparse.Namespace(**{**base, **kw})


def _measure_with_cache(measure, args: argparse.Namespace, slots: int):  # type: ignore[no-untyped-def]
    """A bench's measure() on a CPU engine whose experts run through an expert cache of `slots`
    (fetch ratio 0.5); returns the result and the (closed) bench."""
    from engine.gpu.executor import create_cached_executor
    from freetoken_agent.bench.model_bench import ModelBench

    bench = ModelBench(args, kv_tokens=64, prefill_chunk=16)
    try:
        banks = bench.engine.decoder.weights.experts
        bench.engine.decoder.executor = create_cached_executor(banks, slots * banks.expert_bytes, "cpu", 0.5)
        return measure(bench, args), bench
    finally:
        bench.close()


def test_decode_counts_cache_hits_over_the_timed_steps_only() -> None:
    from freetoken_agent.bench import decode

    args = bench_args()
    r, bench = _measure_with_cache(decode.measure, args, slots=6)
    routed = bench.cfg.top_k * bench.cfg.num_moe_layers
    assert r["hits_per_token"] + r["misses_per_token"] == pytest.approx(routed)
    assert 0 <= r["hit_rate"] <= 1 and r["fetched_per_token"] <= r["misses_per_token"]
    assert r["cpu_misses_per_token"] == pytest.approx(r["misses_per_token"] - r["fetched_per_token"])
    assert r["executor"].startswith("cached") and r["tok_s"] > 0 and r["dense_ms"] > 0


@pytest.mark.parametrize(("shape", "fmt"), [("tiny-gpt-oss", "mxfp4"), ("tiny-qwen3", "float32")])
def test_the_build_message_counts_the_experts_as_built(shape: str, fmt: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """gpt-oss's random experts are MXFP4 kept packed: the bench reports their packed bytes."""
    from freetoken_agent.bench.model_bench import ModelBench

    bench = ModelBench(bench_args(shape=shape, json=False, dtype="float32"), kv_tokens=32, prefill_chunk=16)
    try:
        banks = bench.engine.decoder.weights.experts
        assert bench.dummy_expert_bytes() == (banks.total_bytes, fmt)
        assert f"{banks.total_bytes / 1e9:.1f} GB of {fmt} experts, seed 0" in capsys.readouterr().err
    finally:
        bench.close()


def test_timed_request_samples_at_a_temperature_reproducibly() -> None:
    """bench decode --temperature: the generations are sampled (seeded per rep), not greedy."""
    from freetoken_agent.bench.model_bench import ModelBench

    bench = ModelBench(bench_args(), kv_tokens=128, prefill_chunk=16)
    try:
        prompt = bench.random_prompt(8, 0)
        greedy = bench.timed_request(prompt, 16).output
        hot = bench.timed_request(prompt, 16, 1e4, 0).output
        assert hot == bench.timed_request(prompt, 16, 1e4, 0).output  # the seed fixes the samples
        assert hot != greedy and len(set(hot)) >= 12  # near-uniform over the vocabulary
    finally:
        bench.close()


def test_prefill_reports_streamed_experts_no_token_used() -> None:
    """A 32-token chunk (64 routed entries over 8 experts: streamed) uses every streamed expert under
    near-uniform routers; routers that send every token to the same two experts leave 6 of 8 unused."""
    from freetoken_agent.bench import prefill

    args = bench_args(prompt_tokens=[32], chunk=32, reps=1, expert_cache="cold")
    r, _ = _measure_with_cache(prefill.measure, args, slots=16)  # two layers' buffers, not the model
    run = r["runs"][0]
    assert run["streamed_experts"] > 0 and run["streamed_unused_share"] < 0.2

    def uneven(bench, a):  # type: ignore[no-untyped-def]
        for lw in bench.engine.decoder.weights.layers:
            if lw.moe is not None:
                lw.moe.router.zero_()
                lw.moe.router[:2] = 1.0  # logits x.sum() for experts 0 and 1, 0 for the rest
        return prefill.measure(bench, a)

    r, _ = _measure_with_cache(uneven, args, slots=16)
    assert r["runs"][0]["streamed_unused_share"] >= 0.5


def test_prefill_expert_cache_cold_or_warm() -> None:
    """cold: the timed request starts with an empty expert cache, so a one-pass prompt hits nothing;
    warm: the previous request's experts are still there."""
    from freetoken_agent.bench import prefill

    rates = {}
    for mode in ("cold", "warm"):
        args = bench_args(prompt_tokens=[12], chunk=16, reps=2, expert_cache=mode)
        # 16 slots: room for what a 12-token request fetches in its 3 layers
        r, _ = _measure_with_cache(prefill.measure, args, slots=16)
        assert r["expert_cache"] == mode and r["runs"][0]["ttft_s"] > 0
        rates[mode] = r["runs"][0]["hit_rate"]
    assert rates["cold"] == 0.0 and rates["warm"] > 0.0


def _write_calibration(cache: Path, hidden: int, inter: int) -> None:
    from engine.gpu.calibrate import CalibrationSpec, machine_key
    from engine.gpu.calibration_store import Calibration, save

    key = machine_key(CalibrationSpec(hidden=hidden, inter=inter, device="cpu"), 1, False)
    save(cache / "calibration.json", Calibration(key=key, b_cpu=2.0, note="test"))


def test_bench_decode_and_prefill_json(tmp_path: Path) -> None:
    native = native_built()
    if native:  # with a stored B_C the CPU engine's bound is known
        _write_calibration(tmp_path, 64, 32)
    proc = run_cli("bench", "decode", "--shape", "tiny-qwen3", "--dummy", "--device", "cpu", "--tokens", "8",
                   "--reps", "2", "--cpu-threads", "1", "--json", cache=tmp_path)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    assert set(r) >= DECODE_KEYS and r["bench"] == "decode" and r["weights"] == "dummy"
    assert r["overlapped_share"] == 0.0  # off CUDA no decode graph runs, so no pass is overlapped
    assert r["shape"] == "tiny-qwen3" and r["layers"] == 3 and r["tokens"] == 8 and len(r["tok_s_reps"]) == 2
    assert r["tok_s"] > 0 and r["ms_per_token"] > 0 and r["dense_ms"] > 0 and r["load_s"] > 0
    assert len(r["dense_ms_reps"]) == 2 and r["dense_ms"] == statistics.median(r["dense_ms_reps"])
    assert r["misses_per_token"] == 2 * 3 and r["hit_rate"] is None  # no expert cache: every expert from host
    assert r["gpu_memory"] is None and r["peak_gpu_bytes"] is None and r["cpu_threads"] == 1
    item = 4 if r["dtype"] == "float32" else 2
    assert r["kv_bytes_per_token"] == 3 * 2 * 2 * 16 * item  # layers x (K, V) x KV heads x head dim
    if native:
        assert r["bandwidth_gbps"] == 2.0 and r["bound_ms"] > r["dense_ms"] and r["measured_over_bound"] > 0
    else:
        assert r["bound_ms"] is None and r["bound_note"].startswith("unknown")

    proc = run_cli("bench", "prefill", "--shape", "tiny-hybrid", "--dummy", "--device", "cpu", "--prompt-tokens",
                   "32,64", "--chunk", "48", "--cpu-threads", "1", "--json", cache=tmp_path)
    assert proc.returncode == 0, proc.stderr
    p = json.loads(proc.stdout)
    assert set(p) >= PREFILL_KEYS and p["bench"] == "prefill" and p["chunk"] == 48
    assert [run["prompt_tokens"] for run in p["runs"]] == [32, 64] and [run["passes"] for run in p["runs"]] == [1, 2]
    for run in p["runs"]:
        assert set(run) >= RUN_KEYS and run["ttft_s"] > 0 and run["prefill_tok_s"] > 0
        assert (run["bound_s"] is None) == (p["bandwidth_gbps"] is None)
    if native:  # tiny-hybrid has tiny-qwen3's expert shape: the same record
        bank = p["expert_bank_bytes"]
        assert p["bandwidth_gbps"] == 2.0 and p["runs"][1]["bound_s"] == pytest.approx(2 * bank / 2e9)


@pytest.mark.parametrize("argv, message", [
    (["--shape", "nope"], "invalid choice"),
    (["--gpu-memory", "8GiB", "--device", "cpu"], "--gpu-memory"),
    (["--gpu-memory", "lots", "--device", "cpu"], "not a size"),
    (["--tokens", "1", "--device", "cpu"], "--tokens"),
    (["--cpu-threads", "-1", "--device", "cpu"], "--cpu-threads"),
    (["--temperature", "-1", "--device", "cpu"], "--temperature"),
    (["--temperature", "nan", "--device", "cpu"], "--temperature"),
])
def test_bad_arguments_are_one_error_line(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    from freetoken_agent.cli import main

    try:
        status = main(["bench", "decode", "--shape", "tiny-qwen3", "--dummy", *argv])
    except SystemExit as e:  # argparse errors
        status = int(e.code or 0)
    err = capsys.readouterr().err
    assert status == 2 and err.startswith("error:") and message in err and "Traceback" not in err


def test_missing_dummy_flag_and_unavailable_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    from freetoken_agent.cli import main

    with pytest.raises(SystemExit) as e:
        main(["bench", "prefill", "--shape", "tiny-qwen3"])
    assert e.value.code == 2 and "--dummy" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["bench", "prefill", "--shape", "tiny-qwen3", "--dummy", "--device", "cuda"]) == 2
        assert "no CUDA device" in capsys.readouterr().err


def test_bench_decode_on_a_checkpoint(demo_model: Callable[[str], Path], tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    from freetoken_agent.cli import main

    model = demo_model("qwen3_moe")
    proc = run_cli("bench", "decode", "--model", str(model), "--device", "cpu", "--tokens", "6", "--reps", "1",
                   "--prompt-tokens", "8", "--cpu-threads", "1", "--json", cache=tmp_path)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    assert r["weights"] == f"checkpoint {model}" and r["shape"] == str(model) and r["tokens"] == 6
    assert r["tok_s"] > 0 and r["family"] == "qwen3_moe" and r["routing"] == "the checkpoint's routers"
    # the refusals, through the CLI's main in this process (an exception escaping it fails the test)
    with pytest.raises(SystemExit) as e:  # argparse
        main(["bench", "decode", "--model", str(model), "--dummy", "--device", "cpu"])
    assert e.value.code == 2 and "not allowed with" in capsys.readouterr().err
    assert main(["bench", "prefill", "--model", str(tmp_path / "nowhere"), "--device", "cpu"]) != 0
    err = capsys.readouterr().err
    assert "no config.json" in err and "Traceback" not in err


def test_layer_timeline_is_per_served_layer_over_the_timed_tokens() -> None:
    """bench decode's layer_timeline: the poller's sums between the first and the last token of each
    rep, summed over reps and divided per served request / gap / fetch; null without doorbell work."""
    from freetoken_agent.bench.decode import _timeline
    from freetoken_agent.bench.model_bench import Timing

    def timing(first: dict[str, int] | None, end: dict[str, int] | None) -> Timing:
        return Timing(0.0, 0.0, 1.0, 5, None, None, None, [], 0, 0, first, end)

    zero = dict.fromkeys(("served", "cpu_ns", "gaps", "gap_ns", "fetches", "fetch_ns", "fetch_late"), 0)
    a = {**zero, "served": 8, "cpu_ns": 8_000_000, "gaps": 6, "gap_ns": 1_200_000, "fetches": 4, "fetch_ns": 2_000_000,
         "fetch_late": 1}
    b = {**zero, "served": 16, "cpu_ns": 24_000_000, "gaps": 12, "gap_ns": 1_800_000}  # another rep: no fetch
    got = _timeline([timing(zero, a), timing(zero, b)], steps=8)
    assert got == {"layers_per_token": 3.0, "gaps_per_token": 18 / 8, "cpu_us": 32_000_000 / 24 / 1e3, "gpu_gap_us": 3_000_000 / 18 / 1e3,
                   "fetch_us": 500.0, "fetch_late_share": 0.25}
    assert _timeline([timing(zero, zero)], steps=4) is None  # nothing served (the CPU engine)
    assert _timeline([timing(None, a)], steps=4) is None  # no extension
    no_gap = _timeline([timing(zero, {**zero, "served": 2, "cpu_ns": 10})], steps=1)
    assert no_gap is not None and no_gap["gpu_gap_us"] is None and no_gap["fetch_us"] is None
