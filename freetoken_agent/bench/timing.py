"""Wall-clock timing for the CPU benches.

Contract: `timed(fn, seconds)` calls `fn` once to warm up, then repeatedly until at least
`seconds` have passed and at least 5 calls were made, and returns the seconds per call.
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
