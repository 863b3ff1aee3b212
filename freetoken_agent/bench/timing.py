"""Wall-clock timing for the CPU benches.

Contract: `timed(fn, seconds)` calls `fn` once to warm up, then repeatedly until at least
`seconds` have passed and at least 5 calls were made, and returns the seconds per call.
`best_of(cases, rounds, seconds)` times every named case once per round, interleaved (so a noisy
stretch of a shared machine hits all of them), and returns each case's best seconds per call.
"""

from __future__ import annotations

import time
from collections.abc import Callable


def timed(fn: Callable[[], None], seconds: float) -> float:
    """Seconds per call, over at least `seconds` and 5 calls."""
    fn()
    n, t0 = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        dt = time.perf_counter() - t0
        if n >= 5 and dt >= seconds:
            return dt / n


def best_of(cases: dict[str, Callable[[], None]], rounds: int, seconds: float) -> dict[str, float]:
    """Each case's best seconds per call over `rounds` interleaved rounds of `timed`."""
    best = dict.fromkeys(cases, float("inf"))
    for _ in range(rounds):
        for name, fn in cases.items():
            best[name] = min(best[name], timed(fn, seconds))
    return best
