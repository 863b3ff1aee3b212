"""Sampling parameters and the request lifecycle behave as the public API promises.

Proves: `SamplingParams` rejects bad values with a `RequestError` naming the field; seeded
sampling is reproducible across engines and independent of batching, and differs across seeds;
top_k=1 and a tiny top_p reduce to greedy, and top-k / top-p only ever pick tokens inside their
filter; stop_token_ids and the config's eos stop generation ("stop"; eos ignored with
`ignore_eos`); max_tokens and the context limit end it ("length"); bad prompts (empty, ids out of
range, too long) raise `RequestError` at submit; abort() ends a running request (mid-decode or
mid-prefill) with "abort", the engine keeps serving and reuses exactly what the aborted request
computed; a queued request's abort takes effect without waiting for a running slot; `generate()`
streams and aborts when abandoned; close() aborts in-flight work; submit() does not wait behind a
running step; running out of KV memory fails a request with `CapacityError` without taking the
engine down. No KV or state slot leaks through any of it.
"""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path

import pytest
import torch
from checkpoints import (
    TinySpec,
    assert_no_leaks,
    copy_checkpoint,
    edit_config,
    hf_greedy,
    hf_step_logits,
    qwen3_5_moe_text,
    qwen3_moe_text,
    rel_err,
)

from engine.errors import CapacityError, RequestError
from engine.sampling import SamplingParams

Q3 = TinySpec("samp_q3", "qwen3_moe", qwen3_moe_text(num_hidden_layers=2), seed=25)
Q35 = TinySpec("samp_q35", "qwen3_5_moe", qwen3_5_moe_text(num_hidden_layers=2,
               layer_types=["linear_attention", "full_attention"]), seed=22)

PROMPT = [5, 17, 99, 3, 42, 8, 77, 120, 64, 1, 33]
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def q3(tiny_checkpoint) -> tuple[Path, torch.nn.Module]:  # type: ignore[no-untyped-def]
    return tiny_checkpoint(Q3)


@pytest.fixture(scope="module")
def q35(tiny_checkpoint) -> tuple[Path, torch.nn.Module]:  # type: ignore[no-untyped-def]
    return tiny_checkpoint(Q35)


@pytest.fixture(scope="module")
def greedy_ref(q3) -> list[int]:  # type: ignore[no-untyped-def]
    """Greedy continuation of PROMPT by the reference model."""
    return hf_greedy(q3[1], PROMPT, 24)


# ------------------------------------------------------------------------------------------ params
@pytest.mark.parametrize(("kwargs", "field"), [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-5), "max_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=math.nan), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=-0.2), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"),
])
def test_invalid_sampling_params(kwargs: dict, field: str) -> None:
    with pytest.raises(RequestError) as info:
        SamplingParams(**kwargs)
    assert field in str(info.value) and "\n" not in str(info.value)


def test_valid_sampling_params() -> None:
    p = SamplingParams(max_tokens=1, temperature=0.0, top_p=1.0, top_k=0)
    assert p.greedy
    assert SamplingParams(temperature=0.7, top_k=1).greedy
    assert not SamplingParams(temperature=0.7, top_p=0.5).greedy


# ------------------------------------------------------------------------------------------ sampling
def _run(engine, prompt: list[int], params: SamplingParams, logits: bool = False):  # type: ignore[no-untyped-def]
    h = engine.submit(prompt, params, capture_logits=logits)
    return h.result(timeout=120), h


def test_greedy_reference(q3, make_engine, greedy_ref: list[int]) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(q3[0])
    assert _run(engine, PROMPT, GREEDY)[0] == greedy_ref


def test_seeded_sampling_reproducible_across_engines(q3, make_engine) -> None:  # type: ignore[no-untyped-def]
    params = SamplingParams(max_tokens=32, temperature=1.0, seed=1234, ignore_eos=True)
    a = _run(make_engine(q3[0]), PROMPT, params)[0]
    engine = make_engine(q3[0])
    b = _run(engine, PROMPT, params)[0]
    assert a == b
    assert _run(engine, PROMPT, params)[0] == a  # again, now from the prefix cache
    c = _run(engine, PROMPT, SamplingParams(max_tokens=32, temperature=1.0, seed=1235, ignore_eos=True))[0]
    assert c != a
    assert_no_leaks(engine)


