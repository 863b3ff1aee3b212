"""`CachedExpertExecutor`: routed experts through the GPU expert cache, misses split between PCIe
fetches and the CPU executor (paper 3.2), both halves merged exactly.

Contract: `CachedExpertExecutor(banks, slots, table, cpu_executor, ratio)` implements the
`ExpertExecutor` protocol (engine/moe/executor.py). Per call (one MoE layer):
1. `plan_layer` (engine/gpu/plan.py) updates the cache state and rewrites routed ids into slot ids
   (hits and fetched misses) or -1 (misses left to the CPU);
2. `slots.apply_copies` brings the fetched experts into their slots;
3. the device part runs every entry with a slot id from the slot pool, grouped by expert;
4. the CPU part runs the remaining entries through `cpu_executor` on host tensors (the native
   executor when it can serve the banks, else the torch reference: `default_cpu_executor`);
5. the output is device part + CPU part, in x's dtype and device.
The result is the reference's (TorchExpertExecutor) up to float summation order: when every entry
lands on one side, or with top-1 routing, it is bit-identical to the torch reference (the device
part accumulates experts in the reference's order, ascending expert id, and the CPU part is
handed exactly the CPU entries); when the entries are split, the two partial sums are added
once, which rounds differently from the reference's single running sum.

The CPU part gets only its own entries (`cpu_entries`): the tokens that have any, each with its
CPU entries first, padded to the widest token's count with a zero-weight duplicate of one of its
own experts (the native executor computes every entry it is given, so zeroing the weights of
device entries would still read their weights from DRAM).

`stats` counts hits, misses and fetched experts over all calls (kept on the device, read on
demand). Outside the decode steps below, this path reads the plan's small outputs on the host once
per layer (slot ids and copy list, one transfer), runs the CPU branch in a worker thread while the
copies and the device part are queued, and the device part loops over experts in Python (a few
more syncs). `overlap` (default: on unless the slots live on the CPU) runs the CPU branch in that
worker; `close()` stops it.

Decode-sized batches on CUDA go through `DeviceStep` (engine/gpu/device_step.py) instead, each
layer's step in a CUDA graph of its own, or enqueued as it is inside a captured whole pass
(engine/model/decode_graph.py: `graph_step` / `with_side_work`; `capturable` up to `step_tokens`
tokens). `plan` picks its plan (the option gpu.plan), `adapt` (gpu.adapt_ratio) corrects the
ratio online (engine/gpu/adapt.py; the plan kernel reads it from `ratio_device`). `check()`, which
the scheduler calls after every forward, raises what the steps' host tasks could not (and applies
the ratio correction). `split` (on wherever it can run: the fused plan, the native CPU side, a
scratch slot in the pool;
gpu.split_expert off turns it off, on insists) has each decode step split one miss by
intermediate rows between a partial fetch and the CPU (engine/gpu/policy.py `split_share`), so
the two sides can balance to a fraction of an expert instead of a whole one; `adapt` then defaults
to on (gpu.adapt_ratio off turns it off).

Packed (quantized) banks (`PackedExpertBanks`) get a `PackedPool` (engine/gpu/quant/pool.py) of
packed slots instead of `ExpertSlots`: a fetch copies the expert's stored bytes, the GPU computes
from them with the packed kernels (engine/gpu/quant/), the CPU part runs on the packed executor
(engine/moe/packed.py; the native moe_packed kernel serves the decode steps' host tasks). No expert
split; `adapt` defaults to on, since the starting ratio comes from one format pair's calibration
(the most common; a Q4_K_M file mixes two down formats).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from engine.errors import ConfigError, EngineError
from engine.gpu.adapt import RatioController
from engine.gpu.cache_table import CacheTable
from engine.gpu.device_step import DeviceStep, StepParts, resolve_plan
from engine.gpu.plan import plan_layer
from engine.gpu.policy import check_ratio
from engine.gpu.prefill import PrefillStreamer
from engine.gpu.quant.pool import PackedPool
from engine.gpu.slots import ExpertSlots, SlotPool
from engine.moe.base import CacheStats, ExpertExecutor
from engine.moe.executor import TorchExpertExecutor, create_executor
from engine.moe.native import NativeExpertExecutor, native_unsupported
from engine.moe.packed import PackedExpertExecutor
from engine.weights.layout import ExpertBanks, PackedExpertBanks

log = logging.getLogger("freetoken.engine")

SPLIT_ROWS = 32  # the split expert's share moves in steps of this many intermediate rows


def resolve_split(split: bool | None, banks: ExpertBanks, plan: str, device: torch.device, native_cpu: bool) -> bool:
    """Whether decode steps split one miss per layer (the option gpu.split_expert): `split`, where
    None means on wherever it can run (a CUDA pool, the fused plan, the native CPU executor, experts
    `split_units` can divide). Asked for where the plan or experts cannot split: a ConfigError at
    start, never a silent fallback."""
    asked = split
    units = split_units(banks)
    can = plan == "fused" and units > 0
    if asked and not can:
        raise ConfigError("split_expert (FREETOKEN_SPLIT_EXPERT=1) needs the fused plan and bf16 / f32 experts "
                          f"whose size is a multiple of {SPLIT_ROWS}")
    if asked is None:
        return can and device.type == "cuda" and native_cpu
    return asked


def serves_steps(cpu_executor: ExpertExecutor) -> bool:
    """Whether the CPU executor can run a device step's CPU branch (a native one: its host tasks;
    for packed banks the native moe_packed kernel)."""
    if isinstance(cpu_executor, PackedExpertExecutor):
        return cpu_executor.name == "native"
    return isinstance(cpu_executor, NativeExpertExecutor)


def split_units(banks: ExpertBanks) -> int:
    """Steps of SPLIT_ROWS rows in one expert, or 0 where the banks cannot be split (the native CPU
    side splits bf16 / f32 weights at multiples of 16 rows)."""
    if isinstance(banks, PackedExpertBanks):
        return 0
    inter = banks.w2.shape[2]
    ok = banks.w13.dtype in (torch.bfloat16, torch.float32) and inter % SPLIT_ROWS == 0 and inter > SPLIT_ROWS
    return inter // SPLIT_ROWS if ok else 0


def default_cpu_executor(banks: ExpertBanks, threads: int = 0) -> ExpertExecutor:
    """The native CPU executor when it can serve the banks, else the torch reference, with a warning
    that says why (it is several times slower: a missing native build cost a GPU run its figures).
    Packed banks: the packed executor (native moe_packed when built)."""
    if isinstance(banks, PackedExpertBanks):
        ex = create_executor("auto", banks, "cpu", threads)
        if not serves_steps(ex):
            log.warning("the expert cache's CPU misses run on the packed torch reference: native moe_packed is "
                        "not built (python native/build.py)")
        return ex
    why = native_unsupported(banks, "cpu")
    if why is None:
        return NativeExpertExecutor(banks, threads)
    log.warning("the expert cache's CPU misses run on the torch reference, several times slower than the native "
                "executor, which cannot serve them: %s", why)
    return TorchExpertExecutor(banks)


def grouped_slot_experts(x: torch.Tensor, ids: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor,
                         slots: SlotPool, moe_index: int = 0) -> torch.Tensor:
    """sum over entries with slot_ids >= 0 of weight * expert(x), experts read from `slots`,
    accumulated in ascending expert id as TorchExpertExecutor does. A packed pool on CUDA runs
    the packed GEMV (engine/gpu/quant/gemv.py); elsewhere its slots are dequantized and the
    products taken in float32, as the packed CPU executor does."""
    if isinstance(slots, PackedPool) and x.is_cuda:
        from engine.gpu.quant.gemv import packed_slot_experts

        return packed_slot_experts(x, ids, slot_ids, weights, slots.packed, slots.formats[moe_index],
                                   activation=slots.activation, alpha=slots.alpha, limit=slots.limit).to(x.dtype)
    packed = isinstance(slots, PackedPool)
    out = torch.zeros(x.shape, dtype=torch.float32 if packed else x.dtype, device=x.device)
    k = ids.shape[1]
    flat_slot = slot_ids.reshape(-1)
    # device entries sorted by expert id; CPU entries (key E_max) last and never visited
    key = torch.where(flat_slot >= 0, ids.reshape(-1).to(torch.int64), torch.iinfo(torch.int64).max)
    order = torch.argsort(key, stable=True)
    n_dev = int((flat_slot >= 0).sum())
    order = order[:n_dev]
    slot_sorted = flat_slot[order]
    flat_w = weights.reshape(-1)[order]
    token_of = order // k
    slot_groups, counts = torch.unique_consecutive(slot_sorted, return_counts=True)
    start = 0
    for slot, count in zip(slot_groups.tolist(), counts.tolist(), strict=True):
        rows = token_of[start:start + count]
        y = slots.forward(slot, moe_index, x[rows]) * flat_w[start:start + count, None]
        out.index_add_(0, rows, y.to(out.dtype))
        start += count
    return out.to(x.dtype)


def cpu_entries(ids: torch.Tensor, weights: torch.Tensor,
                on_cpu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(tokens [T'], ids [T', k'], weights [T', k']): the tokens that have CPU entries and only
    those entries, k' = the widest token's count, narrower tokens padded with zero-weight
    duplicates of one of their own experts; None when there is no CPU entry. Tokens without CPU
    work are left out, so each expert the CPU runs sees exactly the reference's rows whenever no
    padding is needed (decode at batch 1, top-1 routing, or every entry on the CPU)."""
    per_token = on_cpu.sum(dim=1)
    width = int(per_token.max()) if on_cpu.numel() else 0
    if width == 0:
        return None
    tokens = torch.nonzero(per_token > 0).reshape(-1)
    ids, weights, on_cpu = ids[tokens], weights[tokens], on_cpu[tokens]
    # a stable sort of (not on_cpu) puts each token's CPU entries first, in their routed order
    order = torch.sort((~on_cpu).to(torch.int8), dim=1, stable=True).indices[:, :width]
    valid = on_cpu.gather(1, order)
    cids = ids.gather(1, order)
    cids = torch.where(valid, cids, cids[:, :1])  # every kept token has >= 1 CPU entry, first
    cw = torch.where(valid, weights.gather(1, order), torch.zeros((), dtype=weights.dtype))
    return tokens, cids.contiguous(), cw.contiguous()


