"""engine/watchdog.py: a step that runs past the threshold is logged with the engine thread's
stack and shown by `Engine.stalled_step_s` (and `/health`); a step that ends in time is not."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from engine.engine import Engine
from engine.errors import ConfigError
from engine.options import EngineOptions
from engine.sampling import SamplingParams
from engine.watchdog import StepWatch


def _slow_step_for_the_watch(seconds: float) -> None:
    time.sleep(seconds)


def test_a_stalled_step_is_logged_with_where_it_stands(caplog: pytest.LogCaptureFixture) -> None:
    watch = StepWatch(0.2)
    watch.start()
    try:
        with caplog.at_level(logging.WARNING, logger="freetoken.engine"):
            watch.begin()
            watch.end()  # a quick step: nothing
            time.sleep(0.5)
            assert not caplog.records and not watch.stalled() and watch.running_for() == 0.0

            def step() -> None:
                watch.begin()
                _slow_step_for_the_watch(1.0)
                watch.end()

            t = threading.Thread(target=step)
            t.start()
            time.sleep(0.7)
            assert watch.stalled() and watch.running_for() > 0.5
            t.join()
        messages = [r.getMessage() for r in caplog.records]
        assert len(messages) == 2, messages  # once while it runs, once when it ends
        assert "still running" in messages[0] and "_slow_step_for_the_watch" in messages[0]
        assert "ended after" in messages[1]
        assert not watch.stalled()
    finally:
        watch.stop()


def test_the_threshold_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FREETOKEN_STEP_WATCH_S", "0")
    assert not StepWatch(EngineOptions.resolve().step_watch_s).enabled
    monkeypatch.setenv("FREETOKEN_STEP_WATCH_S", "soon")
    with pytest.raises(ConfigError, match="FREETOKEN_STEP_WATCH_S"):
        EngineOptions.resolve()
    monkeypatch.delenv("FREETOKEN_STEP_WATCH_S")
    assert StepWatch(EngineOptions.resolve().step_watch_s).threshold_s == 120


def test_the_engine_reports_a_step_that_does_not_return(demo_model: Callable[[str], Path],
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    """A listener that blocks holds the engine thread inside a step (emission runs there), as a
    device wait that nothing answers would."""
    model = demo_model("qwen3_moe")
    release = threading.Event()

    def listener(token: int | None) -> None:
        if token is not None:
            release.wait(timeout=30)

    with caplog.at_level(logging.WARNING, logger="freetoken.engine"), \
            Engine(model, EngineOptions(dtype="float32", kv_tokens=512, max_running=2, prefill_chunk=64,
                                        step_watch_s=0.3)) as eng:
        assert eng.stalled_step_s() is None
        handle = eng.submit(list(range(300, 320)), SamplingParams(max_tokens=3, ignore_eos=True), listener=listener)
        deadline = time.monotonic() + 20
        while eng.stalled_step_s() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        stalled = eng.stalled_step_s()
        assert stalled is not None and stalled > 0.3
        time.sleep(1.2)  # the watch looks about four times per threshold
        release.set()
        assert len(handle.result(timeout=60)) == 3
        assert eng.stalled_step_s() is None
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "still running" in text and "listener" in text, text