def test_seeded_sampling_independent_of_batching(q3, make_engine) -> None:  # type: ignore[no-untyped-def]
    params = SamplingParams(max_tokens=32, temperature=1.0, seed=99, ignore_eos=True)
    alone = _run(make_engine(q3[0]), PROMPT, params)[0]
    engine = make_engine(q3[0])
    other = engine.submit([9, 8, 7, 6], SamplingParams(max_tokens=40, temperature=1.0, seed=5, ignore_eos=True))
    mine = engine.submit(PROMPT, params)
    assert mine.result(timeout=120) == alone
    other.result(timeout=120)
    assert_no_leaks(engine)


def test_top_k_1_is_greedy(q3, make_engine, greedy_ref: list[int]) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(q3[0])
    got = _run(engine, PROMPT, SamplingParams(max_tokens=24, temperature=1.5, top_k=1, seed=3, ignore_eos=True))[0]
    assert got == greedy_ref


def test_tiny_top_p_is_greedy(q3, make_engine, greedy_ref: list[int]) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(q3[0])
    got = _run(engine, PROMPT, SamplingParams(max_tokens=24, temperature=1.5, top_p=1e-6, seed=3, ignore_eos=True))[0]
    assert got == greedy_ref


def test_top_k_picks_only_among_top_k(q3, make_engine, greedy_ref: list[int]) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(q3[0])
    out, h = _run(engine, PROMPT, SamplingParams(max_tokens=40, temperature=3.0, top_k=3, seed=11, ignore_eos=True),
                  logits=True)
    assert len(h.logits) == len(out) == 40
    for j, (tok, row) in enumerate(zip(out, h.logits, strict=True)):
        assert tok in torch.topk(row, 3).indices.tolist(), f"step {j}: token {tok} outside the top 3"
    assert any(tok != int(row.argmax()) for tok, row in zip(out, h.logits, strict=True)), "never sampled"


def test_top_p_picks_only_inside_the_nucleus(q3, make_engine) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(q3[0])
    temp, top_p = 2.0, 0.5
    out, h = _run(engine, PROMPT, SamplingParams(max_tokens=40, temperature=temp, top_p=top_p, seed=12,
                                                 ignore_eos=True), logits=True)
    for j, (tok, row) in enumerate(zip(out, h.logits, strict=True)):
        probs = torch.softmax(row / temp, -1)
        sorted_p, order = probs.sort(descending=True)
        before = sorted_p.cumsum(0) - sorted_p  # mass strictly before each token
        nucleus = set(order[before < top_p].tolist())
        assert tok in nucleus, f"step {j}: token {tok} outside the top-p nucleus {sorted(nucleus)}"
    assert any(tok != int(row.argmax()) for tok, row in zip(out, h.logits, strict=True)), "never sampled"


# ------------------------------------------------------------------------------------------ stopping
def _first_new_token_index(tokens: list[int], start: int) -> int:
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


def test_stop_token_ids(q3, make_engine, greedy_ref: list[int]) -> None:  # type: ignore[no-untyped-def]
    i = _first_new_token_index(greedy_ref, 4)
    unused = next(t for t in range(128) if t not in greedy_ref)
    engine = make_engine(q3[0])
    out, h = _run(engine, PROMPT, SamplingParams(max_tokens=24, stop_token_ids=(unused, greedy_ref[i])))
    assert out == greedy_ref[:i + 1] and h.finish_reason == "stop"
    assert_no_leaks(engine)


def test_eos_from_config(q3, make_engine, tmp_path: Path, greedy_ref: list[int]) -> None:  # type: ignore[no-untyped-def]
    i = _first_new_token_index(greedy_ref, 3)
    path = copy_checkpoint(q3[0], tmp_path / "eos")
    unused = next(t for t in range(128) if t not in greedy_ref)
    edit_config(path, lambda c: c.update(eos_token_id=[unused, greedy_ref[i]]))
    engine = make_engine(path)
    out, h = _run(engine, PROMPT, SamplingParams(max_tokens=24))
    assert out == greedy_ref[:i + 1] and h.finish_reason == "stop"
    out, h = _run(engine, PROMPT, SamplingParams(max_tokens=24, ignore_eos=True))
    assert out == greedy_ref and h.finish_reason == "length"


