"""Queue a native host task on a CUDA stream: `launch_host_task(task, stream)` calls the driver's
`cuLaunchHostFunc`, so the CPU branch of a MoE layer runs when the stream reaches it, in order with
the copies around it, and is recorded as a host node when the stream is being captured into a CUDA
graph. The task (native.ftnative.HostTask) runs on the driver's callback thread without the GIL;
it must outlive every launch and graph that uses it (callers keep it referenced).
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch


@functools.cache
def _driver() -> Any:
    lib = ctypes.CDLL("libcuda.so.1")
    fn = lib.cuLaunchHostFunc
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


def launch_host_task(task: Any, stream: torch.cuda.Stream | None = None) -> None:
    stream = stream or torch.cuda.current_stream()
    err = _driver()(ctypes.c_void_p(stream.cuda_stream), ctypes.c_void_p(task.function_address),
                    ctypes.c_void_p(task.address))
    if err != 0:
        raise RuntimeError(f"cuLaunchHostFunc failed with CUDA driver error {err}")
