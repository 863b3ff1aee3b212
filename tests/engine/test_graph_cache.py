"""engine/graphs.py's GraphCache: eager on a key's first call, captured on its second, replayed
after; a capture that fails (here: a host read inside the captured function) is logged once and
that key runs eagerly from then on, with correct results. Off CUDA (enabled=False) always eager.
No garbage collection runs inside a capture (a finalizer that synchronises the device would lose
it)."""

from __future__ import annotations

import gc
import logging
from typing import ClassVar

import pytest
import torch

from engine.graphs import GraphCache


def test_disabled_cache_always_runs_eagerly() -> None:
    cache = GraphCache("test", enabled=False)
    calls = []
    for _ in range(3):
        cache.run("k", lambda: calls.append(1))
    assert calls == [1, 1, 1] and cache.captured == 0


def test_a_failure_report_names_the_project_frame_that_raised() -> None:
    """_where: the innermost frame under engine/ (the operation that broke a capture), not torch's."""
    from engine.errors import ConfigError
    from engine.graphs import _where
    from engine.options import EngineOptions

    with pytest.raises(ConfigError) as info:
        EngineOptions.resolve({}, {"FREETOKEN_OVERLAP_DECODE": "perhaps"})
    where = _where(info.value)
    assert where.startswith("options.py:") and "in parse_env: raise ConfigError" in where, where


@pytest.mark.gpu
def test_capture_replay_and_logged_eager_fallback(caplog: pytest.LogCaptureFixture) -> None:
    cache = GraphCache("test graphs")
    x = torch.zeros(4, device="cuda")
    out = torch.zeros(4, device="cuda")
    calls = {"good": 0, "bad": 0}

    def good() -> None:
        calls["good"] += 1
        out.copy_(x * 2 + 1)

    def bad() -> None:  # reads the device from the host: cannot be captured
        calls["bad"] += 1
        out.copy_(x + float(x.sum().item()))

    for step in range(4):
        x.fill_(step)
        cache.run("good", good)
        torch.cuda.synchronize()
        assert torch.equal(out, torch.full((4,), 2.0 * step + 1, device="cuda"))
    assert calls["good"] == 2 and cache.captured == 1  # eager once, captured once, replayed twice
    with caplog.at_level(logging.WARNING, logger="freetoken.engine"):
        for step in range(4):
            x.fill_(step)
            cache.run("bad", bad)
            torch.cuda.synchronize()
            assert torch.equal(out, torch.full((4,), step + 4.0 * step, device="cuda"))
    assert cache.captured == 1 and calls["bad"] == 5  # the failed capture attempt, then eager each call
    assert sum("CUDA graph capture failed" in r.getMessage() for r in caplog.records) == 1


class _SyncingCycle:
    """Garbage only the cyclic collector frees, whose finalizer synchronises the device (as the
    unregistration of page-locked banks in engine/gpu/setup.py does)."""

    during_capture: ClassVar[list[bool]] = []

    def __init__(self) -> None:
        self.me = self

    def __del__(self) -> None:
        _SyncingCycle.during_capture.append(torch.cuda.is_current_stream_capturing())
        torch.cuda.synchronize()


@pytest.mark.gpu
def test_no_garbage_collection_inside_a_capture() -> None:
    cache = GraphCache("test graphs")
    x = torch.zeros(4, device="cuda")

    def fn() -> None:
        for _ in range(500):
            _SyncingCycle()
        x.add_(1)

    thresholds = gc.get_threshold()
    gc.set_threshold(10)  # a collection every few allocations
    try:
        cache.run("k", fn)  # eager
        cache.run("k", fn)  # captured, replayed
    finally:
        gc.set_threshold(*thresholds)
    gc.collect()
    torch.cuda.synchronize()
    assert cache.captured == 1
    assert _SyncingCycle.during_capture and not any(_SyncingCycle.during_capture)
    assert torch.equal(x, torch.full((4,), 2.0, device="cuda"))


@pytest.mark.gpu
def test_clear_then_capture_again(caplog: pytest.LogCaptureFixture) -> None:
    """After clear() (the decode pass does it when its rotary tables grow) the key is captured
    again: PyTorch's allocator refuses a capture into a pool whose graphs were all destroyed while
    its blocks are still cached, so the cache must not reuse that pool. A key that failed before
    clear() is tried again after it."""
    cache = GraphCache("test graphs")
    x = torch.zeros(4, device="cuda")
    out = torch.zeros(4, device="cuda")
    host_read = {"on": True}

    def fn() -> None:  # temporaries allocated inside the capture: the pool keeps blocks
        y = x * 2 + 1
        if host_read["on"]:
            y = y + float(x.sum().item()) * 0  # a host read: this capture fails
        out.copy_(torch.relu(y) + 0)

    with caplog.at_level(logging.WARNING, logger="freetoken.engine"):
        for round_ in range(3):
            host_read["on"] = round_ == 0
            cache.clear()
            for step in range(3):
                x.fill_(step + round_)
                cache.run("k", fn)
                torch.cuda.synchronize()
                assert torch.equal(out, torch.full((4,), 2.0 * (step + round_) + 1, device="cuda"))
            assert cache.captured == (0 if round_ == 0 else 1), round_
    failed = [r.getMessage() for r in caplog.records if "CUDA graph capture failed" in r.getMessage()]
    assert len(failed) == 1, failed  # round 0's host read only
