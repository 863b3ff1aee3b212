"""Late work: the one-time costs (Triton compiles, CUDA graph captures) paid while serving.

Contract: the warm-up (engine/warmup.py) is meant to leave nothing to compile or capture, so a
request's time to first token is its own work. `watch(report)` makes every later Triton JIT compile
and every CUDA graph capture (engine/graphs.py calls `note`) call `report(kind, name, seconds)`
(kind "compile" or "capture"; a compile's name is `compiled_name`: module, kernel and the
specialisation that made it new) and count into `totals()`; `unwatch()` stops it. Without a watcher
`note` does nothing. Triton's JIT hooks are set only while watching and only where the installed
Triton has them (`triton.knobs.runtime`); `watch` returns whether compiles are seen.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

Report = Callable[[str, str, float], None]

_lock = threading.Lock()
_report: Report | None = None
_counts: dict[str, list[float]] = {}  # kind -> [count, seconds]
_started: dict[int, float] = {}  # thread id -> when its compile began


def note(kind: str, name: str, seconds: float) -> None:
    """One compile or capture of `name` that took `seconds` (ignored unless watching)."""
    report = _report
    if report is None:
        return
    with _lock:
        c = _counts.setdefault(kind, [0.0, 0.0])
        c[0] += 1
        c[1] += seconds
    report(kind, name, seconds)


def totals() -> dict[str, tuple[int, float]]:
    """kind -> (how many, seconds) since `watch`."""
    with _lock:
        return {k: (int(c[0]), c[1]) for k, c in _counts.items()}


def _runtime_knobs() -> Any | None:
    try:
        import triton
    except ImportError:
        return None
    return getattr(getattr(triton, "knobs", None), "runtime", None)


def _before(**_: Any) -> bool:
    _started[threading.get_ident()] = time.monotonic()
    return False  # go on compiling


def compiled_name(fn: Any, repr: str = "") -> str:
    """A compile's name for the report: the kernel's module and name (three modules have a
    `_gate_up_kernel`), then its arguments' specialisation from Triton's `repr` (the constexpr values
    and which integers are 1 or multiples of 16: what made this a new variant), at most 300 characters."""
    name = str(getattr(fn, "name", fn))
    module = getattr(fn, "module", None)
    full = f"{module}.{name}" if isinstance(module, str) and module else name
    args = repr[repr.find("]("):] if "](" in repr else ""
    return (full + (" " + args[1:] if args else ""))[:300]


def _after(*, fn: Any, repr: str = "", **_: Any) -> None:
    began = _started.pop(threading.get_ident(), None)
    note("compile", compiled_name(fn, repr), 0.0 if began is None else time.monotonic() - began)


def watch(report: Report) -> bool:
    global _report
    with _lock:
        _counts.clear()
    _report = report
    knobs = _runtime_knobs()
    if knobs is None or not hasattr(knobs, "jit_post_compile_hook"):
        return False
    knobs.jit_cache_hook = _before
    knobs.jit_post_compile_hook = _after
    return True


def unwatch() -> None:
    global _report
    _report = None
    knobs = _runtime_knobs()
    if knobs is not None and getattr(knobs, "jit_post_compile_hook", None) is _after:
        knobs.jit_cache_hook = None
        knobs.jit_post_compile_hook = None
