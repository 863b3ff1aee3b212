"""`GET /v1/memory` and `POST /v1/memory`: read and change the GPU budget split at runtime (DESIGN.md).

Contract: GET returns `{"object": "memory", "device", "gpu_memory": {cap_bytes, peak_allocated_bytes,
budget: {dense, kv, states, workspace, experts}, expert_cache} | null, "device_free_bytes",
"device_total_bytes"}` (the last two on CUDA). POST takes `{"gpu_memory": SIZE}` (bytes, or a string
such as "20GiB", or "auto": what the device has free plus what the engine holds, less the margin
`serve` uses) and rebuilds the expert cache under that cap at the engine's next safe point (between
two steps; running requests go on), answering as GET does. The KV pages, state slots and workspace
keep their sizes: the expert slots take the difference. Errors in the caller's protocol shape: 400
for a body that is not a size, for a cap too small for the fixed parts, for an engine without an
expert cache (a CPU engine, or `--gpu-memory off`); nothing changes then. Authentication is the
app's, as for every /v1 route.
"""

from __future__ import annotations

import argparse
from typing import Any

from fastapi import APIRouter, Request

from adapters.common import ApiError
from adapters.state import AppState
from engine.errors import ConfigError

router = APIRouter()


def _state(request: Request) -> AppState:
    return request.app.state.ft  # type: ignore[no-any-return]


# Plain `def` handlers run in the threadpool: a resize waits for the current engine step to end.
@router.get("/v1/memory")
def get_memory(request: Request) -> dict[str, Any]:
    return {"object": "memory", **_state(request).service.engine.memory_report()}


@router.post("/v1/memory")
def set_memory(request: Request, body: dict[str, Any]) -> dict[str, Any]:
    from freetoken_agent.argtypes import gpu_memory_size

    engine = _state(request).service.engine
    value = body.get("gpu_memory")
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ApiError(400, "gpu_memory: expected a size in bytes or a string such as \"20GiB\" or \"auto\"",
                       param="gpu_memory")
    try:
        total = gpu_memory_size(str(value))
    except argparse.ArgumentTypeError as e:
        raise ApiError(400, f"gpu_memory: {e}", param="gpu_memory") from None
    if total is None:
        from engine.gpu.budget import auto_gpu_memory

        total = auto_gpu_memory(engine.opts.device)
    if total <= 0:
        raise ApiError(400, "gpu_memory: must be positive (an engine keeps its expert cache; restart with "
                            "--gpu-memory off to run without one)", param="gpu_memory")
    try:
        report = engine.set_gpu_memory(total)
    except ConfigError as e:
        raise ApiError(400, str(e), param="gpu_memory") from None
    return {"object": "memory", **report}
