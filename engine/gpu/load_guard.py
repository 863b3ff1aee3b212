"""Let the device finish its queued work before Triton loads a kernel module.

Contract: `install()` (idempotent; a no-op without Triton or without its load hook, Triton < 3.5)
adds `settle_before_load` to Triton's `kernel_load_start_hook` chain, so every later first launch of
a compiled Triton kernel in this process first waits for the current CUDA device, unless the
current stream is capturing a graph or CUDA is not initialised. `loads_seen()` counts the loads the
hook has seen (for tests and probes).

Why: loading a module waits for the device (the driver serialises it with the work in flight),
while work in flight may itself be waiting for a host thread that needs the driver: a decode pass
whose MoE layer waits for the host-issued expert copies (engine/gpu/device_step.py) and the copier
thread whose `cudaMemcpyAsync` then waits behind the load. The twelfth GPU session caught that
deadlock in the act: the overlapped decode's staging kernel, launched while the previous pass was in
flight, met a new specialisation and blocked in Triton's `load_binary` for good (stack in
docs/history/data/h200-2026-12-01-session12/results.md). Waiting first is always safe here: nothing the
device waits for needs this thread (the CPU branch and the copier are native threads, and every
staged input is written before its launch). A load happens once per kernel specialisation, so the
steady state never pays for the wait.
"""

from __future__ import annotations

from typing import Any

import torch

_installed = False
_loads = 0


def settle_before_load(*_: Any, **__: Any) -> None:
    """Triton's load-start hook: wait for the device unless a graph is being captured."""
    global _loads
    _loads += 1
    if torch.cuda.is_available() and torch.cuda.is_initialized() and not torch.cuda.is_current_stream_capturing():
        torch.cuda.synchronize()


def install() -> bool:
    """Adds the hook once; False where this Triton has no load hook (then nothing guards loads)."""
    global _installed
    if _installed:
        return True
    try:
        from triton import knobs
    except ImportError:
        return False
    chain = getattr(knobs.runtime, "kernel_load_start_hook", None)
    if chain is None or not hasattr(chain, "add"):
        return False
    chain.add(settle_before_load)
    _installed = True
    return True


def loads_seen() -> int:
    return _loads
