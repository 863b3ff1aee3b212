"""Turn a loaded decoder into one with a GPU expert cache under a memory cap (`--gpu-memory`).

Contract: `attach_expert_cache(decoder, opts, dtype)` moves an embedding table that is not also the
LM head into page-locked host memory (`host_embedding`; the option gpu.host_embed off keeps it on the GPU),
splits `opts.gpu_memory` (engine/gpu/budget.py) over what stays on the GPU, page-locks the host
expert banks in place (cudaHostRegister: no copy, so a 60 GB bank does not need 60 GB more; packed
banks per layer tensor),
resolves the fetch ratio (opts.fetch_ratio when >= 0; else the calibration stored for this machine
in `opts.calibration_file`; else it measures B_C and B_P now, a few seconds, saves them there and
logs that it did: never a silent default), and replaces the decoder's executor with a
`CachedExpertExecutor`. Returns the budget. Raises `ConfigError` off CUDA, when the cap is too small,
or for float experts with biases or another activation than silu (bf16 gpt-oss; packed ones are held).
"""

from __future__ import annotations

import logging
import weakref
from collections import Counter
from pathlib import Path

import torch

from engine.errors import ConfigError
from engine.gpu.budget import GpuBudget, dense_bytes, split_gpu_memory
from engine.gpu.executor import create_cached_executor
from engine.model.decoder import Decoder
from engine.options import EngineOptions
from engine.weights.layout import ExpertBanks, PackedExpertBanks

log = logging.getLogger("freetoken.engine")

def pin_in_place(banks: ExpertBanks) -> bool:
    """Page-locks the banks' host memory without copying; False (and a warning) when refused.

    Each registration is undone when its tensor object is collected (after the device has finished
    with it): a freed range that stayed registered would make the allocator's next block at that
    address fail to register, or leave the GPU a stale mapping."""
    ok = True
    cudart = torch.cuda.cudart()
    tensors = ([*banks.gate_up, *banks.down, *banks.gscale] if isinstance(banks, PackedExpertBanks)
               else [banks.w13, banks.w2])
    for t, ptr, size in _distinct_ranges(tensors):
        if t.is_pinned() or size == 0:
            continue
        # mapped (2) | portable (1): the fetch kernel reads the banks through their device mapping
        if int(cudart.cudaHostRegister(ptr, size, 3)) != 0:
            ok = False
            continue
        weakref.finalize(t, _unregister, ptr)
    if not ok:
        log.warning("expert banks could not be page-locked: fetches run at pageable-copy speed")
    return ok


def _distinct_ranges(tensors: list[torch.Tensor]) -> list[tuple[torch.Tensor, int, int]]:
    """(a tensor, address, bytes) per storage: views of one buffer are registered once, as their
    whole storage (a second registration of an overlapping range fails); the registration lasts
    as long as that tensor (the banks keep every view alive)."""
    seen: dict[int, tuple[torch.Tensor, int, int]] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen.setdefault(st.data_ptr(), (t, st.data_ptr(), st.nbytes()))
    return list(seen.values())


def _unregister(ptr: int) -> None:
    try:
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:  # interpreter shutdown: the process is going away anyway
        pass


def host_embedding(decoder: Decoder) -> int:
    """Moves the decoder's embedding table from the GPU into page-locked host memory and returns the
    bytes freed (0: tied to the LM head, which reads every row each token, or already on the host).
    A token's row is then read over PCIe by the decode graph (engine/model/ops.py `embed_tokens`):
    one row per token, against a table of vocabulary x hidden (Qwen3.6: 1.0 GB, 160 expert slots).
    llama.cpp keeps its token embedding in host memory as well."""
    w = decoder.weights
    table = w.embed
    if not table.is_cuda or table.data_ptr() == w.lm_head.data_ptr():
        return 0
    host = torch.empty(table.shape, dtype=table.dtype, pin_memory=True)
    host.copy_(table)
    w.embed = host
    del table
    torch.cuda.empty_cache()  # the slots are sized next: the freed block must not stay reserved
    return host.numel() * host.element_size()


