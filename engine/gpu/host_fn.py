"""Hand the CPU branch of a MoE layer to the host from a CUDA stream: the doorbell (it can be
captured into a CUDA graph; engine/gpu/device_step.py uses it).

`ring(stream, words)` writes words[0] = 1 with a stream memory operation (`cuStreamWriteValue32`),
the native poller thread (native/src/poller.h) sees it, runs the task and sets words[1] = 1;
`wait_done(stream, words)` makes the stream wait for words[1] == 1 (`cuStreamWaitValue32`) and
writes it back to 0. No driver thread is involved. (A `cuLaunchHostFunc` host node, which blocks
its stream while the task runs on the driver's callback thread, was ~230 us per layer slower on
the H200 and is gone: docs/gpu-tier.md.) `device_address` gives the device's address of
page-locked memory; `current_context` the CUDA context the poller's copier makes current.

The task (native.ftnative.HostTask) runs without the GIL; it and the page-locked `words` must
outlive every launch and graph that uses them (callers keep them referenced).
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

_WAIT_EQ = 0x1  # CU_STREAM_WAIT_VALUE_EQ


@functools.cache
def _lib() -> Any:
    return ctypes.CDLL("libcuda.so.1")


def _fn(*names: str, argtypes: list[Any]) -> Any:
    lib = _lib()
    for name in names:
        fn = getattr(lib, name, None)
        if fn is not None:
            fn.argtypes = argtypes
            fn.restype = ctypes.c_int
            return fn
    raise RuntimeError(f"the CUDA driver has none of {', '.join(names)}")


@functools.cache
def _write_value() -> Any:
    return _fn("cuStreamWriteValue32_v2", "cuStreamWriteValue32",
               argtypes=[ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint])


@functools.cache
def _wait_value() -> Any:
    return _fn("cuStreamWaitValue32_v2", "cuStreamWaitValue32",
               argtypes=[ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint])


@functools.cache
def _host_device_pointer() -> Any:
    return _fn("cuMemHostGetDevicePointer_v2", "cuMemHostGetDevicePointer",
               argtypes=[ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint])


@functools.cache
def _current_context() -> Any:
    return _fn("cuCtxGetCurrent", argtypes=[ctypes.POINTER(ctypes.c_void_p)])


def current_context() -> int:
    """This thread's CUDA context (torch's primary context once CUDA is initialised): the native
    poller makes it current before it issues copies."""
    torch.cuda.init()
    out = ctypes.c_void_p()
    _check(_current_context()(ctypes.byref(out)), "cuCtxGetCurrent")
    if not out.value:
        raise RuntimeError("no current CUDA context")
    return out.value


def _check(err: int, what: str) -> None:
    if err != 0:
        raise RuntimeError(f"{what} failed with CUDA driver error {err}")


def _stream(stream: torch.cuda.Stream | None) -> ctypes.c_void_p:
    return ctypes.c_void_p((stream or torch.cuda.current_stream()).cuda_stream)


def device_address(words: torch.Tensor) -> int:
    """The device's address of page-locked host memory (the same number under unified addressing)."""
    out = ctypes.c_uint64()
    _check(_host_device_pointer()(ctypes.byref(out), ctypes.c_void_p(words.data_ptr()), 0),
           "cuMemHostGetDevicePointer")
    return out.value


def ring(stream: torch.cuda.Stream, request_address: int) -> None:
    _check(_write_value()(_stream(stream), request_address, 1, 0), "cuStreamWriteValue32")


def clear(stream: torch.cuda.Stream, address: int) -> None:
    _check(_write_value()(_stream(stream), address, 0, 0), "cuStreamWriteValue32")


def wait_done(stream: torch.cuda.Stream, done_address: int) -> None:
    _check(_wait_value()(_stream(stream), done_address, 1, _WAIT_EQ), "cuStreamWaitValue32")
    clear(stream, done_address)
