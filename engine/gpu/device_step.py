"""The decode-sized MoE layer of the GPU expert cache, queued without one host synchronisation and
captured in a CUDA graph per (layer, batch size).

Contract: `DeviceStep(parts, tokens, k, dtype, graphs, pool, plan)` serves the expert cache whose
`StepParts` it is given (engine/gpu/executor.py's CachedExpertExecutor, whose CPU side is the
native executor) for batches of exactly `tokens` tokens routed to `k` experts each;
`step(x, ids, weights, layer)` returns the layer's routed-expert output in a buffer the next call
of this step overwrites (consume it before that, in stream order: the decoder's residual add does).
Per call, on the current stream:

    plan (table, LRU, q*, victims, slot ids, copy list: in one Triton program,
          engine/gpu/plan_kernel.py, plan="fused", the default, for up to 16 routed entries; else
          engine/gpu/plan.py's ~25 torch kernels, plan="torch")
    hand-off kernel: x, CPU ids (-1 = on the GPU), weights and the copy list written into
          page-locked host buffers through their device mapping; the doorbell rung
      |-- host: the native poller hands the copy list to its copier thread, which queues the
      |         copies on this step's copy stream (the copy engines) and sets a per-layer word from
      |         the host once they have landed; the poller runs the CPU experts
      |         (engine/gpu/host_fn.py) into a page-locked output buffer and answers
      '-- GPU: the GEMVs of the entries already in slots (Triton), [side work], wait for the word,
               the fetched entries' GEMVs (native/src/dma_fetch.h)
    wait for the answer; combine kernel: the GPU rows in ascending expert id + the CPU part (read
          from host memory) -> out

so the CPU experts and the copies run while the GPU computes, on one stream of the GPU's. With the
executor's `split` (option gpu.split_expert) the plan also names one split expert: the copy list
carries its [flat id, r] after the pairs, the copier fetches its first r rows into the scratch slot
with the others, the GEMVs run those rows from the scratch after the word, and the hand-off gives
the CPU its id too, whose task computes the rows from r on. While steps run, the native pool's idle
workers spin for CPU_BRANCH_SPIN_US between calls rather than sleeping after 100 us (a sleeping
worker's wake-up costs tens of microseconds, every layer). A layer's first run waits out each of
its waits for the host before it launches the next kernel (`_enqueue`: a kernel's first load may
wait for the device). docs/gpu-tier.md has the measurements behind each part (and behind the
parts they replaced: a host-node CPU branch, a fetch kernel, a stream-written fetch word).

With `graphs`, the first call of a layer runs eagerly (it compiles the kernels), the second
captures the same sequence into a CUDA graph and replays it, and later calls only copy the inputs
in and replay: no per-layer Python beyond that. `enqueue` (for a caller capturing a whole decode
step) reads its inputs in place instead. A capture that fails is logged once and that layer
stays eager (correct, slower). The page-locked staging buffers are shared by the layers of one
batch size, which is safe because each layer's step has read the CPU's answer (and the CPU has
read its inputs) before the next layer's hand-off can start. The fused plan reads the ratio from
the parts' device scalar (`StepParts.ratio`), so a new ratio applies to captured steps too; so does
the torch plan.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from engine.errors import ConfigError
from engine.gpu import load_guard
from engine.gpu.cache_table import CacheTable
from engine.gpu.host_fn import clear, device_address, ring, wait_done
from engine.gpu.plan import plan_layer
from engine.gpu.quant.pool import PackedPool
from engine.gpu.slots import ExpertSlots, SlotPool
from engine.graphs import GraphCache
from engine.weights.layout import ExpertBanks, PackedExpertBanks

CPU_BRANCH_SPIN_US = 2000  # native pool workers' idle spin while a GPU step drives them
PLANS = ("torch", "fused")


def resolve_plan(name: str | None) -> str:
    """`name`, else "fused"; ConfigError for an unknown one."""
    plan = name or "fused"
    if plan not in PLANS:
        raise ConfigError(f"unknown cache plan {plan!r} (known: {', '.join(PLANS)})")
    return plan


@dataclass(frozen=True)
class StepParts:
    """What the decode steps share with their expert cache (which owns every part)."""

    banks: ExpertBanks
    slots: SlotPool  # ExpertSlots, or a PackedPool over PackedExpertBanks
    table: CacheTable
    cpu_experts: Any  # the native executor's weights (native/formats.py ExpertWeights; None for packed banks)
    counts: torch.Tensor  # [4] int64 on the device: hits, misses, fetched, split
    ratio: torch.Tensor  # [1] float64 on the device: the fetch ratio the plans read (rewritten between steps)
    split: tuple[int, int] | None  # the split expert's (units, rows per unit), or None
    adapt: bool  # the ratio adapts online: the doorbell gets the GPU's "my branch is done" word


class DeviceStep:
    def __init__(self, parts: StepParts, tokens: int, k: int, dtype: torch.dtype, graphs: bool = True,
                 pool: Any = None, plan: str | None = None) -> None:
        from engine.gpu import kernels  # Triton: imported only where a GPU runs the step
        from engine.gpu.host_fn import current_context
        from native.ftnative import set_worker_spin_us, worker_spin_us

        # the CPU branch is called every few hundred microseconds (one MoE layer's GPU work apart):
        # keep the native workers spinning across that gap instead of waking them from sleep
        set_worker_spin_us(max(worker_spin_us(), CPU_BRANCH_SPIN_US))

        self._kernels = kernels

        self.ex = parts
        self.tokens = tokens
        dev = parts.table.device
        banks = parts.banks
        # packed banks: the packed slots' kernels per layer, and the packed host task's buffers
        # (int32 ids, a float32 answer)
        self._packed = parts.slots if isinstance(parts.slots, PackedPool) else None
        packed = isinstance(banks, PackedExpertBanks)
        hidden = banks.hidden if isinstance(banks, PackedExpertBanks) else banks.w2.shape[1]
        self.k = k
        self.x = torch.zeros(tokens, hidden, dtype=dtype, device=dev)
        self.ids = torch.zeros(tokens, k, dtype=torch.int64, device=dev)
        self.w = torch.zeros(tokens, k, dtype=dtype, device=dev)
        self.out = torch.zeros(tokens, hidden, dtype=dtype, device=dev)
        self.x_h = torch.zeros(tokens, hidden, dtype=dtype, pin_memory=True)
        self.ids_h = torch.zeros(tokens, k, dtype=torch.int32 if packed else torch.int64, pin_memory=True)
        self.w_h = torch.zeros(tokens, k, dtype=torch.float32, pin_memory=True)
        self.out_h = torch.zeros(tokens, hidden, dtype=torch.float32 if packed else dtype, pin_memory=True)
        self.copies = min(tokens * k, banks.num_experts)  # the copy list's valid prefix is at most this
        # the per-layer plan: the same decisions in one Triton program (engine/gpu/plan_kernel.py)
        # when the sizes fit it, else plan_layer's ~25 torch kernels
        self.plan = resolve_plan(plan)
        if self.plan == "fused":
            from engine.gpu import plan_kernel

            self._fused = plan_kernel if plan_kernel.fusable(parts.table, self.ids) else None
        else:
            self._fused = None
        self._split = parts.split
        # the device ratio as a 0-d view, made once: the torch plan reads it like the fused plan, so
        # a captured step follows the online ratio (the executor's check() rewrites it in place)
        self._ratio = parts.ratio[0]
        # the host-issued fetch: the copier queues the copies on this stream
        self.copy_stream = torch.cuda.Stream(device=dev)
        self._fetched: dict[int, tuple[torch.Tensor, int]] = {}
        # shared by the layers like the other staging buffers: the poller has read a layer's list
        # before it answers, and the next layer's hand-off waits for that answer; then the split
        # expert's entry (flat id, rows) when the executor splits one
        self.copy_h = torch.full((2 * self.copies + (2 if self._split is not None else 0),), -1, dtype=torch.int64,
                                 pin_memory=True)
        self._context = current_context()
        self._tasks: dict[int, object] = {}
        self._settled: set[int] = set()  # layers whose first (eager) run is done: their kernels are loaded
        # device steps make the device wait for the host: from now on every Triton load in the
        # process waits for the device first (a load behind such a wait can deadlock)
        load_guard.install()
        self._failures_seen: dict[int, int] = {}  # per layer: the task failures check() has reported
        self._doorbells: dict[int, tuple[torch.Tensor, int]] = {}
        self._graphs = GraphCache(f"MoE step ({tokens} tokens), layer", enabled=graphs, pool=pool)
        # the split expert: the plan's steps and the scratch slot (-2 without: never a slot id, nor
        # the -1 that marks a CPU entry)
        self._scratch = parts.slots.scratch if self._split is not None and parts.slots.scratch is not None else -2
        assert self._split is None or self._scratch >= 0

    def _task(self, layer: int) -> object:
        task = self._tasks.get(layer)
        if task is None:
            from native.ftnative import HostTask

            ex = self.ex
            fetched = torch.zeros(1, dtype=torch.int32, pin_memory=True)
            address = device_address(fetched)
            banks, pool = ex.banks, self._packed
            if isinstance(banks, PackedExpertBanks) and pool is not None:
                from native.packed import PackedHostTask

                gs = banks.gscale[layer]
                task = PackedHostTask(self.x_h, self.ids_h, self.w_h, banks.gate_up[layer], banks.fmt_gu[layer],
                                      banks.down[layer], banks.fmt_d[layer], gs, self.out_h)
                task.serve_packed_fetch(self.copy_h, banks.gate_up[layer], banks.down[layer],
                                        gs if pool.gscales else None, layer * banks.num_experts, pool.packed.data,
                                        pool.formats[layer].gate_up_bytes, pool.packed.gscale,
                                        self.copy_stream.cuda_stream, self._context, fetched)
            else:
                slots = ex.slots
                assert isinstance(slots, ExpertSlots)
                task = HostTask(self.x_h, self.ids_h, self.w_h, ex.cpu_experts, self.out_h,
                                id_offset=layer * banks.num_experts)
                task.serve_fetch(self.copy_h, banks.w13, banks.w2, slots.w13, slots.w2,
                                 self.copy_stream.cuda_stream, self._context, fetched, scratch=self._scratch)
            self._fetched[layer] = (fetched, address)
            # a third word when the ratio adapts: the GPU's "my branch is done" (adapt.py)
            words = torch.zeros(3 if ex.adapt else 2, dtype=torch.int32, pin_memory=True)
            task.serve_doorbell(words)
            self._doorbells[layer] = (words, device_address(words))
            self._tasks[layer] = task
        return task

    def _enqueue(self, layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
                 side_work: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        ex = self.ex
        main = torch.cuda.current_stream()
        # A layer's first run is eager (the capture comes later) and launches kernels never loaded
        # before (a new width's or layer's specialisation: the plan kernel's per-layer offset, the
        # phases after the waits). Loading a module can wait for the device (NVIDIA's lazy-loading
        # notes warn of kernels that wait on other work), while the device waits for this step's
        # host side: the cause of the eleventh GPU session's "host-issued copies did not land
        # within 5000 ms" at a batch's first pass after it shrank 3 -> 2 (confirmed in the twelfth:
        # the overlap probe hung without this settle and finished with it). So in a first run each
        # wait for the host is waited out before the next kernel is launched; captured and later
        # runs are untouched.
        first = layer not in self._settled and not torch.cuda.is_current_stream_capturing()

        def settle() -> None:
            if first:
                main.synchronize()

        if self._fused is not None:
            # the device scalar: its online correction (engine/gpu/adapt.py) applies to captured
            # steps too
            plan = self._fused.plan_layer_fused(ex.table, layer, ids, ex.ratio, ex.counts, self._split,
                                                self._scratch)
        else:
            plan = plan_layer(ex.table, layer, ids, self._ratio, self._split, self._scratch)
            ex.counts.add_(plan.counts())
        self._task(layer)
        kernels = self._kernels
        # the CPU's inputs and the copy list leave before the fetch starts (PCIe reads would delay
        # them), written into the page-locked buffers by one kernel
        kernels.hand_off(x, ids, plan.slot_ids, w, self.x_h, self.ids_h, self.w_h, plan.copy_src[:self.copies],
                         plan.copy_dst[:self.copies], self.copy_h, split=plan.split, scratch=self._scratch)
        # everything on one stream: the ring follows the hand-off (its write fences the kernel's),
        # and the wait for the answer comes after all of the layer's GPU work
        words = self._doorbells[layer][1]
        ring(main, words)
        side_out: list[torch.Tensor] = []
        # the entries already in slots run while the copies fly, then the side work; the fetched
        # entries once the copier's word says the copies have landed
        word = self._fetched[layer][1]

        def between() -> None:
            if side_work is not None:
                side_out.append(side_work())
            wait_done(main, word)
            settle()

        if self._packed is not None:
            rows = self._packed.kernels[layer].expert_rows(x, plan.slot_ids, w, copy_dst=plan.copy_dst[:self.copies],
                                                           between=between)
        else:
            slots = ex.slots
            assert isinstance(slots, ExpertSlots)
            rows = kernels.expert_rows(x, plan.slot_ids, w, slots.w13, slots.w2, plan.copy_dst[:self.copies],
                                       between, plan.split, self._scratch)
        if ex.adapt:  # ready = 1 while this stream waits for the CPU's answer
            ring(main, words + 8)
        wait_done(main, words + 4)
        if ex.adapt:
            clear(main, words + 8)
        settle()
        self._settled.add(layer)
        # the GPU's rows in the reference's order plus the CPU's part, read from host memory
        kernels.combine_experts(rows, ids, self.out, self.out_h)
        return side_out[0] if side_out else None

    def enqueue(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, layer: int) -> torch.Tensor:
        """The step queued as it is, capture-safe: for a caller that captures a larger graph, whose
        capture fixes the inputs' addresses (so they are read in place, not staged)."""
        self._enqueue(layer, x, ids, weights.to(self.w.dtype))
        return self.out

    def enqueue_with_side(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, layer: int,
                          side_work: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """`enqueue`, with `side_work()` queued where this stream would otherwise wait: during the
        host-issued copies."""
        shared = self._enqueue(layer, x, ids, weights.to(self.w.dtype), side_work)
        assert shared is not None
        return self.out, shared

    def step(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, layer: int) -> torch.Tensor:
        """The step through this layer's own CUDA graph (eager, captured, replayed)."""
        self.x.copy_(x)
        self.ids.copy_(ids)
        self.w.copy_(weights)
        self._graphs.run(layer, lambda: self._enqueue(layer, self.x, self.ids, self.w))
        return self.out

    def check(self) -> None:
        """Raises a host task's failure that no earlier check reported (a task cannot raise where it
        runs: the poller thread): its CPU experts left zeros, or its fetch left slots
        with stale rows."""
        for layer, task in self._tasks.items():
            runs, failures, error = task.status()  # type: ignore[attr-defined]
            if failures > self._failures_seen.get(layer, 0):
                self._failures_seen[layer] = failures
                raise RuntimeError(f"MoE layer {layer}'s CPU branch failed {failures} of {runs} runs: {error}")

    @property
    def captured(self) -> int:
        return self._graphs.captured
