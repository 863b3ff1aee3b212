"""The decode-sized MoE layer of the GPU expert cache, queued without one host synchronisation and
captured in a CUDA graph per (layer, batch size).

Contract: `DeviceStep(parts, tokens, k, dtype, graphs, pool, cpu_branch, plan, fetch)` serves the expert
cache whose `StepParts` it is given (engine/gpu/executor.py's CachedExpertExecutor, whose CPU side
is the native executor) for batches of exactly `tokens` tokens
routed to `k` experts each; `step(x, ids, weights, layer)` returns the layer's routed-expert output
in a buffer the next call of this step overwrites (consume it before that, in stream order: the
decoder's residual add does). Per call, on the current stream:

    plan (table, LRU, q*, victims, slot ids, copy list: in one Triton program,
          engine/gpu/plan_kernel.py, plan="fused", the default, for up to 16 routed entries; else
          engine/gpu/plan.py's ~25 torch kernels, plan="torch")
    hand-off kernel: x, CPU ids (-1 = on the GPU) and weights written into page-locked host
          buffers through their device mapping; the doorbell rung
      |-- GPU: fetch kernel (copy list -> slots, over PCIe) -> slot experts (Triton GEMVs)
      '-- host: the native poller runs the CPU experts (engine/gpu/host_fn.py) into a
                page-locked output buffer and answers
    wait for the answer; combine kernel: the GPU rows in ascending expert id + the CPU part (read
          from host memory) -> out

so the CPU experts run while the GPU fetches and computes: six kernels and three stream memory
operations per layer, on one stream. With fetch="dma" (the default with the doorbell) there
is no fetch kernel: the hand-off kernel also writes the copy list into page-locked memory; the
poller's copier thread queues the copies on a copy stream of this step (the copy engines: the
bulk-copy rate, not the SMs' loads) and sets a per-layer word once they have landed (from the host
after the copy stream drains; FREETOKEN_DMA_WORD=stream: a stream write after them) while the
poller runs the CPU experts; the GPU runs the GEMVs of the entries already in slots meanwhile,
waits for that word, then runs the fetched entries' (native/src/dma_fetch.h). With the executor's
`split` (FREETOKEN_SPLIT_EXPERT) the plan also names one split expert: the copy list carries its
[flat id, r] after the pairs, the copier fetches its first r rows into the scratch slot with the
others, the GEMVs run those rows from the scratch after the word, and the hand-off gives the CPU its
id too, whose task computes the rows from r on. The CPU branch is handed to
the host by `cpu_branch`: "doorbell" (default: a stream write the native poller thread answers, a stream wait for its
answer) or "hostfunc" (a cuLaunchHostFunc host node, on a side stream of its own, since it blocks
its stream while the task runs); FREETOKEN_CPU_BRANCH overrides the default. docs/benchmarks.md
has the measurement behind the default. While steps run, the native pool's idle workers spin for
CPU_BRANCH_SPIN_US between calls rather than sleeping after 100 us (a sleeping worker's wake-up
costs tens of microseconds, every layer).

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

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from engine.errors import ConfigError
from engine.gpu import load_guard
from engine.gpu.cache_table import CacheTable
from engine.gpu.host_fn import clear, device_address, launch_host_task, ring, wait_done
from engine.gpu.plan import plan_layer
from engine.gpu.slots import ExpertSlots
from engine.graphs import GraphCache
from engine.model.ops import env_switch
from engine.weights.layout import ExpertBanks

CPU_BRANCHES = ("doorbell", "hostfunc")
FETCHES = ("kernel", "dma")
DMA_WORDS = ("host", "stream")  # how the host-issued fetch releases the GPU's wait (dma_fetch.h)
CPU_BRANCH_SPIN_US = 2000  # native pool workers' idle spin while a GPU step drives them
PLANS = ("torch", "fused")


def resolve_plan(name: str | None) -> str:
    """`name`, else FREETOKEN_PLAN, else "fused"; ConfigError for an unknown one."""
    plan = name or os.environ.get("FREETOKEN_PLAN", "fused")
    if plan not in PLANS:
        raise ConfigError(f"unknown cache plan {plan!r} (known: {', '.join(PLANS)})")
    return plan


def resolve_cpu_branch(name: str | None) -> str:
    """`name`, else FREETOKEN_CPU_BRANCH, else "doorbell"; ConfigError for an unknown one."""
    branch = name or os.environ.get("FREETOKEN_CPU_BRANCH", "doorbell")
    if branch not in CPU_BRANCHES:
        raise ConfigError(f"unknown CPU branch hand-off {branch!r} (known: {', '.join(CPU_BRANCHES)})")
    return branch


def resolve_fetch(name: str | None, cpu_branch: str | None = None) -> str:
    """`name`, else FREETOKEN_FETCH, else "dma" with the doorbell CPU branch (its poller issues the
    copies) and "kernel" with host nodes (`cpu_branch`, else `resolve_cpu_branch(None)`); ConfigError
    for an unknown one. The host-issued fetch is
    the default since the eighth GPU session (docs/gpu-tier.md): 6 % faster than the fetch kernel
    in every same-call A/B."""
    branch = cpu_branch or resolve_cpu_branch(None)
    fetch = name or os.environ.get("FREETOKEN_FETCH") or ("dma" if branch == "doorbell" else "kernel")
    if fetch not in FETCHES:
        raise ConfigError(f"unknown expert fetch {fetch!r} (known: {', '.join(FETCHES)})")
    return fetch


def resolve_dma_word(name: str | None = None) -> str:
    """`name`, else FREETOKEN_DMA_WORD, else "host"; ConfigError for an unknown one."""
    word = name or os.environ.get("FREETOKEN_DMA_WORD", "host")
    if word not in DMA_WORDS:
        raise ConfigError(f"unknown FREETOKEN_DMA_WORD {word!r} (known: {', '.join(DMA_WORDS)})")
    return word


@dataclass(frozen=True)
class StepParts:
    """What the decode steps share with their expert cache (which owns every part)."""

    banks: ExpertBanks
    slots: ExpertSlots
    table: CacheTable
    cpu_experts: Any  # the native executor's weights (native/formats.py ExpertWeights): the host tasks run them
    counts: torch.Tensor  # [4] int64 on the device: hits, misses, fetched, split
    ratio: torch.Tensor  # [1] float64 on the device: the fetch ratio the plans read (rewritten between steps)
    split: tuple[int, int] | None  # the split expert's (units, rows per unit), or None
    adapt: bool  # the ratio adapts online: the doorbell gets the GPU's "my branch is done" word
    dma_word: str  # how the host-issued fetch releases the GPU's wait: "host" / "stream"


class DeviceStep:
    def __init__(self, parts: StepParts, tokens: int, k: int, dtype: torch.dtype, graphs: bool = True,
                 pool: tuple[int, int] | None = None, cpu_branch: str | None = None, plan: str | None = None,
                 fetch: str | None = None) -> None:
        from engine.gpu import kernels  # Triton: imported only where a GPU runs the step
        from native.ftnative import set_worker_spin_us, worker_spin_us

        # the CPU branch is called every few hundred microseconds (one MoE layer's GPU work apart):
        # keep the native workers spinning across that gap instead of waking them from sleep
        set_worker_spin_us(max(worker_spin_us(), CPU_BRANCH_SPIN_US))

        self._kernels = kernels

        self.ex = parts
        self.tokens = tokens
        dev = parts.table.device
        banks = parts.banks
        hidden = banks.w2.shape[1]
        self.k = k
        self.x = torch.zeros(tokens, hidden, dtype=dtype, device=dev)
        self.ids = torch.zeros(tokens, k, dtype=torch.int64, device=dev)
        self.w = torch.zeros(tokens, k, dtype=dtype, device=dev)
        self.out = torch.zeros(tokens, hidden, dtype=dtype, device=dev)
        self.x_h = torch.zeros(tokens, hidden, dtype=dtype, pin_memory=True)
        self.ids_h = torch.zeros(tokens, k, dtype=torch.int64, pin_memory=True)
        self.w_h = torch.zeros(tokens, k, dtype=torch.float32, pin_memory=True)
        self.out_h = torch.zeros(tokens, hidden, dtype=dtype, pin_memory=True)
        self.cpu_branch = resolve_cpu_branch(cpu_branch)
        # a host node blocks its stream while the task runs: "hostfunc" gets a stream of its own
        self.side = torch.cuda.Stream(device=dev) if self.cpu_branch == "hostfunc" else None
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
        self.fetch = resolve_fetch(fetch, self.cpu_branch)
        self.copy_stream: torch.cuda.Stream | None = None
        self._fetched: dict[int, tuple[torch.Tensor, int]] = {}
        if self.fetch == "dma":  # the executor has checked that the branch is the doorbell
            from engine.gpu.host_fn import current_context

            self.copy_stream = torch.cuda.Stream(device=dev)
            # shared by the layers like the other staging buffers: the poller has read a layer's
            # list before it answers, and the next layer's hand-off waits for that answer
            # then the split expert's entry (flat id, rows) when the executor splits one
            self.copy_h = torch.full((2 * self.copies + (2 if self._split is not None else 0),), -1, dtype=torch.int64,
                                     pin_memory=True)
            self._context = current_context()
        self._tasks: dict[int, object] = {}
        self._settled: set[int] = set()  # layers whose first (eager) run is done: their kernels are loaded
        # device steps make the device wait for the host: from now on every Triton load in the
        # process waits for the device first (a load behind such a wait can deadlock)
        load_guard.install()
        # FREETOKEN_SETTLE_FIRST_RUN=0 only to show on the GPU what the settle prevents (overlap_probe)
        self._settle_first = env_switch("FREETOKEN_SETTLE_FIRST_RUN", True)
        self._failures_seen: dict[int, int] = {}  # per layer: the task failures check() has reported
        self._doorbells: dict[int, tuple[torch.Tensor, int]] = {}
        self._graphs = GraphCache(f"MoE step ({tokens} tokens), layer", enabled=graphs, pool=pool)
        # the split expert (with the host-issued fetch only): the plan's steps and the scratch slot
        # (-2 without: never a slot id, nor the -1 that marks a CPU entry)
        self._scratch = parts.slots.scratch if self._split is not None else -2
        assert self._split is None or (self.fetch == "dma" and self._scratch >= 0)

    def _task(self, layer: int) -> object:
        task = self._tasks.get(layer)
        if task is None:
            from native.ftnative import HostTask

            task = HostTask(self.x_h, self.ids_h, self.w_h, self.ex.cpu_experts, self.out_h,
                            id_offset=layer * self.ex.banks.num_experts)
            if self.fetch == "dma":
                assert self.copy_stream is not None
                ex = self.ex
                fetched = torch.zeros(1, dtype=torch.int32, pin_memory=True)
                address = device_address(fetched)
                task.serve_fetch(self.copy_h, ex.banks.w13, ex.banks.w2, ex.slots.w13, ex.slots.w2,
                                 self.copy_stream.cuda_stream, self._context, fetched, address,
                                 host_word=ex.dma_word == "host", scratch=self._scratch)
                self._fetched[layer] = (fetched, address)
            if self.cpu_branch == "doorbell":
                # a third word when the ratio adapts: the GPU's "my branch is done" (adapt.py)
                words = torch.zeros(3 if self.ex.adapt else 2, dtype=torch.int32, pin_memory=True)
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
        # host side: the likely cause of the eleventh GPU session's "host-issued copies did not
        # land within 5000 ms" at a batch's first pass after it shrank 3 -> 2 (confirmed in the
        # twelfth: the overlap probe hangs without this settle and finishes with it). So in a first
        # run each wait for the host is waited out before the next kernel is launched; captured and
        # later runs are untouched.
        first = self._settle_first and layer not in self._settled and not torch.cuda.is_current_stream_capturing()

        def settle() -> None:
            if first:
                main.synchronize()

        if self._fused is not None:
            # the device scalar: its online correction (FREETOKEN_ADAPT_RATIO) applies to captured
            # steps too
            plan = self._fused.plan_layer_fused(ex.table, layer, ids, ex.ratio, ex.counts, self._split,
                                                self._scratch)
        else:
            plan = plan_layer(ex.table, layer, ids, self._ratio, self._split, self._scratch)
            ex.counts.add_(plan.counts())
        task = self._task(layer)
        kernels = self._kernels
        # the CPU's inputs leave before the fetch starts (PCIe reads would delay them), written into
        # the page-locked buffers by one kernel
        dma = self.fetch == "dma"
        # with dma the copy list goes to the host with the CPU's inputs
        copy_list = (plan.copy_src[:self.copies], plan.copy_dst[:self.copies], self.copy_h) if dma else ()
        kernels.hand_off(x, ids, plan.slot_ids, w, self.x_h, self.ids_h, self.w_h, *copy_list, split=plan.split,
                         scratch=self._scratch)
        if self.cpu_branch == "doorbell":
            # everything on one stream: the ring follows the hand-off (its write fences the
            # kernel's), and the wait for the answer comes after all of the layer's GPU work
            ring(main, self._doorbells[layer][1])
        else:
            assert self.side is not None
            self.side.wait_stream(main)
            launch_host_task(task, self.side)
        side_out: list[torch.Tensor] = []
        if dma:
            # the entries already in slots run while the copies fly, then the side work; the
            # fetched entries once the copier's word says the copies have landed
            word = self._fetched[layer][1]

            def between() -> None:
                if side_work is not None:
                    side_out.append(side_work())
                wait_done(main, word)
                settle()

            rows = kernels.expert_rows(x, plan.slot_ids, w, ex.slots.w13, ex.slots.w2, plan.copy_dst[:self.copies],
                                       between, plan.split, self._scratch)
        else:
            kernels.fetch_experts(plan.copy_src[:self.copies], plan.copy_dst[:self.copies], ex.banks.w13,
                                  ex.banks.w2, ex.slots.w13, ex.slots.w2)
            rows = kernels.expert_rows(x, plan.slot_ids, w, ex.slots.w13, ex.slots.w2)
            if side_work is not None:  # before the wait for the CPU's answer, not after it
                side_out.append(side_work())
        if self.cpu_branch == "doorbell":
            words = self._doorbells[layer][1]
            if ex.adapt:  # ready = 1 while this stream waits for the CPU's answer
                ring(main, words + 8)
            wait_done(main, words + 4)
            if ex.adapt:
                clear(main, words + 8)
        else:
            assert self.side is not None
            main.wait_stream(self.side)
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
        host-issued copies (fetch="dma"), else after the GPU's rows, before the wait for the CPU."""
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
        runs: a host node, the poller thread): its CPU experts left zeros, or its fetch left slots
        with stale rows."""
        for layer, task in self._tasks.items():
            runs, failures, error = task.status()  # type: ignore[attr-defined]
            if failures > self._failures_seen.get(layer, 0):
                self._failures_seen[layer] = failures
                raise RuntimeError(f"MoE layer {layer}'s CPU branch failed {failures} of {runs} runs: {error}")

    @property
    def captured(self) -> int:
        return self._graphs.captured