class CachedExpertExecutor(ExpertExecutor):
    has_stats = True

    def __init__(self, banks: ExpertBanks, slots: SlotPool, table: CacheTable, cpu_executor: ExpertExecutor,
                 ratio: float, overlap: bool | None = None, graphs: bool = True, step_tokens: int = 8,
                 plan: str | None = None, adapt: bool | None = None, split: bool | None = None) -> None:
        table.check_matches(banks, slots)
        self.banks, self.slots, self.table = banks, slots, table
        self.cpu_executor = cpu_executor
        self.ratio = check_ratio(ratio)
        # CPU branch in a worker thread: by default only when a real device runs the other half
        self.overlap = table.device.type != "cpu" if overlap is None else overlap
        self._worker: ThreadPoolExecutor | None = None
        self._calls = 0
        self._counts = torch.zeros(4, dtype=torch.int64, device=table.device)  # hits, misses, fetched, split
        # decode-sized batches on CUDA with the native CPU side: the sync-free step (device_step.py)
        self.graphs = graphs
        self.plan = resolve_plan(plan)  # a bad plan name fails here, at start
        # The steps' fetches are issued by the host: nothing may read device memory into pageable
        # host memory while a step is queued (such a read holds a driver lock the copier's copies
        # need: a deadlock, eighth GPU session): the scheduler reads only after check() has
        # synchronised, and so does `stats`.
        # one miss per decode step split by rows between a partial fetch and the CPU (on where it can
        # run since the tenth GPU session); the requests are kept for a rebuilt pool (engine/gpu/elastic.py)
        self.split_request, self.adapt_request = split, adapt
        native = serves_steps(cpu_executor)
        on = resolve_split(split, banks, self.plan, table.device, native)
        # the plan's (units, rows per unit), or None: also none for a pool too small for a scratch slot
        # next to a table slot (create_cached_executor makes the scratch when the split is on)
        self.split_steps = ((split_units(banks), SPLIT_ROWS)
                            if on and slots.scratch is not None and table.device.type == "cuda" else None)
        # the ratio corrected online from which branch finishes last (engine/gpu/adapt.py): opt-in, and
        # on by default with the split: a ratio nudge then moves a fraction of an expert, where whole
        # experts per layer barely moved (ninth GPU session: the pair +13.6 %, the split alone +2.4 %)
        # packed banks: the ratio comes from the most common format pair's calibration (layers'
        # formats differ), so it adapts online by default
        packed = isinstance(banks, PackedExpertBanks)
        self.adapt = (self.split or (packed and native and self.plan == "fused")) if adapt is None else adapt
        if self.adapt and self.plan != "fused":
            raise ConfigError("adapt_ratio (FREETOKEN_ADAPT_RATIO=1) needs the fused plan")
        self._controller = RatioController(self.ratio)
        # the plan kernel reads the ratio from here: check() may rewrite it between steps
        self.ratio_device = (torch.tensor([self.ratio], dtype=torch.float64, device=table.device)
                             if table.device.type == "cuda" else None)
        self.step_tokens = step_tokens if table.device.type == "cuda" and native else 0
        self._steps: dict[int, DeviceStep] = {}
        self._failures_checked = 0  # native host-task failures seen by check()
        self._graph_pool: Any = None
        # large chunks (dense routing): every layer's experts streamed into two layer buffers
        # (engine/gpu/prefill.py), when the pool holds two layers but not the whole model
        E = banks.num_experts
        self.prefill_entries = 4 * E  # N * k at which about 98% of a layer's experts are routed
        self.streamer: PrefillStreamer | None = None
        if PrefillStreamer.fits(slots, E) and slots.slots < table.layers * E:
            copy_stream = torch.cuda.Stream(table.device) if table.device.type == "cuda" else None
            self.streamer = PrefillStreamer(banks, slots, table, copy_stream)

    @property
    def split(self) -> bool:
        """Whether decode steps split one miss per layer (gpu.split_expert)."""
        return self.split_steps is not None

    @property
    def stats(self) -> CacheStats:
        """Counts over all calls so far (reads the device counters: a host sync)."""
        if self._counts.is_cuda:
            # the stream first: a read to pageable memory while a step waits for a host-issued
            # fetch holds a driver lock the copier's copies need (a deadlock on the H200)
            torch.cuda.current_stream(self._counts.device).synchronize()
        hits, misses, fetched, split = self._counts.tolist()
        return CacheStats(self._calls, hits, misses, fetched, split)

    def describe(self) -> str:
        steps = "off" if not self.step_tokens else ("CUDA graphs" if self.graphs else "eager")
        fetch = (" adaptive" if self.adapt else "") + (" split" if self.split else "")
        return (f"cached ({self.slots.slots} slots on {self.slots.device}, fetch ratio {self.ratio:.3f}{fetch}; "
                f"misses on {self.cpu_executor.describe()}; decode steps <= {self.step_tokens} tokens: {steps})")

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, moe_index: int) -> torch.Tensor:
        streamer = self.streamer
        if streamer is not None:
            if ids.numel() >= self.prefill_entries:
                last = moe_index + 1 >= self.table.layers
                try:
                    return streamer.layer(x, ids, weights, moe_index, None if last else moe_index + 1)
                finally:
                    if last:
                        streamer.finish()
            if streamer.active:  # a forward that stopped streaming midway: give the buffers back
                streamer.finish()
        if 0 < ids.shape[0] <= self.step_tokens and x.is_cuda:
            return self._device_step(ids.shape[0], ids.shape[1], x.dtype).step(x, ids, weights, moe_index)
        dev = self.table.device
        plan = plan_layer(self.table, moe_index, ids.to(dev), self.ratio)
        self._calls += 1
        self._counts += plan.counts()  # on the device: no sync
        # one device->host read of the small per-layer decisions (the sync a device-side copy
        # kernel and CPU-branch host node would remove)
        n = ids.numel()
        host = torch.cat([plan.slot_ids.reshape(-1), plan.copy_src, plan.copy_dst]).cpu()
        on_cpu = (host[:n] < 0).view(ids.shape)
        copy_src, copy_dst = host[n:].chunk(2)
        part = cpu_entries(ids.cpu(), weights.cpu(), on_cpu)
        cpu_job: _Done | Future[tuple[torch.Tensor, torch.Tensor]] | None = None
        if part is not None:
            # the CPU branch starts first (paper 3.2); on a GPU it runs in a worker thread (the
            # native executor releases the GIL) while copies and the device part are queued. With
            # the CPU standing in for the GPU both halves share the same cores: inline (`overlap`).
            x_cpu = x.cpu()  # here, on the caller's stream, not from the worker thread
            if not self.overlap:
                cpu_job = _Done(self._cpu_part(x_cpu, part, moe_index))
            else:
                cpu_job = self._pool().submit(self._cpu_part, x_cpu, part, moe_index)
        self.slots.apply_copies(copy_src, copy_dst, self.banks)
        out = None
        if not bool(on_cpu.all()):
            out = grouped_slot_experts(x.to(dev), ids.to(dev), plan.slot_ids, weights.to(dev), self.slots, moe_index)
            out = out.to(x.device)
        if cpu_job is None:
            assert out is not None
            return out
        tokens, cpu_out = cpu_job.result()
        cpu_out = cpu_out.to(x.device, x.dtype)
        if out is None:  # nothing on the device: the CPU part is the whole result
            return cpu_out
        if tokens.numel() == x.shape[0]:
            return out + cpu_out
        return out.index_add_(0, tokens.to(x.device), cpu_out)

    def _cpu_part(self, x_cpu: torch.Tensor, part: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                  moe_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, cids, cw = part
        if tokens.numel() != x_cpu.shape[0]:
            x_cpu = x_cpu[tokens].contiguous()
        return tokens, self.cpu_executor(x_cpu, cids, cw, moe_index)

    def _device_step(self, tokens: int, k: int, dtype: torch.dtype) -> DeviceStep:
        step = self._steps.get(tokens)
        if step is None:
            if self.graphs and self._graph_pool is None:
                self._graph_pool = torch.cuda.graph_pool_handle()
            step = DeviceStep(self._step_parts(), tokens, k, dtype, self.graphs, self._graph_pool, self.plan)
            self._steps[tokens] = step
        return step

    def _step_parts(self) -> StepParts:
        # device steps run on CUDA only, with the native CPU side (`step_tokens`)
        assert self.ratio_device is not None and serves_steps(self.cpu_executor)
        experts = self.cpu_executor.experts if isinstance(self.cpu_executor, NativeExpertExecutor) else None
        return StepParts(self.banks, self.slots, self.table, experts, self._counts,
                         self.ratio_device, self.split_steps, self.adapt)

    def begin_forward(self, entries: int) -> None:
        """A chunk the streamer will take (`entries` routed entries per layer, tokens x k) has its
        first MoE layer's experts start streaming now, so those copies overlap the embedding and
        the first attention instead of delaying layer 0; any other pass first gives back the layer
        buffers of a forward that stopped streaming midway."""
        streamer = self.streamer
        if streamer is None:
            return
        if entries >= self.prefill_entries:
            streamer.start(0)
        elif streamer.active:
            streamer.finish()

    def capturable(self, tokens: int) -> bool:
        """Decode steps of up to `step_tokens` tokens enqueue inside a capture (`graph_step`)."""
        return 0 < tokens <= self.step_tokens

    def graph_step(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, moe_index: int) -> torch.Tensor:
        """The device step enqueued as it is (no graph of its own): for a caller capturing a larger
        graph around it (engine/model/decode_graph.py). The result lives in the step's buffer."""
        step = self._device_step(ids.shape[0], ids.shape[1], x.dtype)
        return step.enqueue(x, ids, weights, moe_index)

    def with_side_work(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, moe_index: int,
                       side: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """`graph_step` with `side()` (GPU work on other inputs: the shared expert) queued where the
        step's stream would otherwise wait for the fetch or the CPU branch; returns (out, side())."""
        step = self._device_step(ids.shape[0], ids.shape[1], x.dtype)
        return step.enqueue_with_side(x, ids, weights, moe_index, side)

    def check(self, tokens: int | None = None, wait: bool = True) -> None:
        """After a forward pass of `tokens` tokens: raises `EngineError` if a decode step's CPU branch
        or host-issued fetch failed since the last check (they run where nothing can raise: a host
        node, the poller). The queued work is waited for first (the caller reads the logits next
        anyway), unless `wait` is False: the caller waited for that pass's own event, and a later
        pass may be queued behind it (engine/decode_pipeline.py); a failure then waits for the
        stream before it looks further. A failure empties the cache (a failed fetch may have left
        stale rows in slots the table calls resident), so the next step starts clean. One native
        read when nothing failed. A pass larger than a decode step ran no device step: nothing to
        wait for (a prefill chunk's successor is queued while it runs)."""
        if not self._steps or (tokens is not None and tokens > self.step_tokens):
            return
        from native.ftnative import host_task_failures, poll_lateness

        if wait and self.table.device.type == "cuda":
            torch.cuda.current_stream(self.table.device).synchronize()
        if self.adapt and self.ratio_device is not None:
            new = self._controller.observe(*poll_lateness())
            if new is not None:
                self.ratio = new
                self.ratio_device.fill_(new)  # in stream order, before the next step's plans
        failures = host_task_failures()
        if failures == self._failures_checked:
            return
        self._failures_checked = failures
        if not wait and self.table.device.type == "cuda":
            torch.cuda.current_stream(self.table.device).synchronize()  # before the steps read the device
        try:
            for step in self._steps.values():
                step.check()
        except RuntimeError as e:
            self.table.reset()
            raise EngineError(f"expert cache step failed (cache emptied): {e}") from e

    def _pool(self) -> ThreadPoolExecutor:
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="freetoken-cpu-experts")
        return self._worker

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
            self._worker = None


class _Done:
    """An already computed result with a future's `result()`."""

    def __init__(self, value: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.value = value

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.value

def create_cached_executor(banks: ExpertBanks, budget_bytes: int, device: torch.device | str, ratio: float,
                           cpu_executor: ExpertExecutor | None = None, threads: int = 0,
                           graphs: bool = True, plan: str | None = None, adapt: bool | None = None,
                           split: bool | None = None) -> CachedExpertExecutor:
    """A `CachedExpertExecutor` with a slot pool of `budget_bytes` on `device` and an empty cache
    (and a scratch slot in it when the expert split is on: `resolve_split`)."""
    cpu_executor = cpu_executor or default_cpu_executor(banks, threads)
    scratch = resolve_split(split, banks, resolve_plan(plan), torch.device(device), serves_steps(cpu_executor))
    slots: SlotPool
    if isinstance(banks, PackedExpertBanks):
        slots = PackedPool.from_budget(banks, budget_bytes, device)
    else:
        slots = ExpertSlots.from_budget(banks, budget_bytes, device, scratch=scratch)
    layers = banks.rows // banks.num_experts
    table = CacheTable(layers, banks.num_experts, slots.slots, device)
    return CachedExpertExecutor(banks, slots, table, cpu_executor, ratio, graphs=graphs, plan=plan, adapt=adapt,
                                split=split)