def resolve_fetch_ratio(banks: ExpertBanks, opts: EngineOptions) -> float:
    """The fetch ratio from the calibration of this machine for these banks' format (packed banks:
    their most common gate_up / down format pair, run by the packed executor: a packed format's CPU
    rate per byte is its own), measured now and stored when the store has none; the executor then
    adapts it online where adaptation is on (engine/gpu/adapt.py)."""
    if opts.fetch_ratio >= 0:
        return opts.fetch_ratio
    from engine.gpu.calibrate import CalibrationSpec, calibrate, machine_key
    from engine.gpu.calibration_store import load, save
    from engine.moe.native import FORMAT_OF_DTYPE, load_native

    pool = opts.native_pool_threads
    packed = isinstance(banks, PackedExpertBanks)
    hidden, inter = banks.w2.shape[1], banks.w2.shape[2]
    fmt, fmt_down = FORMAT_OF_DTYPE.get(banks.w13.dtype, "bf16"), ""
    if isinstance(banks, PackedExpertBanks):
        (fmt, fmt_down), _ = Counter(zip(banks.fmt_gu, banks.fmt_d, strict=True)).most_common(1)[0]
        hidden, inter = banks.hidden, banks.inter
    spec = CalibrationSpec(fmt=fmt, hidden=hidden, inter=inter, threads=pool, bank_bytes=10**9, seconds=0.4,
                           rounds=2, device=opts.device, packed=packed, fmt_down=fmt_down)
    threads = pool or load_native().physical_cores()
    path = Path(opts.calibration_file) if opts.calibration_file else None
    if path is not None:
        cal = load(path, machine_key(spec, threads, spec.device.startswith("cuda") and torch.cuda.is_available()))
        if cal is not None:
            return cal.ratio()
    log.warning("no stored B_P / B_C for this machine: measuring them now (a few seconds)")
    cal = calibrate(spec)
    if path is not None:
        save(path, cal)
    log.warning("measured B_C %.1f GB/s, B_P %s GB/s (%s experts) -> fetch ratio %.2f", cal.b_cpu, cal.b_pcie,
                spec.key_format, cal.ratio())
    return cal.ratio()


def attach_expert_cache(decoder: Decoder, opts: EngineOptions, dtype: torch.dtype) -> GpuBudget:
    banks = decoder.weights.experts
    if not isinstance(banks, PackedExpertBanks) and (banks.b13 is not None or banks.activation != "silu"):
        raise ConfigError(f"the GPU expert cache runs float experts without biases, with silu; these have biases "
                          f"and {banks.activation} (a bf16 gpt-oss checkpoint): run with --gpu-memory off, or "
                          "load the MXFP4 checkpoint, whose packed experts the cache holds")
    device = torch.device(opts.device)
    if device.type != "cuda":
        raise ConfigError(f"--gpu-memory caps GPU memory, but the engine runs on {device}")
    freed = host_embedding(decoder) if opts.gpu.host_embed else 0
    if freed:
        log.info("token embedding in page-locked host memory: %.2f GiB more for expert slots", freed / 2**30)
    budget = split_gpu_memory(opts.gpu_memory, decoder.cfg, opts, dtype, dense_bytes(decoder.weights, device),
                              banks.expert_bytes)
    pin_in_place(banks)
    ratio = resolve_fetch_ratio(banks, opts)
    g = opts.gpu
    decoder.executor = create_cached_executor(banks, budget.experts, device, ratio, threads=opts.native_pool_threads,
                                              graphs=opts.cuda_graphs, plan=g.plan, adapt=g.adapt_ratio,
                                              split=g.split_expert)
    decoder.cuda_graphs = opts.cuda_graphs  # decode passes through CUDA graphs (engine/model/decode_graph.py)
    log.info("GPU memory: %s; fetch ratio %.2f", budget.describe(), ratio)
    return budget
