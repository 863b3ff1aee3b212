"""Overlapped decode (engine/decode_pipeline.py) gives what the serial scheduler gives.

Off CUDA the pipeline's logic runs synchronously through the eager decode pass (nothing captured),
which is what these CPU tests check against the same engine with the overlap off: the tokens of
greedy and seeded sampled requests finishing at different steps, a stop id, an abort, decode
anchors' checkpoints and what a later request restores from them, a failed draw, and that the
staged passes really ran. The overlap itself (passes queued on the GPU before the tokens are read)
runs in tests/engine/gpu_cache/test_gpu_memory_cuda.py on the GPU machine."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.anchors import DecodeAnchor
from engine.engine import Engine
from engine.errors import ConfigError
from engine.moe.base import ExpertExecutor
from engine.options import EngineOptions
from engine.sampling import SamplingParams

OPTS = dict(dtype="float32", kv_tokens=1024, max_running=4, prefill_chunk=64)


class CaptureSafe(ExpertExecutor):
    """The executor's call marked safe inside a decode pass (on the CPU nothing is captured)."""

    def __init__(self, inner: Callable[..., torch.Tensor]) -> None:
        self.inner = inner

    def capturable(self, tokens: int) -> bool:
        return True

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, moe_index: int) -> torch.Tensor:
        return self.inner(x, ids, weights, moe_index)


def _engine(model: Path, overlap: bool, width: int = 4) -> Engine:
    """Passes of up to four sequences overlap here unless `width` says otherwise (the default is
    one: engine/decode_pipeline.py)."""
    eng = Engine(model, EngineOptions(**OPTS, overlap_decode=overlap, overlap_width=width))  # type: ignore[arg-type]
    eng.decoder.executor = CaptureSafe(eng.decoder.executor)
    eng.decoder.cuda_graphs = True  # the decode passes go through engine/model/decode_graph.py
    return eng


def _staged(eng: Engine) -> int:
    return eng.scheduler.staged_passes


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen3_5_moe"])
def model(request: pytest.FixtureRequest, demo_model: Callable[[str], Path]) -> Path:
    return demo_model(request.param)


def test_switch() -> None:
    assert EngineOptions.resolve({"overlap_decode": True}, {}).overlap_decode
    assert not EngineOptions.resolve({"overlap_decode": False}, {}).overlap_decode


def test_switch_from_environment() -> None:
    """The option given (the CLI's flag) beats the environment; the environment beats the default."""
    assert not EngineOptions.resolve({"overlap_decode": False}, {"FREETOKEN_OVERLAP_DECODE": "1"}).overlap_decode
    assert not EngineOptions.resolve({}, {"FREETOKEN_OVERLAP_DECODE": "0"}).overlap_decode
    assert EngineOptions.resolve({}, {"FREETOKEN_OVERLAP_DECODE": "1"}).overlap_decode
    with pytest.raises(ConfigError, match="FREETOKEN_OVERLAP_DECODE"):
        EngineOptions.resolve({}, {"FREETOKEN_OVERLAP_DECODE": "sometimes"})


def test_width_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FREETOKEN_OVERLAP_WIDTH", raising=False)
    assert EngineOptions.resolve().overlap_width == 1
    monkeypatch.setenv("FREETOKEN_OVERLAP_WIDTH", "3")
    assert EngineOptions.resolve().overlap_width == 3
    for bad in ("0", "two"):
        monkeypatch.setenv("FREETOKEN_OVERLAP_WIDTH", bad)
        with pytest.raises(ConfigError, match="FREETOKEN_OVERLAP_WIDTH"):
            EngineOptions.resolve()


