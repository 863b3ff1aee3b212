"""Elastic GPU memory (DESIGN.md "Memory manager", the paper's section 3.3): the GPU expert cache
rebuilt under a new `--gpu-memory` cap at a scheduler safe point, without restarting the engine or
reloading the host expert banks. The banks stay the authority: the cache's size changes speed only,
never a result.

Contract: `rebuild_expert_cache(decoder, opts, dtype, total) -> GpuBudget` splits `total` as at
start (dense weights, KV pages, state slots and the workspace keep their sizes: their pools are not
resized, so only the expert slots absorb the change). A cap that cannot hold those parts plus one
expert slot raises `ConfigError` and changes nothing. Otherwise the decoder's `CachedExpertExecutor`
is replaced by one with the new slot count, the same CPU executor, fetch ratio and options: its
cache starts empty, its CUDA graphs are captured anew as decoding goes on (the decoder drops its
captured passes on the swap), and the old slot pool is freed before the new one is allocated (a
shrink is usually asked for because another program needs the memory). If the new pool cannot be
allocated, the old size is restored and `ConfigError` says so. The caller holds the engine between
steps: nothing queued or running on the device.
`follow_target(budget, expert_bytes, experts, free, reserved, total)` is where an engine that follows
the device's free memory (`opts.follow_free_memory`, the CLI's `--gpu-memory auto`) moves its cap:
what `auto_gpu_memory` would give now (free plus what this process holds, less the margin), within
one expert slot and every expert, or None when that is less than `MIN_CHANGE` (or an eighth of all
experts' bytes, for a model whose experts are smaller) away from the cap in force (each rebuild
empties the cache: small swings are not worth one). `release_device_memory()` collects what
nothing references any more and hands torch's cached blocks back to the device.
"""

from __future__ import annotations

import gc
import logging
from typing import Any

import torch

from engine.errors import ConfigError
from engine.gpu.budget import GpuBudget, auto_cap, dense_bytes, split_gpu_memory
from engine.gpu.executor import CachedExpertExecutor, create_cached_executor
from engine.model.decoder import Decoder
from engine.options import EngineOptions
from engine.weights.layout import ExpertBanks

log = logging.getLogger("freetoken.engine")

MIN_CHANGE = 2**30  # bytes: a smaller move of the free memory leaves the cache as it is


def follow_target(budget: GpuBudget, expert_bytes: int, experts: int, free: int, reserved: int,
                  total: int) -> int | None:
    fixed = budget.total - budget.experts
    lowest, highest = fixed + expert_bytes, fixed + experts * expert_bytes
    target = min(max(auto_cap(free, reserved, total), lowest), highest)
    if abs(target - min(budget.total, highest)) < min(MIN_CHANGE, experts * expert_bytes // 8):
        return None
    return target


def rebuild_expert_cache(decoder: Decoder, opts: EngineOptions, dtype: torch.dtype, total: int) -> GpuBudget:
    old = decoder.executor
    if not isinstance(old, CachedExpertExecutor):
        raise ConfigError("this engine has no GPU expert cache to resize (start it with --gpu-memory on CUDA)")
    banks = decoder.weights.experts
    device = old.table.device
    budget = split_gpu_memory(total, decoder.cfg, opts, dtype, dense_bytes(decoder.weights, device),
                              banks.expert_bytes)
    old_bytes = old.slots.slots * banks.expert_bytes
    keep = {"cpu_executor": old.cpu_executor, "ratio": old.ratio, "threads": opts.native_pool_threads, "graphs": old.graphs,
            "plan": old.plan,
            # what was asked, not what ran: a pool that held every expert had no split to keep
            "adapt": old.adapt_request, "split": old.split_request}
    _release(decoder, old)
    del old
    try:
        new = _build(banks, budget.experts, device, keep)
    except torch.OutOfMemoryError as e:
        release_device_memory()
        decoder.executor = _build(banks, old_bytes, device, keep)
        raise ConfigError(f"--gpu-memory {total / 2**30:.2f} GiB: the {budget.experts / 2**30:.2f} GiB of expert "
                          f"slots could not be allocated on {device} ({e}); the previous "
                          f"{old_bytes / 2**30:.2f} GiB were restored") from None
    decoder.executor = new
    log.info("expert cache rebuilt: %s (%d slots)", budget.describe(), new.slots.slots)
    return budget


def _build(banks: ExpertBanks, budget_bytes: int, device: torch.device, keep: dict[str, Any]) -> CachedExpertExecutor:
    return create_cached_executor(banks, budget_bytes, device, keep["ratio"], cpu_executor=keep["cpu_executor"],
                                  threads=keep["threads"], graphs=keep["graphs"], plan=keep["plan"],
                                  adapt=keep["adapt"], split=keep["split"])


def _release(decoder: Decoder, old: CachedExpertExecutor) -> None:
    """Drops every reference the engine holds to `old` (the decoder's, its captured passes') and
    returns its device memory to the device, not only to torch's allocator cache."""
    if old.table.device.type == "cuda":
        torch.cuda.synchronize(old.table.device)
    decoder.executor = old.cpu_executor  # clears the captured passes that reference the old pool
    old.close()
    release_device_memory()


def release_device_memory() -> None:
    gc.collect()  # the old steps' host tasks unregister from the poller as they are collected
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
