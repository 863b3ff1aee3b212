"""Elastic GPU memory (engine/gpu/elastic.py): the expert cache rebuilt under a new cap between two
steps. On the CPU (DESIGN.md: the slot pool is then a CPU tensor) a tiny engine keeps generating
exactly the reference tokens and logits across a rebuild, the new pool has the slots the new cap
leaves after the fixed parts, the old executor is let go (its memory can return to the device), a
cap too small for the fixed parts changes nothing, and an engine without a cache says so. The same
on a CUDA device, through `Engine.set_gpu_memory` and the peak under the new cap: the `gpu` test."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
import torch
from checkpoints import TinySpec, qwen3_moe_text

from engine.errors import ConfigError
from engine.gpu.budget import dense_bytes, split_gpu_memory
from engine.gpu.elastic import rebuild_expert_cache
from engine.gpu.executor import CachedExpertExecutor, create_cached_executor
from engine.moe.executor import TorchExpertExecutor
from engine.sampling import SamplingParams

SPEC = TinySpec("elastic_q3", "qwen3_moe", qwen3_moe_text(num_experts=8, num_experts_per_tok=2), seed=21)
PROMPT = torch.randint(0, 100, (19,), generator=torch.Generator().manual_seed(5)).tolist()
PARAMS = SamplingParams(max_tokens=10, ignore_eos=True)


def _run(engine) -> tuple[list[int], torch.Tensor]:  # type: ignore[no-untyped-def]
    h = engine.submit(PROMPT, PARAMS, capture_logits=True)
    return h.result(timeout=120), torch.stack(h.logits)


def _fixed_bytes(engine) -> int:  # type: ignore[no-untyped-def]
    """What a cap must hold before its first expert slot (dense, KV, states, workspace)."""
    banks = engine.decoder.weights.experts
    b = split_gpu_memory(2**40, engine.cfg, engine.opts, engine.dtype,
                         dense_bytes(engine.decoder.weights, torch.device("cpu")), banks.expert_bytes)
    return b.total - b.experts


def test_rebuild_keeps_the_outputs_and_resizes_the_pool(tiny_checkpoint, make_engine) -> None:  # type: ignore[no-untyped-def]
    path, _ = tiny_checkpoint(SPEC)
    ref_tokens, ref_logits = _run(make_engine(Path(path), executor="torch"))
    engine = make_engine(Path(path), executor="torch")
    banks = engine.decoder.weights.experts
    old = create_cached_executor(banks, 4 * banks.expert_bytes, "cpu", 0.5, TorchExpertExecutor(banks))
    engine.decoder.executor = old
    tokens, logits = _run(engine)
    assert tokens == ref_tokens and old.stats.fetched > 0

    fixed = _fixed_bytes(engine)
    with engine._step_lock:  # what Engine.set_gpu_memory holds: between two steps
        budget = rebuild_expert_cache(engine.decoder, engine.opts, engine.dtype, fixed + 10 * banks.expert_bytes)
    new = engine.decoder.executor
    assert isinstance(new, CachedExpertExecutor) and new is not old
    assert budget.experts == 10 * banks.expert_bytes and new.slots.slots == 10
    assert new.ratio == 0.5 and new.cpu_executor is old.cpu_executor and new.stats.calls == 0  # empty, same split
    gone = weakref.ref(old)
    del old
    gc.collect()
    assert gone() is None  # nothing holds the old pool any more

    tokens, logits = _run(engine)
    assert tokens == ref_tokens
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    assert new.stats.hits > 0 and new.table.invariant_errors() == []

    # a cap with no room for one expert slot: refused, nothing changed
    with pytest.raises(ConfigError, match="too small"):
        rebuild_expert_cache(engine.decoder, engine.opts, engine.dtype, fixed + banks.expert_bytes - 1)
    assert engine.decoder.executor is new
    # every expert fits: the pool stops at all of them
    rebuild_expert_cache(engine.decoder, engine.opts, engine.dtype, fixed + 10**4 * banks.expert_bytes)
    assert engine.decoder.executor.slots.slots == banks.w13.shape[0]
    assert _run(engine)[0] == ref_tokens


def test_an_engine_without_a_cache_says_so(tiny_checkpoint, make_engine) -> None:  # type: ignore[no-untyped-def]
    path, _ = tiny_checkpoint(SPEC)
    engine = make_engine(Path(path), executor="torch")
    with pytest.raises(ConfigError, match="no GPU expert cache"):
        engine.set_gpu_memory(2**30)
    with pytest.raises(ConfigError, match="no GPU expert cache"):
        rebuild_expert_cache(engine.decoder, engine.opts, engine.dtype, 2**30)
    assert engine.memory_report() == {"device": "cpu", "gpu_memory": None}
    assert _run(engine)[0]  # still serving


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_set_gpu_memory_on_cuda_shrinks_and_grows_with_the_same_logits(tiny_checkpoint, make_engine) -> None:  # type: ignore[no-untyped-def]
    path, _ = tiny_checkpoint(SPEC)
    engine = make_engine(Path(path), device="cuda", dtype="float32", gpu_memory=2**31, fetch_ratio=0.5)
    runs = [_run(engine)]
    banks = engine.decoder.weights.experts
    fixed = engine.gpu_budget.total - engine.gpu_budget.experts
    for slots in (3, 12):
        report = engine.set_gpu_memory(fixed + slots * banks.expert_bytes)
        assert report["gpu_memory"]["budget"]["experts"] == slots * banks.expert_bytes
        assert engine.decoder.executor.slots.slots == slots
        runs.append(_run(engine))
        assert torch.cuda.max_memory_allocated() <= fixed + slots * banks.expert_bytes  # this engine alone so far
    ref_tokens, ref_logits = _run(make_engine(Path(path), device="cuda", executor="torch", dtype="float32"))
    for tokens, logits in runs:
        assert tokens == ref_tokens
        torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