def test_by_default_only_single_sequence_passes_overlap(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two requests, the second longer: while both decode every pass is serial; once the first has
    ended the other's passes are staged."""
    with _engine(model, True, width=1) as eng:
        handles = [eng.submit(list(range(300, 330)), SamplingParams(max_tokens=6, ignore_eos=True)),
                   eng.submit(list(range(340, 360)), SamplingParams(max_tokens=30, ignore_eos=True))]
        outs = [h.result(timeout=300) for h in handles]
        pipeline = eng.scheduler.pipeline
        assert pipeline is not None and pipeline.width == 1
        passes = {n: g.steps for n, g in eng.decoder.graphs.items()}
        by_width = dict(pipeline.staged_by_width)
    assert [len(o) for o in outs] == [6, 30]
    # two-sequence passes all ran through the serial forward; of the ~24 one-sequence passes all
    # but the graph's first, the start of the pipeline and the last are staged
    assert passes[2] >= 4 and 2 not in by_width and by_width[1] >= 15


def test_concurrent_requests_get_the_serial_tokens(model: Path) -> None:
    """Four requests decoding together (greedy, and sampled with a seed, with top-k and top-p),
    ending at different steps: every token as in the serial engine, and most passes staged."""
    prompts = [list(range(300 + 7 * i, 340 + 5 * i)) for i in range(4)]
    params = [SamplingParams(max_tokens=12, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=0.8, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=1.3, top_k=20, seed=11, ignore_eos=True),
              SamplingParams(max_tokens=16, temperature=0.9, top_p=0.8, seed=3, ignore_eos=True)]

    def run(overlap: bool) -> tuple[list[list[int]], int]:
        with _engine(model, overlap) as eng:
            handles = [eng.submit(p, sp) for p, sp in zip(prompts, params, strict=True)]
            return [h.result(timeout=300) for h in handles], _staged(eng)

    want, none = run(False)
    got, staged = run(True)
    assert got == want
    assert [len(t) for t in got] == [12, 20, 6, 16]
    # 4, 3, 2 then 1 sequences: per width the graph's first pass and the pass that starts the
    # pipeline are built serially, and no pass follows one whose token ends a request by length
    assert none == 0 and staged >= 8


def test_a_stop_id_ends_the_request_and_its_prefix_is_reused(model: Path) -> None:
    """A greedy request stopped by a stop id mid-stream: the same tokens and finish as serial, and a
    follow-up request over prompt + output reuses as much of it as after the serial run."""
    prompt = list(range(300, 340))
    with _engine(model, False) as eng:
        free_run = list(eng.generate(prompt, SamplingParams(max_tokens=12, ignore_eos=True)))
    stop = free_run[7]
    params = SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=(stop,))
    results = []
    for overlap in (False, True):
        with _engine(model, overlap) as eng:
            h = eng.submit(prompt, params)
            out = h.result(timeout=300)
            follow = eng.submit(prompt + out + [301, 302], SamplingParams(max_tokens=4, ignore_eos=True))
            tail = follow.result(timeout=300)
            results.append((out, h.finish_reason, follow.reuse, tail))
            assert _staged(eng) > 0 if overlap else _staged(eng) == 0
    (out_s, why_s, reuse_s, tail_s), (out_o, why_o, reuse_o, tail_o) = results
    assert out_o == out_s == free_run[:free_run.index(stop) + 1] and why_o == why_s == "stop"
    assert reuse_o is not None and reuse_s is not None
    assert reuse_o.kv_tokens >= reuse_s.kv_tokens and tail_o == tail_s


def test_decode_anchors_checkpoint_where_serial_does(model: Path) -> None:
    """Decode anchors on generated tokens: the checkpoints sit at the serial run's positions, and a
    request resuming after them computes the serial run's tokens."""
    prompt = list(range(310, 350))
    with _engine(model, False) as eng:
        free_run = list(eng.generate(prompt, SamplingParams(max_tokens=16, ignore_eos=True)))
    anchors = [DecodeAnchor(token_id=free_run[5], kind="tool_call_end", priority=2)]
    listings, tails = [], []
    for overlap in (False, True):
        with _engine(model, overlap) as eng:
            h = eng.submit(prompt, SamplingParams(max_tokens=16, ignore_eos=True), decode_anchors=anchors,
                           session="s")
            out = h.result(timeout=300)
            assert out == free_run
            listings.append([(c["position"], c["kind"]) for c in eng.checkpoints("s")])
            follow = eng.submit(prompt + out[:8] + [333, 334], SamplingParams(max_tokens=6, ignore_eos=True),
                                session="s")
            tails.append((follow.result(timeout=300), follow.reuse))
            assert _staged(eng) > 0 if overlap else _staged(eng) == 0
    assert listings[1] == listings[0]
    assert tails[1][0] == tails[0][0]
    if eng.cfg.is_hybrid:  # the anchor's checkpoint is where the follow-up resumes
        assert any(kind == "tool_call_end" for _, kind in listings[0])
        assert tails[1][1] is not None and tails[0][1] is not None
        assert tails[1][1].state_position == tails[0][1].state_position > len(prompt)


def test_an_abort_mid_stream_leaves_the_others_as_serial(model: Path) -> None:
    prompts = [list(range(300, 330)), list(range(350, 372))]
    params = SamplingParams(max_tokens=20, ignore_eos=True)

    def run(overlap: bool) -> tuple[list[int], list[int], str | None]:
        with _engine(model, overlap) as eng:
            seen: list[int] = []
            holder: dict[str, object] = {}

            def listen(token: int | None) -> None:
                if token is not None:
                    seen.append(token)
                    if len(seen) == 5:
                        holder["h"].abort()  # type: ignore[attr-defined]

            first = eng.submit(prompts[0], params, listener=listen)
            holder["h"] = first
            second = eng.submit(prompts[1], params)
            out = second.result(timeout=300)
            first.result(timeout=300)
            assert _staged(eng) > 0 if overlap else _staged(eng) == 0
            return seen, out, first.finish_reason

    seen_s, out_s, why_s = run(False)
    seen_o, out_o, why_o = run(True)
    assert why_o == why_s == "abort"
    assert out_o == out_s and len(out_o) == 20
    assert seen_o[:5] == seen_s[:5] and len(seen_o) <= 6  # at most the token already drawn


