"""`GET /v1/memory` and `POST /v1/memory`: read and change the GPU budget split at runtime (DESIGN.md).

Contract: GET returns `{"object": "memory", "device", "gpu_memory": {cap_bytes, peak_allocated_bytes,
budget: {dense, kv, states, workspace, experts}, expert_cache} | null, "pools": {kv_tokens,
checkpoint_slots, host_checkpoint_slots}, "device_free_bytes", "device_total_bytes"}` (the last two
on CUDA). POST takes any of:
- `"gpu_memory"`: bytes, a string such as "20GiB", or "auto" (what the device has free plus what the
  engine holds, less the margin `serve` uses): the expert cache is rebuilt under that cap at the
  engine's next safe point (between two steps; running requests go on);
- `"kv_tokens"`, `"checkpoint_slots"`, `"host_checkpoint_slots"`: the KV pool and the recurrent-state
  checkpoint slots resized, only while no request is queued or running (every cached prefix and
  checkpoint is dropped); the expert slots take the difference under the same cap;
pools first, then the cap; it answers as GET does. Errors in the caller's protocol shape, nothing
changed: 400 for a value that is not a size or a count, a KV pool smaller than the context window
the server advertises (`/v1/models`: a smaller pool would fail every long request), a cap too small
for the fixed parts, a cap on an engine without an expert cache (a CPU engine, or `--gpu-memory
off`); 409 for pools while requests run. Authentication is the app's: with `--admin-key`, POST
needs that key (adapters/guard.py), GET the API key as every /v1 route.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from fastapi import APIRouter, Request

from adapters.common import ApiError
from adapters.state import AppState, read_json
from engine.errors import ConfigError, EngineError

router = APIRouter()
POOLS = {"kv_tokens": 1, "checkpoint_slots": 0, "host_checkpoint_slots": 0}  # field -> smallest value


def _state(request: Request) -> AppState:
    return request.app.state.ft  # type: ignore[no-any-return]


# Plain `def` handlers run in the threadpool: a resize waits for the current engine step to end.
@router.get("/v1/memory")
def get_memory(request: Request) -> dict[str, Any]:
    return {"object": "memory", **_state(request).service.engine.memory_report()}


@router.post("/v1/memory")
async def set_memory(request: Request) -> dict[str, Any]:
    body = await read_json(request)
    return await asyncio.to_thread(_set_memory, _state(request), body)


def _set_memory(state: AppState, body: dict[str, Any]) -> dict[str, Any]:
    engine = state.service.engine
    pools = {name: _count(body, name, low) for name, low in POOLS.items() if name in body}
    window = state.service.context_window
    if pools.get("kv_tokens", window) < window:
        raise ApiError(400, f"kv_tokens: {pools['kv_tokens']} is below the served context window of {window} "
                            "tokens (restart with a smaller --context-window to serve a smaller pool)",
                       param="kv_tokens")
    total = _cap(body, engine.opts.device) if "gpu_memory" in body else None
    if not pools and total is None:
        raise ApiError(400, f"nothing to change: give gpu_memory or one of {', '.join(POOLS)}")
    report: dict[str, Any] = {}
    try:
        if pools:
            report = engine.set_pools(**pools)
    except ConfigError as e:
        raise ApiError(400, str(e), param=next(iter(pools))) from None
    except EngineError as e:
        raise ApiError(409, str(e), code="engine_busy") from None
    if total is not None:
        try:
            report = engine.set_gpu_memory(total)
        except ConfigError as e:
            raise ApiError(400, str(e), param="gpu_memory") from None
    return {"object": "memory", **report}


def _count(body: dict[str, Any], name: str, low: int) -> int:
    value = body[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ApiError(400, f"{name}: expected an integer >= {low}, got {value!r}", param=name)
    return value


def _cap(body: dict[str, Any], device: str) -> int:
    from freetoken_agent.argtypes import gpu_memory_size

    value = body["gpu_memory"]
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ApiError(400, "gpu_memory: expected a size in bytes or a string such as \"20GiB\" or \"auto\"",
                       param="gpu_memory")
    try:
        total = gpu_memory_size(str(value))
    except argparse.ArgumentTypeError as e:
        raise ApiError(400, f"gpu_memory: {e}", param="gpu_memory") from None
    if total is None:
        from engine.gpu.budget import auto_gpu_memory

        total = auto_gpu_memory(device)
    if total <= 0:
        raise ApiError(400, "gpu_memory: must be positive (an engine keeps its expert cache; restart with "
                            "--gpu-memory off to run without one)", param="gpu_memory")
    return total
