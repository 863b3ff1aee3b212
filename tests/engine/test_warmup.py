"""engine/warmup.py: the warm-up runs its planned requests (the resumed one served from the first
one's checkpoint), leaves no cached prefix or checkpoint behind, and changes no later result: a
request after the warm-up gives the same greedy tokens and logits as on an engine that never warmed
up. The plan keeps every request inside the KV pool."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from checkpoints import FULL, LIN, TinySpec, qwen3_5_moe_text

from engine import late_work
from engine.engine import Engine
from engine.sampling import SamplingParams
from engine.warmup import DECODE_STEPS, plan, warm_up

HYBRID = TinySpec("warmup_q35", "qwen3_5_moe", qwen3_5_moe_text(layer_types=[LIN, LIN, FULL, LIN]), seed=31)


@pytest.mark.parametrize("kv", [24, 64, 256, 4096, 32768])
@pytest.mark.parametrize("step", [0, 8])
def test_plan_fits_the_pool(kv: int, step: int) -> None:
    requests, mid = plan(1024, kv, step)
    if kv == 24:  # not even the first request fits (16 + 11 tokens + decode): no warm-up
        assert requests == []
        return
    base = requests[0][1]
    assert requests[0][0] == 0 and 0 < mid < base
    for shared, new in requests:
        assert shared in (0, base, mid) and new > 0
        assert shared + new + DECODE_STEPS < kv
    if kv >= 4096:  # every regime: a full chunk, extensions of each size, a resume
        extensions = {n for s, n in requests if s == base}
        assert base == 1024 + 11 and extensions == {2, 5, 8, 45, 96, 304, 333} | ({step} if step else set())
        assert (mid, 200) in requests and (0, 333) in requests


def test_warm_up_leaves_nothing_and_changes_no_result(
        tiny_checkpoint: Callable[[TinySpec], tuple], make_engine: Callable[..., Engine]) -> None:
    ckpt, _ = tiny_checkpoint(HYBRID)
    opts = {"device": "cpu", "kv_tokens": 512, "prefill_chunk": 64}
    warm, cold = make_engine(ckpt, **opts), make_engine(ckpt, **opts)
    done = warm_up(warm)
    requests, _ = plan(64, 512, 0)
    assert done["requests"] == len(requests)
    assert done["prompt_tokens"] == sum(s + n for s, n in requests)
    # every extension reused the whole base prompt, the last request the checkpoint at `mid`
    assert done["reused_tokens"] == sum(s for s, _ in requests), done
    assert warm.stats()["kv_tokens_used"] == 0 and warm.checkpoints() == []
    prompt = [int(t) for t in torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(5))]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    a, b = warm.submit(prompt, params, capture_logits=True), cold.submit(prompt, params, capture_logits=True)
    list(a), list(b)
    assert a.cached_tokens == 0
    assert a.output_ids == b.output_ids
    for x, y in zip(a.logits, b.logits, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


def test_late_work_counts_only_while_watched() -> None:
    seen: list[tuple[str, str, float]] = []
    late_work.note("compile", "before", 1.0)  # not watching: dropped
    hooked = late_work.watch(lambda kind, name, s: seen.append((kind, name, s)))
    try:
        late_work.note("capture", "decode 1", 0.5)
        late_work.note("capture", "decode 2", 0.25)
        if hooked:  # the installed Triton's JIT hooks are ours: a compile passes through them
            import triton

            runtime = triton.knobs.runtime
            assert runtime.jit_cache_hook(key=None, repr="", fn=None, compile={}, is_manual_warmup=False,
                                          already_compiled=False) is False  # compiling goes on

            class Fn:
                name = "kern"
                module = "engine.gpu.quant.gemv"

            runtime.jit_post_compile_hook(key=None, repr="kern[num_warps=4, num_stages=3](x_ptr: *bf16, K: i32, FMT: 7)",
                                          fn=Fn(), compile={}, is_manual_warmup=False, already_compiled=False)
            assert seen[-1][1] == "engine.gpu.quant.gemv.kern (x_ptr: *bf16, K: i32, FMT: 7)"
        assert late_work.totals()["capture"] == (2, 0.75)
        assert [k for k, _, _ in seen] == ["capture", "capture"] + (["compile"] if hooked else [])
        assert late_work.totals().get("compile", (0, 0.0))[0] == (1 if hooked else 0)
    finally:
        late_work.unwatch()
    late_work.note("capture", "after", 1.0)
    assert len(seen) == 2 + hooked
    if hooked:
        import triton

        assert triton.knobs.runtime.jit_post_compile_hook is None


@pytest.mark.gpu
def test_nothing_compiles_after_the_warm_up(tiny_checkpoint: Callable[[TinySpec], tuple],
                                            make_engine: Callable[..., Engine]) -> None:
    """An agent-like session after the warm-up (a long first prompt, appends of a few to a few hundred
    tokens on both sides of 16's multiples, and of 3 and 7 tokens (decode attention's small passes), a
    resume from a mid-prompt checkpoint, decode) compiles no
    Triton kernel and captures no graph that the warm-up did not."""
    ckpt, _ = tiny_checkpoint(HYBRID)
    engine = make_engine(ckpt, device="cuda", kv_tokens=512, prefill_chunk=128)
    warm_up(engine)
    seen: list[tuple[str, str, float]] = []
    late_work.watch(lambda kind, name, s: seen.append((kind, name, s)))
    try:
        gen = torch.Generator().manual_seed(9)
        prompt = torch.randint(0, 128, (190,), generator=gen).tolist()
        params = SamplingParams(max_tokens=12, ignore_eos=True)
        for i, extra in enumerate([0, 86, 95, 21, 18, 0, 21, 17, 3, 20, 7]):  # 478 tokens in all
            prompt = prompt + torch.randint(0, 128, (extra,), generator=gen).tolist()
            at = [len(prompt) - 50, len(prompt)] if i % 3 == 0 else [len(prompt)]
            handle = engine.submit(prompt if i != 5 else prompt[:150] + prompt[170:], params, checkpoints=at,
                                   session="late-work")
            list(handle)
            assert handle.error is None
    finally:
        late_work.unwatch()
    assert seen == []