def test_a_failed_draw_fails_its_request_only(model: Path) -> None:
    """NaN logits for one request at one step: that request ends with the sampler's error, the
    other one gets the serial tokens, and the engine goes on serving."""
    prompts = [list(range(300, 330)), list(range(350, 372))]
    params = SamplingParams(max_tokens=14, temperature=0.7, seed=5, ignore_eos=True)

    def run(overlap: bool) -> tuple[str | None, list[int]]:
        with _engine(model, overlap) as eng:
            dec = eng.decoder
            real = dec.logits
            calls = {"n": 0}

            def poisoned(hidden: torch.Tensor) -> torch.Tensor:
                out = real(hidden)
                calls["n"] += 1
                if calls["n"] == 6 and out.shape[0] == 2:
                    out = out.clone()
                    out[0] = float("nan")
                return out

            dec.logits = poisoned  # type: ignore[method-assign]
            bad = eng.submit(prompts[0], params)
            good = eng.submit(prompts[1], params)
            out = good.result(timeout=300)
            with pytest.raises(Exception, match="cannot sample"):
                bad.result(timeout=300)
            again = list(eng.generate(prompts[0], SamplingParams(max_tokens=3, ignore_eos=True)))
            assert len(again) == 3
            assert _staged(eng) > 0 if overlap else _staged(eng) == 0
            return bad.finish_reason, out

    want = run(False)
    got = run(True)
    assert got == want and got[0] == "error"


def test_a_drain_request_empties_the_pipeline_for_one_step(model: Path) -> None:
    """What the engine's once-a-second counter read asks for: after `request_drain()` the next token
    arrives with nothing in flight (its pass completed, none queued behind it); then the overlap
    resumes, and the tokens are the serial engine's."""
    prompt = list(range(300, 330))
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    with _engine(model, False) as eng:
        want = list(eng.generate(prompt, params))
    with _engine(model, True) as eng:
        pipeline = eng.scheduler.pipeline
        assert pipeline is not None
        in_flight: list[int] = []

        def listen(token: int | None) -> None:  # the engine thread, inside the step
            if token is None:
                return
            in_flight.append(len(pipeline.inflight))
            if len(in_flight) == 12:
                eng.scheduler.request_drain()

        got = eng.submit(prompt, params, listener=listen).result(timeout=300)
    assert got == want
    assert in_flight[4:12] == [1] * 8  # overlapped: the next pass was queued before each token was read
    assert in_flight[12] == 0 and in_flight[14:22] == [1] * 8


def test_a_failed_preparation_turns_the_overlap_off_with_a_warning(model: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """A pipeline that cannot prepare its kernels (say, one does not compile) leaves the engine
    serial, says so once, and the request gets the serial tokens."""
    import engine.decode_pipeline as dp

    def broken(*args: object) -> None:
        raise RuntimeError("no kernel")

    prompt, params = list(range(300, 330)), SamplingParams(max_tokens=12, ignore_eos=True)
    with _engine(model, False) as eng:
        want = list(eng.generate(prompt, params))
    monkeypatch.setattr(dp.DecodePipeline, "_warm", broken)
    with caplog.at_level("WARNING", logger="freetoken.engine"), _engine(model, True) as eng:
        got = list(eng.generate(prompt, params))
        assert _staged(eng) == 0 and eng.scheduler.pipeline is not None and eng.scheduler.pipeline.width == 0
    assert got == want
    assert sum("overlapped decode turned off" in r.getMessage() for r in caplog.records) == 1


def test_off_unless_asked(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Experimental since the twelfth GPU session: no pipeline by default; `--overlap-decode` (CLI)
    or the option turns it on, `--no-overlap-decode` leaves it off."""
    import argparse

    from freetoken_agent.argtypes import add_engine_arguments, engine_options

    monkeypatch.delenv("FREETOKEN_OVERLAP_DECODE", raising=False)
    assert EngineOptions().overlap_decode is False
    with Engine(model, EngineOptions(**OPTS)) as eng:  # type: ignore[arg-type]
        assert eng.scheduler.pipeline is None
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert engine_options(parser.parse_args([])).overlap_decode is False
    assert engine_options(parser.parse_args(["--overlap-decode"])).overlap_decode is True
    assert engine_options(parser.parse_args(["--no-overlap-decode"])).overlap_decode is False
    monkeypatch.setenv("FREETOKEN_OVERLAP_DECODE", "1")  # an explicit flag beats the environment
    assert engine_options(parser.parse_args(["--no-overlap-decode"])).overlap_decode is False
    assert engine_options(parser.parse_args([])).overlap_decode is True


def test_the_first_pass_is_settled_per_top_k(model: Path) -> None:
    """torch picks its top-k kernels by k, so a request with another k gets a settled first pass
    again (a kernel first launched behind a pass in flight could load its module there)."""
    prompt = list(range(300, 330))
    with _engine(model, True) as eng:
        for k in (20, 50, 20):
            list(eng.generate(prompt, SamplingParams(max_tokens=8, temperature=1.0, top_k=k, seed=3, ignore_eos=True)))
        pipeline = eng.scheduler.pipeline
        assert pipeline is not None and _staged(eng) > 0
        assert sorted(kinds for stage, _, kinds in pipeline._settled if stage == "start") == [
            ((False, 20, False),), ((False, 50, False),)]