@pytest.mark.parametrize("n", [1, 2, 17])
def test_max_tokens_gives_length(q3, make_engine, greedy_ref: list[int], n: int) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(q3[0])
    out, h = _run(engine, PROMPT, SamplingParams(max_tokens=n, ignore_eos=True))
    assert out == greedy_ref[:n] and h.finish_reason == "length"
    assert h.prompt_tokens == len(PROMPT)
    assert_no_leaks(engine)


def test_context_limit_gives_length(q3, make_engine, greedy_ref: list[int]) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(q3[0], max_model_len=len(PROMPT) + 5)
    out, h = _run(engine, PROMPT, SamplingParams(max_tokens=100, ignore_eos=True))
    assert out == greedy_ref[:5] and h.finish_reason == "length"
    with pytest.raises(RequestError):
        engine.submit(list(range(len(PROMPT) + 5)), GREEDY)


# ------------------------------------------------------------------------------------------ bad prompts
@pytest.mark.parametrize("prompt", [[], [1, 2, 128], [-1], list(range(100)) * 6])
def test_bad_prompt_raises_request_error(q3, make_engine, prompt: list[int]) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(q3[0])
    with pytest.raises(RequestError) as info:
        engine.submit(prompt, GREEDY)
    assert "\n" not in str(info.value)
    assert _run(engine, PROMPT, SamplingParams(max_tokens=3, ignore_eos=True))[1].finish_reason == "length"


# ------------------------------------------------------------------------------------------ abort
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe"])
def test_abort_mid_generation(q3, q35, make_engine, family: str) -> None:  # type: ignore[no-untyped-def]
    path, model = q3 if family == "qwen3_moe" else q35
    engine = make_engine(path)
    h = engine.submit(PROMPT, SamplingParams(max_tokens=400, ignore_eos=True))
    got = []
    for tok in h:
        got.append(tok)
        if len(got) == 3:
            h.abort()
    out = h.result(timeout=60)
    assert h.finish_reason == "abort" and h.error is None
    assert out == got and 3 <= len(out) < 400
    assert_no_leaks(engine)
    # The engine keeps serving, and what the aborted request computed is reused correctly.
    ext = PROMPT + out + [7, 7]
    h2 = engine.submit(ext, SamplingParams(max_tokens=10, ignore_eos=True), capture_logits=True)
    out2 = h2.result(timeout=60)
    assert h2.finish_reason == "length"
    assert 0 < h2.cached_tokens <= len(PROMPT) + len(out)
    ref = hf_step_logits(model, ext, out2[:-1])
    assert max(rel_err(a, b) for a, b in zip(h2.logits, ref, strict=True)) <= 1e-4
    assert out2 == ref.argmax(-1).tolist()
    assert_no_leaks(engine)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe"])
def test_abort_mid_prefill_leaves_a_reusable_prefix(q3, q35, make_engine, family: str) -> None:  # type: ignore[no-untyped-def]
    """Aborted after its first 8-token prefill chunk, a request leaves those 8 tokens (and, for the
    hybrid model, the state after them) in the cache; the same prompt resumes there correctly."""
    path, model = q3 if family == "qwen3_moe" else q35
    engine = make_engine(path, prefill_chunk=8)
    prompt = [(7 * i + 3) % 128 for i in range(30)]
    step = engine.scheduler.step
    victim: list = []

    def step_then_abort() -> None:
        step()
        if victim:
            victim.pop().abort()  # after exactly one step of this request

    engine.scheduler.step = step_then_abort
    with engine._cv:  # register the victim before the engine thread can step
        h = engine.submit(prompt, GREEDY)
        victim.append(h)
    assert h.result(timeout=60) == [] and h.finish_reason == "abort"
    assert_no_leaks(engine)
    assert engine.scheduler.cache.cached_tokens == 8
    h2 = engine.submit(prompt, SamplingParams(max_tokens=6, ignore_eos=True), capture_logits=True)
    out = h2.result(timeout=60)
    assert h2.cached_tokens == 8
    ref = hf_step_logits(model, prompt, out[:-1])
    assert max(rel_err(a, b) for a, b in zip(h2.logits, ref, strict=True)) <= 1e-4
    assert out == ref.argmax(-1).tolist()
    assert_no_leaks(engine)


