"""CachedExpertExecutor (engine/gpu/executor.py) gives the torch reference's outputs, with the CPU
standing in for the GPU: for slot pools of 0 slots, a few slots and every expert, fetch ratios 0
(every miss on the CPU), 1 (every miss fetched) and in between, with the torch and the native CPU
executor for misses. Bit-identical where the executor promises it (every entry on one side, or
top-1 routing); otherwise equal up to float summation order. Also: the slot pool holds exactly
the bank rows the cache table says, and a tiny model generates the same tokens and logits
through the cache as through the torch executor.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from checkpoints import FULL, LIN, TinySpec, qwen3_5_moe_text, qwen3_moe_text

from engine.gpu.cache_table import CacheTable
from engine.gpu.executor import CachedExpertExecutor, cpu_entries, create_cached_executor
from engine.gpu.slots import ExpertSlots
from engine.moe.base import ExpertExecutor
from engine.moe.executor import TorchExpertExecutor
from engine.moe.native import native_unsupported
from engine.sampling import SamplingParams
from engine.weights.layout import ExpertBanks

L, E, H, INTER = 3, 8, 32, 24
RATIOS = [0.0, 0.4, 1.0]


def _banks(seed: int = 0) -> ExpertBanks:
    g = torch.Generator().manual_seed(seed)
    return ExpertBanks(torch.randn(L * E, 2 * INTER, H, generator=g) / H ** 0.5,
                       torch.randn(L * E, H, INTER, generator=g) / INTER ** 0.5, E)


def _cpu(kind: str, banks: ExpertBanks) -> ExpertExecutor:
    if kind == "native":
        why = native_unsupported(banks, "cpu")
        if why:
            pytest.skip(why)
        from engine.moe.native import NativeExpertExecutor

        return NativeExpertExecutor(banks)
    return TorchExpertExecutor(banks)


def _steps(k: int, n_steps: int, seed: int):  # type: ignore[no-untyped-def]
    """Decode-like (N=1) and prefill-like (N=5) calls over every layer, routing skewed to a few
    experts so the cache sees hits, misses and evictions."""
    g = torch.Generator().manual_seed(seed)
    probs = torch.tensor([2.0 ** -(e % 5) for e in range(E)])
    for step in range(n_steps):
        n = 5 if step % 4 == 0 else 1
        x = torch.randn(n, H, generator=g)
        ids = torch.stack([torch.multinomial(probs, k, replacement=False, generator=g) for _ in range(n)])
        w = torch.rand(n, k, generator=g)
        for layer in range(L):
            yield x, ids, w, layer


def _slot_pool_matches_table(ex: CachedExpertExecutor) -> None:
    for flat, slot in ex.table.resident().items():
        assert torch.equal(ex.slots.w13[slot], ex.banks.w13[flat]) and torch.equal(ex.slots.w2[slot], ex.banks.w2[flat])


@pytest.mark.parametrize("cpu", ["torch", "native"])
@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize("slots", [0, 5, L * E])
def test_matches_torch_reference(slots: int, ratio: float, cpu: str) -> None:
    banks = _banks()
    ref = TorchExpertExecutor(banks)
    ex = create_cached_executor(banks, slots * banks.expert_bytes, "cpu", ratio, _cpu(cpu, banks))
    assert ex.slots.slots == slots
    for x, ids, w, layer in _steps(k=3, n_steps=12, seed=1):
        want = ref(x, ids, w, layer)
        got = ex(x, ids, w, layer)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert ex.table.invariant_errors() == []
        _slot_pool_matches_table(ex)
    s = ex.stats
    assert s.calls == 12 * L and s.fetched <= s.misses
    if slots == 0 or ratio == 0:
        assert s.fetched == 0 and s.hits == 0
    else:
        assert s.fetched > 0
    if slots == L * E and ratio == 1.0:
        assert s.fetched == s.misses  # everything fits: every miss is fetched once, then hits
        assert s.misses <= L * E and s.hits > 0


@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize("slots", [0, 5, L * E])
def test_bit_identical_where_promised(slots: int, ratio: float) -> None:
    banks = _banks(seed=2)
    ref = TorchExpertExecutor(banks)
    top1 = create_cached_executor(banks, slots * banks.expert_bytes, "cpu", ratio, TorchExpertExecutor(banks))
    for x, ids, w, layer in _steps(k=1, n_steps=10, seed=3):  # top-1: nothing to sum across experts
        assert torch.equal(top1(x, ids, w, layer), ref(x, ids, w, layer))
    if slots == 0 or ratio == 0:  # every entry on the CPU
        topk = create_cached_executor(banks, slots * banks.expert_bytes, "cpu", ratio, TorchExpertExecutor(banks))
        for x, ids, w, layer in _steps(k=3, n_steps=10, seed=4):
            assert torch.equal(topk(x, ids, w, layer), ref(x, ids, w, layer))


def test_all_resident_is_bit_identical() -> None:
    banks = _banks(seed=5)
    ref = TorchExpertExecutor(banks)
    ex = create_cached_executor(banks, L * E * banks.expert_bytes, "cpu", 1.0, TorchExpertExecutor(banks))
    for x, ids, w, layer in _steps(k=3, n_steps=6, seed=6):
        ex(x, torch.arange(E).repeat(x.shape[0], 1), torch.ones(x.shape[0], E), layer)  # warm: all resident
        before = ex.stats.misses
        assert torch.equal(ex(x, ids, w, layer), ref(x, ids, w, layer))
        assert ex.stats.misses == before


def test_overlapped_cpu_branch_matches() -> None:
    # the worker-thread path a GPU device takes, forced on the CPU stand-in
    banks = _banks(seed=7)
    ref = TorchExpertExecutor(banks)
    slots = ExpertSlots.from_budget(banks, 6 * banks.expert_bytes)
    ex = CachedExpertExecutor(banks, slots, CacheTable(L, E, 6), TorchExpertExecutor(banks), 0.5, overlap=True)
    try:
        for x, ids, w, layer in _steps(k=3, n_steps=8, seed=8):
            torch.testing.assert_close(ex(x, ids, w, layer), ref(x, ids, w, layer), rtol=1e-5, atol=1e-6)
        assert ex._worker is not None and ex.stats.fetched > 0
    finally:
        ex.close()
    assert ex._worker is None


def test_cpu_entries_keep_only_cpu_work() -> None:
    ids = torch.tensor([[4, 1, 7], [2, 4, 6]])
    w = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]])
    on_cpu = torch.tensor([[False, True, True], [False, False, False]])
    got = cpu_entries(ids, w, on_cpu)
    assert got is not None
    tokens, cids, cw = got
    assert tokens.tolist() == [0] and cids.tolist() == [[1, 7]]  # token 1 has no CPU work
    assert torch.equal(cw, torch.tensor([[0.2, 0.3]]))
    on_cpu = torch.tensor([[False, True, False], [True, True, True]])
    tokens, cids, cw = cpu_entries(ids, w, on_cpu)  # type: ignore[misc]
    assert tokens.tolist() == [0, 1] and cids.tolist() == [[1, 1, 1], [2, 4, 6]]  # padded with its own expert
    assert torch.equal(cw, torch.tensor([[0.2, 0.0, 0.0], [0.4, 0.5, 0.6]]))
    assert cpu_entries(ids, w, torch.zeros_like(on_cpu)) is None


def test_mismatched_parts_are_refused() -> None:
    banks = _banks()
    slots = ExpertSlots.from_budget(banks, 4 * banks.expert_bytes)
    with pytest.raises(ValueError):
        CachedExpertExecutor(banks, slots, CacheTable(L, E, 3), TorchExpertExecutor(banks), 0.5)
    with pytest.raises(ValueError):
        CachedExpertExecutor(banks, slots, CacheTable(L, E, 4), TorchExpertExecutor(banks), 1.5)
    assert ExpertSlots.slots_for_budget(banks, 10 ** 12) == L * E  # never more slots than experts
    assert ExpertSlots.slots_for_budget(banks, banks.expert_bytes - 1) == 0


# ------------------------------------------------------------------ end to end, tiny models
SPECS = [
    TinySpec("gpucache_q3", "qwen3_moe", qwen3_moe_text(num_experts=8, num_experts_per_tok=2), seed=11),
    TinySpec("gpucache_q35", "qwen3_5_moe", qwen3_5_moe_text(num_hidden_layers=2, layer_types=[LIN, FULL]), seed=12),
]


def _generate(engine, prompt: list[int], params: SamplingParams) -> tuple[list[int], torch.Tensor]:  # type: ignore[no-untyped-def]
    h = engine.submit(prompt, params, capture_logits=True)
    out = h.result(timeout=120)
    return out, torch.stack(h.logits)


@pytest.mark.parametrize("spec", SPECS, ids=repr)
@pytest.mark.parametrize(("slots_frac", "ratio"), [(0.0, 1.0), (0.25, 0.0), (0.25, 0.5), (0.25, 1.0), (1.0, 1.0)])
def test_tiny_model_generates_the_same(spec: TinySpec, slots_frac: float, ratio: float, tiny_checkpoint,  # type: ignore[no-untyped-def]
                                       make_engine) -> None:
    path, _ = tiny_checkpoint(spec)
    prompt = torch.randint(0, 100, (23,), generator=torch.Generator().manual_seed(7)).tolist()
    params = SamplingParams(max_tokens=12, ignore_eos=True)

    run = functools.partial(_generate, prompt=prompt, params=params)

    ref_tokens, ref_logits = run(make_engine(Path(path), executor="torch"))
    engine = make_engine(Path(path), executor="torch")
    banks = engine.decoder.weights.experts
    n = int(slots_frac * banks.w13.shape[0])
    cached = create_cached_executor(banks, n * banks.expert_bytes, "cpu", ratio, TorchExpertExecutor(banks))
    engine.decoder.executor = cached
    tokens, logits = run(engine)
    assert tokens == ref_tokens
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    s = cached.stats
    assert s.calls > 0 and cached.table.invariant_errors() == []
    if n == 0 or ratio == 0:
        assert s.hits == 0 and s.fetched == 0
    else:
        assert s.hits > 0 and s.fetched > 0


def _with_streaming_cache(engine) -> CachedExpertExecutor:  # type: ignore[no-untyped-def]
    """Gives `engine` a cached executor on the CPU with room for the two streamed layer buffers plus
    four slots (every other expert in host banks), ratio 0.5; returns it."""
    banks = engine.decoder.weights.experts
    cached = create_cached_executor(banks, (2 * banks.num_experts + 4) * banks.expert_bytes, "cpu", 0.5,
                                    TorchExpertExecutor(banks))
    assert cached.streamer is not None
    engine.decoder.executor = cached
    return cached


def test_engine_prefill_streams_through_two_layer_buffers(tiny_checkpoint, make_engine) -> None:  # type: ignore[no-untyped-def]
    """A prompt chunk with dense routing goes through the streamer (started before the embedding by
    the decoder's begin_forward), decode through the per-layer plan, and the tokens and logits are
    the reference's."""
    spec = TinySpec("gpucache_stream", "qwen3_moe", qwen3_moe_text(num_experts=8, num_experts_per_tok=2,
                                                                   num_hidden_layers=4), seed=13)
    path, _ = tiny_checkpoint(spec)
    prompt = torch.randint(0, 100, (40,), generator=torch.Generator().manual_seed(9)).tolist()
    params = SamplingParams(max_tokens=8, ignore_eos=True)

    run = functools.partial(_generate, prompt=prompt, params=params)

    ref_tokens, ref_logits = run(make_engine(Path(path), executor="torch"))
    engine = make_engine(Path(path), executor="torch")
    cached = _with_streaming_cache(engine)
    banks = engine.decoder.weights.experts
    E, rows = banks.num_experts, banks.w13.shape[0]
    assert cached.prefill_entries <= 40 * 2 and rows > 2 * E + 4
    starts: list[int | None] = []
    start = cached.streamer.start

    def recording_start(first_moe_index: int | None = 0) -> None:
        starts.append(first_moe_index)
        start(first_moe_index)

    cached.streamer.start = recording_start  # type: ignore[method-assign]
    tokens, logits = run(engine)
    assert tokens == ref_tokens
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    assert starts[0] == 0  # the decoder's begin_forward issued layer 0's copies before any layer ran
    st = cached.streamer.stats
    assert st.chunks == 1 and st.layers == rows // E and not cached.streamer.active
    assert cached.table.invariant_errors() == [] and cached.stats.calls > 0  # decode went through the plan


def test_unknown_plan_is_refused_at_construction(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from engine.errors import ConfigError

    banks = ExpertBanks(torch.zeros(2 * 4, 8, 4), torch.zeros(2 * 4, 4, 4), 4)
    with pytest.raises(ConfigError, match="unknown cache plan 'quick'"):
        create_cached_executor(banks, 2 * banks.expert_bytes, "cpu", 0.5, TorchExpertExecutor(banks), plan="quick")
    from engine.options import EngineOptions

    with pytest.raises(ConfigError, match="FREETOKEN_PLAN='fast'"):
        EngineOptions.resolve({}, {"FREETOKEN_PLAN": "fast"})
    assert EngineOptions.resolve({}, {"FREETOKEN_PLAN": "torch"}).gpu.plan == "torch"
    with pytest.raises(ConfigError, match=r"FREETOKEN_ADAPT_RATIO=1\) needs"):  # the online ratio needs the fused plan
        create_cached_executor(banks, 2 * banks.expert_bytes, "cpu", 0.5, TorchExpertExecutor(banks),
                               adapt=True, plan="torch")


def test_forward_dying_midway_through_a_streamed_chunk(tiny_checkpoint, make_engine) -> None:  # type: ignore[no-untyped-def]
    """A forward that fails after the streamer took its buffers (here: at the third MoE layer of the
    first chunk) fails that request with a clear error; the next forward gives the buffers back, the
    cache table stays consistent, and the engine goes on serving the reference's tokens and logits."""
    from engine.errors import EngineError

    spec = TinySpec("gpucache_stream_dies", "qwen3_moe", qwen3_moe_text(num_experts=8, num_experts_per_tok=2,
                                                                        num_hidden_layers=4), seed=17)
    path, _ = tiny_checkpoint(spec)
    prompt = torch.randint(0, 100, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    ref_tokens, ref_logits = _generate(make_engine(Path(path), executor="torch"), prompt, params)

    engine = make_engine(Path(path), executor="torch")
    cached = _with_streaming_cache(engine)
    layer = cached.streamer.layer
    failures = []

    def dying_layer(x, ids, weights, moe_index, next_moe_index=None):  # type: ignore[no-untyped-def]
        if moe_index == 2 and not failures:
            failures.append(moe_index)
            raise RuntimeError("injected failure in MoE layer 2")
        return layer(x, ids, weights, moe_index, next_moe_index)

    cached.streamer.layer = dying_layer  # type: ignore[method-assign]
    with pytest.raises(EngineError, match="injected failure in MoE layer 2"):
        engine.submit(prompt, params).result(timeout=120)
    assert failures == [2] and cached.streamer.active  # it died holding the two layer buffers
    tokens, logits = _generate(engine, prompt, params)
    assert tokens == ref_tokens
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    assert not cached.streamer.active and cached.table.reserved() == []
    assert cached.table.invariant_errors() == []
    _slot_pool_matches_table(cached)


def test_torch_fallback_for_cpu_misses_is_announced(caplog: pytest.LogCaptureFixture) -> None:
    """Banks the native executor cannot serve (float16) get the torch reference, with a warning that
    says why; servable ones get the native executor without one."""
    from engine.gpu.executor import default_cpu_executor

    g = torch.Generator().manual_seed(0)
    half = ExpertBanks(torch.randn(4, 8, 16, generator=g).half(), torch.randn(4, 16, 4, generator=g).half(), 4)
    with caplog.at_level("WARNING", logger="freetoken.engine"):
        ex = default_cpu_executor(half)
    assert isinstance(ex, TorchExpertExecutor)
    assert any("torch reference" in r.getMessage() and "float16" in r.getMessage() for r in caplog.records)
    banks = _banks()
    if native_unsupported(banks, "cpu") is None:
        caplog.clear()
        with caplog.at_level("WARNING", logger="freetoken.engine"):
            assert not isinstance(default_cpu_executor(banks), TorchExpertExecutor)
        assert not caplog.records


def test_check_reports_a_new_host_task_failure_once_and_empties_the_cache(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """CachedExpertExecutor.check (the scheduler calls it after every forward): nothing failed ->
    returns after one read of the native failure counter; a step with a new failure -> EngineError
    naming it, the cache table emptied (a failed fetch may leave stale rows in resident slots);
    the same failure is not reported twice. (DeviceStep's per-layer report and the native counter
    are checked on the GPU machine and in tests/native.)"""
    import native.ftnative as ft
    from engine.errors import EngineError

    banks = ExpertBanks(torch.randn(2 * 4, 8, 4), torch.randn(2 * 4, 4, 4), 4)
    ex = create_cached_executor(banks, 3 * banks.expert_bytes, "cpu", 0.5, TorchExpertExecutor(banks))
    ex.check()  # no decode steps: nothing to check
    counter = [0]
    monkeypatch.setattr(ft, "host_task_failures", lambda: counter[0])

    class Step:
        def __init__(self) -> None:
            self.pending: str | None = None

        def check(self) -> None:
            if self.pending:
                why, self.pending = self.pending, None
                raise RuntimeError(why)

    step = Step()
    ex._steps[1] = step  # type: ignore[assignment]
    ex.table.step.add_(1)
    ex.table.register(ex.table.reserve(2), [1, 6])
    assert len(ex.table.resident()) == 2
    ex.check()  # the counter has not moved
    step.pending, counter[0] = "MoE layer 1's CPU branch failed 1 of 5 runs: boom", 1
    with pytest.raises(EngineError, match="boom"):
        ex.check()
    assert ex.table.resident() == {} and ex.table.invariant_errors() == []
    step.pending, counter[0] = "not yet", 2
    ex.check(tokens=ex.step_tokens + 100)  # a prefill-sized pass ran no device step: not looked at
    assert step.pending == "not yet"
    step.pending, counter[0] = None, 1
    ex.check()  # reported once
    ex.table.register(ex.table.reserve(1), [3])
    ex.check()
    assert list(ex.table.resident()) == [3]
