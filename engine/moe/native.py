"""The native CPU expert executor (native/) as an engine `ExpertExecutor`; the one place the engine
loads the extension from.

Contract: `load_native()` imports `native.ftnative` once and returns it, or raises `ConfigError`
saying why (not built). `apply_native_options(native)` hands the engine's `opts.native` to the
extension when it is built: a forced ISA the CPU lacks (or any native setting without the
extension) is a `ConfigError`; with the defaults and no extension it does nothing. `native_unsupported(banks, device)` says why the native
executor cannot serve a configuration (None when it can): it reads host banks in bf16 or float32
and runs on the CPU. `NativeExpertExecutor(banks, threads)` runs every routed
expert of a layer in one native call; `threads` > 0 resizes the process-wide worker pool
(0 keeps it: one pinned worker per physical core).
"""

from __future__ import annotations

from types import ModuleType

import torch

from engine.errors import ConfigError
from engine.moe.base import ExpertExecutor
from engine.options import NativeOptions
from engine.weights.layout import ExpertBanks

FORMAT_OF_DTYPE = {torch.bfloat16: "bf16", torch.float32: "f32"}
_module: ModuleType | None = None
_error: str | None = None


def load_native() -> ModuleType:
    global _module, _error
    if _module is None and _error is None:
        try:
            from native import ftnative

            _module = ftnative
        except ImportError as exc:
            _error = str(exc)
    if _module is None:
        raise ConfigError(f"native expert executor unavailable: {_error}")
    return _module


def apply_native_options(native: NativeOptions) -> None:
    if native == NativeOptions():
        try:
            ft = load_native()
        except ConfigError:
            return  # nothing asked of an extension that is not there
    else:
        ft = load_native()
    try:
        ft.set_isa(native.native_isa or "auto")
    except ValueError as e:
        raise ConfigError(f"native_isa {native.native_isa!r} (FREETOKEN_NATIVE_ISA): {e}") from None
    ft.set_prefetch_bytes(native.native_prefetch)
    if native.native_threads and ft.num_threads() != native.native_threads:
        ft.set_num_threads(native.native_threads)


def native_unsupported(banks: ExpertBanks, device: torch.device | str) -> str | None:
    if torch.device(device).type != "cpu":
        return f"it runs experts on the CPU, but the engine computes on {device}"
    if banks.w13.dtype not in FORMAT_OF_DTYPE:
        return f"expert weights are {banks.w13.dtype}; it reads bfloat16 or float32"
    if banks.b13 is not None or banks.activation != "silu":
        return f"its kernels compute silu experts without biases; these have biases and {banks.activation}"
    try:
        load_native()
    except ConfigError as exc:
        return str(exc)
    return None


class NativeExpertExecutor(ExpertExecutor):
    def __init__(self, banks: ExpertBanks, threads: int = 0) -> None:
        ft = load_native()
        from native.formats import ExpertWeights

        if banks.w13.dtype not in FORMAT_OF_DTYPE:
            raise ConfigError(f"native expert executor reads bfloat16 or float32 weights, not {banks.w13.dtype}")
        self._ft = ft
        self.banks = banks
        self.experts = ExpertWeights(FORMAT_OF_DTYPE[banks.w13.dtype], banks.w13, banks.w2)
        if threads > 0 and ft.num_threads() != threads:
            ft.set_num_threads(threads)

    def describe(self) -> str:
        return f"native ({self._ft.get_isa()}, {self.experts.fmt}, {self._ft.num_threads()} threads)"

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, moe_index: int) -> torch.Tensor:
        # the router's outputs go through as they are (int64 ids, weights widened exactly to float32);
        # the layer's bank offset is applied in C++, so a call makes no temporary besides `out`
        w = weights if weights.dtype == torch.float32 else weights.float()
        if x.dtype in (torch.bfloat16, torch.float32):
            return self._ft.moe_layer(x, ids, w.contiguous(), self.experts, None, moe_index * self.banks.num_experts)
        return self._ft.moe_layer(x.float(), ids, w.contiguous(), self.experts, None,
                                  moe_index * self.banks.num_experts).to(x.dtype)
