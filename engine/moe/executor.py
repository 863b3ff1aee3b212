"""Routed-expert execution from the host expert banks: the reference executor and the registry.

Contract: `TorchExpertExecutor` (engine/moe/base.py's `ExpertExecutor`) is the reference: one
gathered GEMM pair per distinct expert, weights read from the banks (moved to x's device per call
when the banks live elsewhere). Faster backends (the native CPU executor, the GPU expert cache)
implement the same interface and are chosen through `create_executor(name, banks, device,
threads)`: "torch", "native" (a `ConfigError` saying why when it cannot serve), or "auto": native
when it can serve the configuration, otherwise torch, with the reason logged once. Packed
(quantized) banks get engine/moe/packed.py's executor, with the native `moe_packed` kernel under
"native" / "auto" when it is built and the torch dequantizing one otherwise.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.errors import ConfigError
from engine.moe.base import ExpertExecutor
from engine.weights.layout import ExpertBanks, PackedExpertBanks

log = logging.getLogger("freetoken.engine")


def gated(gate: torch.Tensor, up: torch.Tensor, banks: ExpertBanks) -> torch.Tensor:
    """The experts' gated activation (engine/config.py EXPERT_ACTIVATIONS)."""
    if banks.activation == "silu":
        return F.silu(gate) * up
    gate = gate.clamp(max=banks.limit)
    up = up.clamp(min=-banks.limit, max=banks.limit)
    return (up + 1) * (gate * torch.sigmoid(gate * banks.alpha))


class TorchExpertExecutor(ExpertExecutor):
    def __init__(self, banks: ExpertBanks) -> None:
        self.banks = banks
        self.inter = banks.w2.shape[-1]

    def describe(self) -> str:
        return f"torch ({torch.get_num_threads()} threads)"

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, moe_index: int) -> torch.Tensor:
        out = torch.zeros_like(x)
        base = moe_index * self.banks.num_experts
        flat_ids = ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)
        experts, counts = torch.unique_consecutive(flat_ids[order], return_counts=True)
        token_of = order // ids.shape[1]
        flat_w = weights.reshape(-1)[order]
        start = 0
        for expert, count in zip(experts.tolist(), counts.tolist(), strict=True):
            rows = token_of[start:start + count]
            w13 = self.banks.w13[base + expert].to(x.device, non_blocking=True)
            w2 = self.banks.w2[base + expert].to(x.device, non_blocking=True)
            b13, b2 = self.banks.b13, self.banks.b2
            gu = F.linear(x[rows], w13, None if b13 is None else b13[base + expert].to(x.device))
            gate, up = gu.chunk(2, dim=-1)
            y = F.linear(gated(gate, up, self.banks), w2, None if b2 is None else b2[base + expert].to(x.device))
            y = y * flat_w[start:start + count, None]
            out.index_add_(0, rows, y.to(out.dtype))
            start += count
        return out


def _native(banks: ExpertBanks, device: torch.device, threads: int) -> ExpertExecutor:
    from engine.moe.native import NativeExpertExecutor, native_unsupported

    why = native_unsupported(banks, device)
    if why is not None:
        raise ConfigError(f"the native expert executor cannot be used: {why}")
    return NativeExpertExecutor(banks, threads)


def _auto(banks: ExpertBanks, device: torch.device, threads: int) -> ExpertExecutor:
    from engine.moe.native import native_unsupported

    why = native_unsupported(banks, device)
    if why is None:
        return _native(banks, device, threads)
    log.info("expert executor: torch (native not used: %s)", why)
    return TorchExpertExecutor(banks)


_EXECUTORS: dict[str, Callable[[ExpertBanks, torch.device, int], ExpertExecutor]] = {
    "auto": _auto,
    "native": _native,
    "torch": lambda banks, device, threads: TorchExpertExecutor(banks),
}
EXECUTORS = tuple(_EXECUTORS)


def _packed(name: str, banks: PackedExpertBanks, threads: int) -> ExpertExecutor:
    from engine.moe.packed import PackedExpertExecutor, native_moe_packed

    kernel = native_moe_packed() if name != "torch" else None
    if kernel is None and name == "native":
        raise ConfigError("the native expert executor cannot be used: native.packed (moe_packed) is not built")
    if kernel is None and name == "auto":
        log.info("expert executor: packed torch (the native moe_packed kernel is not built)")
    if kernel is not None and threads > 0:  # the pool the packed kernel runs on: --cpu-threads, as the float one
        from engine.moe.native import load_native

        ft = load_native()
        if ft.num_threads() != threads:
            ft.set_num_threads(threads)
    return PackedExpertExecutor(banks, kernel, "native" if kernel is not None else "torch")


def create_executor(name: str, banks: ExpertBanks, device: torch.device | str = "cpu", threads: int = 0) -> ExpertExecutor:
    try:
        factory = _EXECUTORS[name]
    except KeyError:
        raise ConfigError(f"unknown expert executor {name!r} (known: {', '.join(_EXECUTORS)})") from None
    if isinstance(banks, PackedExpertBanks):
        return _packed(name, banks, threads)
    return factory(banks, torch.device(device), threads)
