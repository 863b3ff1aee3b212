"""Loader and checked Python front end of the native CPU expert executor (native/build/_ftnative*.so).

The extension takes raw addresses; every tensor is checked here first (device, dtype, shape, strides),
because a bad pointer in C++ is a crash, not an exception. Wrong inputs raise ValueError.

    import ftnative                       # with native/ on sys.path
    out = ftnative.moe_layer(x, ids, weights, w13, w2)   # ids are flat expert rows into the banks
    ex = ftnative.NativeExpertExecutor(banks)           # engine.moe.executor.ExpertExecutor interface

Environment: FREETOKEN_NATIVE_ISA=avx512bf16|avx512|avx2|scalar forces a SIMD path (import fails if
the CPU lacks it); FREETOKEN_NATIVE_THREADS=n sets the pool size (default: all CPUs of the affinity
mask). Build with `python native/build.py`.
"""

from __future__ import annotations

import atexit
import importlib.util
import sys
import sysconfig
from pathlib import Path
from typing import Any

import torch

NATIVE_DIR = Path(__file__).resolve().parent
BUILD_DIR = NATIVE_DIR / "build"
ISAS = ("avx512bf16", "avx512", "avx2", "scalar")


def _load() -> Any:
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    path = BUILD_DIR / f"_ftnative{suffix}"
    if not path.exists():
        raise ImportError(
            f"native expert executor is not built ({path} missing); build it with "
            f"`{Path(sys.executable).name} {NATIVE_DIR / 'build.py'}` (needs g++ and `pip install pybind11`)"
        )
    spec = importlib.util.spec_from_file_location("_ftnative", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
    except ValueError as exc:  # FREETOKEN_NATIVE_ISA names an unknown/unsupported ISA
        raise ImportError(f"native expert executor: {exc}") from exc
    return mod


_ext = _load()


def _init_threads() -> None:
    import os

    n = os.environ.get("FREETOKEN_NATIVE_THREADS")
    if n:
        _ext.set_num_threads(int(n))


_init_threads()
atexit.register(_ext.shutdown)


def supported_isas() -> list[str]:
    return list(_ext.supported_isas())


def get_isa() -> str:
    return _ext.get_isa()


def set_isa(name: str) -> None:
    """Force a SIMD path ('auto' = best available); ValueError if unknown or unsupported here."""
    _ext.set_isa(name)


def set_num_threads(n: int, pin: bool = True) -> None:
    """Restart the pool with n threads (0 = all allowed CPUs), optionally pinned one per CPU."""
    _ext.set_num_threads(int(n), bool(pin))


def num_threads() -> int:
    return _ext.num_threads()


def shutdown() -> None:
    _ext.shutdown()


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _check_cpu(name: str, t: Any) -> None:
    _check(isinstance(t, torch.Tensor), f"{name} must be a torch.Tensor, got {type(t).__name__}")
    _check(t.device.type == "cpu", f"{name} must be on the CPU, got {t.device}")


def moe_layer(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[t] = sum_j weights[t, j] * down(silu(gate(x[t])) * up(x[t])) with expert rows ids[t, j].

    x: [T, H] bf16 or float32, unit inner stride. ids: [T, k] int64 contiguous, flat rows of the banks.
    weights: [T, k] float32 contiguous. w13: [R, 2I, H] bf16, w2: [R, H, I] bf16, unit inner stride.
    out: optional [T, H] bf16/float32 (unit inner stride), overwritten; default a new tensor like x.
    """
    for name, t in (("x", x), ("ids", ids), ("weights", weights), ("w13", w13), ("w2", w2)):
        _check_cpu(name, t)
    _check(x.dtype in (torch.bfloat16, torch.float32), f"x must be bfloat16 or float32, got {x.dtype}")
    _check(x.dim() == 2, f"x must be [T, H], got shape {tuple(x.shape)}")
    T, H = x.shape
    _check(
        w13.dtype == torch.bfloat16 and w2.dtype == torch.bfloat16,
        f"expert weights must be bfloat16, got w13 {w13.dtype}, w2 {w2.dtype}",
    )
    _check(
        w13.dim() == 3 and w2.dim() == 3,
        f"w13 must be [R, 2I, H] and w2 [R, H, I], got {tuple(w13.shape)} and {tuple(w2.shape)}",
    )
    R, two_i, h13 = w13.shape
    _check(two_i % 2 == 0 and two_i > 0, f"w13 dim 1 must be 2*I > 0, got {two_i}")
    inter = two_i // 2
    _check(h13 == H, f"w13 hidden size {h13} != x hidden size {H}")
    _check(tuple(w2.shape) == (R, H, inter), f"w2 must be {(R, H, inter)}, got {tuple(w2.shape)}")
    _check(H > 0, "hidden size must be > 0")
    for name, w in (("w13", w13), ("w2", w2)):
        _check(w.stride(2) == 1, f"{name} rows must be contiguous (stride(2) == 1), got strides {w.stride()}")
        _check(
            w.stride(1) >= w.shape[2] and w.stride(0) >= 0,
            f"{name} has overlapping/negative strides {w.stride()}",
        )
    _check(
        x.stride(1) == 1 or H == 1, f"x rows must be contiguous (stride(1) == 1), got strides {x.stride()}"
    )
    _check(ids.dtype == torch.int64, f"ids must be int64, got {ids.dtype}")
    _check(weights.dtype == torch.float32, f"weights must be float32, got {weights.dtype}")
    _check(
        ids.dim() == 2 and ids.shape[0] == T and ids.shape[1] > 0,
        f"ids must be [T={T}, k>0], got shape {tuple(ids.shape)}",
    )
    _check(
        tuple(weights.shape) == tuple(ids.shape),
        f"weights shape {tuple(weights.shape)} != ids shape {tuple(ids.shape)}",
    )
    _check(ids.is_contiguous() and weights.is_contiguous(), "ids and weights must be contiguous")
    k = ids.shape[1]
    if T > 0:
        lo, hi = int(ids.min()), int(ids.max())
        _check(lo >= 0 and hi < R, f"expert ids must be in [0, {R}), got range [{lo}, {hi}]")
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    else:
        _check_cpu("out", out)
        _check(
            out.dtype in (torch.bfloat16, torch.float32), f"out must be bfloat16 or float32, got {out.dtype}"
        )
        _check(tuple(out.shape) == (T, H), f"out must be {(T, H)}, got {tuple(out.shape)}")
        _check(out.stride(1) == 1 or H == 1, f"out rows must be contiguous, got strides {out.stride()}")
    if T == 0:
        return out
    _ext.moe_layer(
        x.data_ptr(),
        x.dtype == torch.bfloat16,
        x.stride(0),
        out.data_ptr(),
        out.dtype == torch.bfloat16,
        out.stride(0),
        T,
        H,
        inter,
        ids.data_ptr(),
        weights.data_ptr(),
        k,
        w13.data_ptr(),
        w13.stride(0),
        w13.stride(1),
        w2.data_ptr(),
        w2.stride(0),
        w2.stride(1),
        R,
    )
    return out


def read_bytes(t: torch.Tensor) -> int:
    """Read all of t's (contiguous) storage with the pool threads; bandwidth reference for benchmarks."""
    _check_cpu("t", t)
    _check(t.is_contiguous(), "t must be contiguous")
    return _ext.read_bytes(t.data_ptr(), t.numel() * t.element_size())


class NativeExpertExecutor:
    """engine.moe.executor.ExpertExecutor on the native kernel (CPU tensors only; not yet registered)."""

    def __init__(self, banks: Any) -> None:
        self.banks = banks

    def __call__(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, moe_index: int
    ) -> torch.Tensor:
        num_experts = self.banks.num_experts
        _check(0 <= moe_index < self.banks.w13.shape[0] // num_experts, f"moe_index {moe_index} out of range")
        if ids.numel():
            lo, hi = int(ids.min()), int(ids.max())
            _check(
                lo >= 0 and hi < num_experts, f"expert ids must be in [0, {num_experts}), got [{lo}, {hi}]"
            )
        flat = ids.to(torch.int64) + moe_index * num_experts
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        out = moe_layer(
            x2,
            flat.reshape(x2.shape[0], -1).contiguous(),
            weights.to(torch.float32).reshape(x2.shape[0], -1).contiguous(),
            self.banks.w13,
            self.banks.w2,
        )
        return out.reshape(shape)