def test_generate_iterator_streams_and_cleans_up(q3, make_engine, greedy_ref: list[int]) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(q3[0])
    assert list(engine.generate(PROMPT, GREEDY)) == greedy_ref
    h = engine.submit(PROMPT, GREEDY)
    assert list(h) == greedy_ref == h.result()
    gen = engine.generate(PROMPT, SamplingParams(max_tokens=400, ignore_eos=True))
    first = [next(gen) for _ in range(3)]
    assert first == greedy_ref[:3]
    gen.close()  # abandoning the iterator aborts its request
    deadline = time.monotonic() + 30
    while engine.scheduler.has_work and time.monotonic() < deadline:
        time.sleep(0.01)
    assert_no_leaks(engine)


def test_abort_before_admission(q3, make_engine) -> None:  # type: ignore[no-untyped-def]
    """A queued request that is aborted ends promptly, without waiting for a running slot."""
    engine = make_engine(q3[0], max_running=1)
    running = engine.submit(PROMPT, SamplingParams(max_tokens=480, ignore_eos=True))
    next(iter(running))  # it is running now
    queued = engine.submit([1, 2, 3], GREEDY)
    queued.abort()
    try:
        queued.result(timeout=60)
        still_running = not running.done
    finally:
        running.abort()
    assert queued.finish_reason == "abort" and queued.output_ids == []
    assert still_running, "the aborted queued request only ended after the running one finished"
    running.result(timeout=60)
    assert_no_leaks(engine)


def test_close_aborts_in_flight_requests(q35, make_engine) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(q35[0], max_model_len=8192)
    h = engine.submit(PROMPT, SamplingParams(max_tokens=8000, ignore_eos=True))
    next(iter(h))
    engine.close()
    assert h.done and h.finish_reason == "abort" and len(h.output_ids) < 8000
    with pytest.raises(RequestError):
        engine.submit(PROMPT, GREEDY)


def test_submit_does_not_wait_for_a_running_step(q3, make_engine) -> None:  # type: ignore[no-untyped-def]
    """submit() from another thread returns at once even while the engine thread is inside a long
    step (a long prefill on CPU takes seconds): the step must not run under the submit lock."""
    engine = make_engine(q3[0])
    step = engine.scheduler.step
    in_step = threading.Event()

    def slow_step() -> None:
        step()
        if not in_step.is_set():  # only the first step is slow
            in_step.set()
            time.sleep(0.5)

    engine.scheduler.step = slow_step
    running = engine.submit(PROMPT, SamplingParams(max_tokens=4, ignore_eos=True))
    assert in_step.wait(30)
    t0 = time.monotonic()
    queued = engine.submit([1, 2, 3], SamplingParams(max_tokens=1))
    waited = time.monotonic() - t0
    running.result(timeout=60)
    queued.result(timeout=60)
    assert waited < 0.25, f"submit() blocked {waited:.2f}s behind a running step"


# ------------------------------------------------------------------------------------------ capacity
def test_kv_exhaustion_fails_a_request_not_the_engine(q3, make_engine, greedy_ref: list[int]) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(q3[0], kv_tokens=48)
    handles = [engine.submit([*PROMPT, i], SamplingParams(max_tokens=30, ignore_eos=True)) for i in range(3)]
    outcomes = []
    for h in handles:
        try:
            h.result(timeout=120)
            outcomes.append(h.finish_reason)
        except CapacityError as e:
            assert h.finish_reason == "error" and "\n" not in str(e)
            outcomes.append("capacity")
    assert "capacity" in outcomes, outcomes  # 3 x 41 tokens cannot fit in 48 slots at once
    assert set(outcomes) <= {"length", "capacity"}, outcomes
    assert_no_leaks(engine)
    out, h = _run(engine, PROMPT, GREEDY)
    assert out == greedy_ref and h.finish_reason == "length"
    assert_no_leaks(engine)
