"""A watch on the engine thread's steps: a step that runs past a threshold is reported, with where
the engine thread stands.

Contract: `StepWatch(threshold_s)`; the stepping thread calls `begin()` and `end()` around each step
(two attribute writes: nothing on the per-token path waits or locks). A daemon thread, started by
`start()` and stopped by `stop()`, looks about four times per threshold (at most once a second); the
first time the running step has passed `threshold_s` it logs a warning with that thread's Python
stack, and when the step ends, how long it took. `running_for()` is the running step's age in
seconds (0 between steps); `stalled()` says whether it is past the threshold. `threshold_s <= 0`
turns the watch off (the engine's `opts.step_watch_s`, default 120).

Why: a step that never returns (a device wait nothing answers, a kernel load that waits for the
device: the twelfth GPU session's hang, engine/gpu/load_guard.py) otherwise freezes the server
without a word; the stack says where, and `/health` reports the stall. A long prefill on a slow
machine or a first run's kernel compiles can pass the threshold legitimately: the message says the
step is still running, not that it failed.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback

log = logging.getLogger("freetoken.engine")


class StepWatch:
    def __init__(self, threshold_s: float) -> None:
        self.threshold_s = threshold_s
        self._started: float | None = None  # monotonic start of the running step
        self._thread_id: int | None = None
        self._reported: float | None = None  # the start of the step last reported as stalled
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None

    @property
    def enabled(self) -> bool:
        return self.threshold_s > 0

    # ------------------------------------------------------------------ the stepping thread
    def begin(self) -> None:
        self._thread_id = threading.get_ident()
        self._started = time.monotonic()

    def end(self) -> None:
        started, self._started = self._started, None
        if started is not None and self._reported == started:
            log.warning("the engine step reported as stalled ended after %.1f s", time.monotonic() - started)

    # ------------------------------------------------------------------ any thread
    def running_for(self) -> float:
        started = self._started
        return 0.0 if started is None else time.monotonic() - started

    def stalled(self) -> bool:
        return self.enabled and self.running_for() > self.threshold_s

    def start(self) -> None:
        if self.enabled and self._watcher is None:
            self._watcher = threading.Thread(target=self._watch, name="freetoken-step-watch", daemon=True)
            self._watcher.start()

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        period = min(1.0, self.threshold_s / 4)
        while not self._stop.wait(period):
            started = self._started
            if started is None or started == self._reported or time.monotonic() - started <= self.threshold_s:
                continue
            self._reported = started
            frame = sys._current_frames().get(self._thread_id or -1)
            where = "".join(traceback.format_stack(frame)) if frame is not None else "(thread gone)\n"
            log.warning("an engine step has run for %.0f s (threshold %.0f s: FREETOKEN_STEP_WATCH_S) and "
                        "is still running; the engine thread stands at:\n%s", time.monotonic() - started,
                        self.threshold_s, where.rstrip())
