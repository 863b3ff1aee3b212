"""Streamed prefill: a large prompt chunk's MoE layers run entirely from the GPU slot pool, each
layer's non-resident experts streamed over PCIe into a double buffer taken from that pool while
the previous layer computes.

When a chunk has many tokens the routing is dense (nearly every expert of every layer is used),
so the decode path's per-layer planning (engine/gpu/plan.py: split the misses between PCIe and the
CPU) is the wrong tool: the CPU would run hundreds of tokens per expert. Instead every expert of a
layer is on the GPU when the layer runs: the resident ones in place, the others copied in.

Contract: `PrefillStreamer(banks, slots, table, copy_stream, kernel=None)` (copy_stream: a CUDA
stream other than the compute stream, or None: copies on the current stream, which is what a CPU
device uses; the results are the same; kernel: how `layer` computes the experts, "grouped" where
Triton runs, the loop elsewhere; "loop" asks for the loop anyway (the reference the tests hold the
grouped kernels to); any other value is a ConfigError). `PrefillStreamer.fits(slots, experts)`: whether the pool has
the 2E slots the two buffers need (E = experts per layer); when it does not, use the decode path.
- `start(first_moe_index=0)` (optional; `layer` calls it on first use): takes 2E slots from the
  pool with `table.reserve` (the least recently used, empty first; their experts leave the
  cache), and with them every other empty slot (the spare slots), snapshots which experts are
  resident (one device->host read of the whole table), and issues the copies of the first MoE
  layer. Streamed experts, layer by layer from the first, are copied into the spare slots while
  they last (the rest into the buffers), so they stay cached: the next chunk and the decode that
  follows find them; the working set in the other slots is never touched. Buffer b (0, 1) is
  reserved slots [b*E, (b+1)*E) in ascending order; expert e of a layer held in buffer b lives in
  its e-th slot.
- `layer(x, ids, weights, moe_index, next_moe_index)` -> [N, H] in x's dtype and device: the
  routed experts of MoE layer `moe_index` (ids/weights [N, k]). Experts resident in the cache are
  read in place from their slot; every other expert of the layer (all of them, routed or not: no
  waiting for routing) is copied into buffer `moe_index % 2` (or its spare slot). Before this layer computes, the
  copies of `next_moe_index` (when given, and of the other parity) are issued on the copy stream,
  so PCIe streams the next layer while this one's experts (and the next layer's attention) run.
  The experts are computed by one of two kernels:
  - "loop": TorchExpertExecutor's arithmetic (engine/moe/executor.py), operation
    for operation: distinct experts in ascending id, gate/up F.linear, silu * up, down F.linear,
    times the weight, index_add_: the result is bit-identical to it. A Python loop over the
    routed experts (about 8 kernel launches each) after a host read of the routing.
  - "grouped" (1.7x the loop's rate on an 8192-token chunk, docs/benchmarks.md: the one GPU path
    since; on CUDA, or on any device under Triton's interpreter; on a CPU pool otherwise the loop
    runs):
    engine/gpu/grouped.py, two Triton GEMM kernels over the entries sorted by expert,
    each expert read from its slot through a [L, E] device tensor of slots made in `start`: no
    host read, no loop over experts. Every intermediate is rounded where the reference rounds it
    except the sum of a token's k contributions (float32, rounded once, instead of a running sum
    in x's dtype): float32 results equal the reference's up to summation order, bf16 ones are
    within a few bf16 roundings. Its workspace (silu(gate) * up of N*k + E*(BLOCK_M - 1) padded
    rows and the N*k weighted contributions, in x's dtype) is in engine/gpu/budget.py's estimate
    when it is selected. The LRU updates and stats are the loop's (the stats' per-layer counts
    accumulate on the device).
- `finish()`: after the chunk's last MoE layer. The compute stream waits for every copy issued;
  the streamed experts in spare slots and those of the (at most two) layers held in the buffers
  become resident (`table.register`, last_use = a fresh step: the freshest entries), the other
  reserved slots are released empty. The cache outside the reserved slots is untouched, so the
  decode that follows finds its working set plus the kept experts. Always call it (try/finally):
  until then the reserved slots stay reserved. The streamer can be started again for the next chunk.
- `stats` (`PrefillStats`): chunks, layers, experts used in place, streamed, streamed but not
  routed, registered by finish(), bytes streamed (with "grouped", reading it syncs: the in-place
  and unused counts are device counters).

LRU bookkeeping: each `layer` call advances `table.step` by one, like a planned decode call, and the
resident experts it routed get last_use = that step (the hits of the decode path).

Ordering (CUDA, with a copy stream), with two events per buffer, no host wait on copies:
- the copies into buffer b wait (on the copy stream) for `freed[b]`, recorded on the compute stream
  after the last compute that read buffer b; at `start` both are recorded right after the
  reservation, so the first copies also wait for every decode kernel already queued that read or
  wrote the reserved slots;
- the compute of a layer waits (on the compute stream) for `loaded[b]`, recorded on the copy stream
  after that layer's copies.
Copies are one `copy_(non_blocking=True)` per (bank tensor, expert row) from the page-locked host
banks (engine/gpu/setup.py registers them in place), each a single DMA, as ExpertSlots.apply_copies.

Host synchronisation (the costs of this version):
- per chunk, in `start`: `table.reserve` reads slot_owner and last_use (S * 16 bytes) and the
  streamer reads the table (L * E * 4 bytes, e.g. 96 KiB for 48 layers x 512 experts): two small
  device->host reads, each waiting for the compute stream's queued work (at the start of a forward,
  normally little); the residency snapshot is valid for the whole chunk because nothing else
  plans against the table until `finish`. `finish` sends its index lists without a sync.
- per layer with "loop", one device->host read of the routed experts and their token counts
  (<= 2k int64 values), the same read TorchExpertExecutor makes: the per-expert loop needs them on
  the host. It comes after the next layer's copies are issued and before the compute waits for
  this layer's copies, so it waits for the routing (and the work queued before it), never for a
  copy. With "grouped", none: `start` also sends the slot of every expert of every layer ([L, E]
  int64) and which are streamed ([L, E] bool) to the device (no wait), and `layer` only queues
  work (the sort by expert before the wait for the copies, the two kernels after), so the host
  can run ahead of the device by several layers.
grouped_slot_experts (engine/gpu/executor.py) computes the same sum but its host reads would come
after the wait for the copies (it sorts by slot id on the device), so it is not used here.

Do not call plan_layer (the decode path) on the same table between `start` and `finish`: the
residency snapshot would go stale, and plan_layer caps its fetches by S - hits, counting reserved
slots as available, so a call with more misses than unreserved slots would take a reserved slot.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from engine.errors import ConfigError
from engine.gpu.cache_table import CacheTable
from engine.gpu.quant.pool import PackedPool
from engine.gpu.slots import ExpertSlots, SlotPool
from engine.options import triton_interpreted
from engine.weights.layout import ExpertBanks

PREFILL_KERNELS = ("loop", "grouped")


@dataclass
class PrefillStats:
    chunks: int = 0  # start() calls
    layers: int = 0  # layer() calls
    in_place: int = 0  # routed experts read from their cache slot (no copy)
    streamed: int = 0  # experts copied into a buffer
    streamed_unused: int = 0  # of those, experts of a computed layer that no token was routed to
    registered: int = 0  # streamed experts finish() left resident
    bytes_streamed: int = 0

    @property
    def in_place_rate(self) -> float:
        """Fraction of the experts a layer needed on the GPU that were already there."""
        seen = self.in_place + self.streamed - self.streamed_unused
        return self.in_place / seen if seen else 0.0


class PrefillStreamer:
    def __init__(self, banks: ExpertBanks, slots: SlotPool, table: CacheTable,
                 copy_stream: torch.cuda.Stream | None = None, kernel: str | None = None) -> None:
        table.check_matches(banks, slots)
        if copy_stream is not None and slots.device.type != "cuda":
            raise ValueError(f"a copy stream needs CUDA slots, the pool is on {slots.device}")
        if kernel is not None and kernel not in PREFILL_KERNELS:
            raise ConfigError(f"unknown prefill kernel {kernel!r} (valid: {', '.join(PREFILL_KERNELS)})")
        # the Triton kernels run on CUDA, or on any device under Triton's interpreter (CPU tests)
        triton_here = slots.device.type == "cuda" or triton_interpreted()
        self.grouped = kernel != "loop" and triton_here
        self.kernel = "grouped" if self.grouped else "loop"
        self._kernels: ModuleType | None = None
        self._counts: torch.Tensor | None = None  # grouped: [in_place, streamed_unused] on the device
        if self.grouped:
            try:
                from engine.gpu import grouped  # Triton: imported only where the grouped path runs
            except ImportError as e:
                raise ConfigError(f"the grouped prefill kernel needs triton: {e}") from e
            self._kernels = grouped
            self._counts = torch.zeros(2, dtype=torch.int64, device=slots.device)
        self.banks, self.slots, self.table = banks, slots, table
        self.copy_stream = copy_stream
        self.experts = banks.num_experts
        self._stats = PrefillStats()
        self._active = False
        self._buffers: list[list[int]] = []  # [2][E]: slot of expert e in buffer b
        self._spare: list[int] = []  # reserved empty slots beyond the buffers (kept experts)
        self._issued: set[int] = set()  # layers whose copies were issued
        self._buffer_layer: list[int | None] = [None, None]  # layer whose experts buffer b holds
        self._slot_of: list[list[int]] = []  # [L][E]: host, the slot each expert runs from
        self._missing: list[list[int]] = []  # [L]: experts not resident (streamed), ascending
        self._resident_row: torch.Tensor | None = None  # [L, E] int64 on the device: slot or trash
        self._slot_dev: torch.Tensor | None = None  # grouped: [L, E] int64 on the device, _slot_of
        self._missing_dev: torch.Tensor | None = None  # grouped: [L, E] bool on the device, _missing
        self._loaded: list[torch.cuda.Event | None] = [None, None]
        self._freed: list[torch.cuda.Event | None] = [None, None]

    @staticmethod
    def fits(slots: SlotPool | int, experts: int) -> bool:
        """Whether a pool of `slots` can hold the two full-layer buffers (2 * experts slots)."""
        n = slots if isinstance(slots, int) else slots.slots
        return n >= 2 * experts

    @property
    def active(self) -> bool:
        """True between start() (or the first layer()) and finish(): 2E slots are reserved."""
        return self._active

    @property
    def stats(self) -> PrefillStats:
        """Counts so far (with the grouped kernel, reads its device counters: a host sync)."""
        stats = PrefillStats(**vars(self._stats))
        if self._counts is not None:
            in_place, unused = self._counts.tolist()
            stats.in_place += in_place
            stats.streamed_unused += unused
        return stats

    def start(self, first_moe_index: int | None = 0) -> None:
        """Reserves the buffers and issues the copies of `first_moe_index` (None: none yet).
        Calling it before the forward's first layers lets those copies overlap the embedding and
        the first attention. A no-op reservation when already active."""
        if not self._active:
            E, table = self.experts, self.table
            if not self.fits(self.slots, E):
                raise ValueError(f"streamed prefill needs {2 * E} slots, the pool has {self.slots.slots}")
            # the empty slots beyond the buffers' 2E keep streamed experts (earliest layers first);
            # when there are more empty slots than 2E, all of the reserved ones are empty
            reserved = table.reserve(2 * E, every_empty=True)
            self._buffers = [reserved[:E], reserved[E:2 * E]]
            self._spare = reserved[2 * E:]
            free = iter(self._spare)
            snap = table.table.cpu()  # [L, E] int32, after the reservation's evictions
            self._slot_of, self._missing, self._issued = [], [], set()
            for layer, row in enumerate(snap.tolist()):
                buf = self._buffers[layer % 2]
                missing = [e for e, s in enumerate(row) if s < 0]
                slot_of = [s if s >= 0 else buf[e] for e, s in enumerate(row)]
                for e, slot in zip(missing, free, strict=False):  # until the spare slots run out
                    slot_of[e] = slot
                self._slot_of.append(slot_of)
                self._missing.append(missing)
            rows = torch.where(snap >= 0, snap, table.trash_slot).to(torch.int64)
            self._resident_row = self._to_device(rows)
            if self.grouped:
                self._slot_dev = self._to_device(torch.tensor(self._slot_of, dtype=torch.int64))
                self._missing_dev = self._to_device(snap < 0)
            self._buffer_layer = [None, None]
            self._loaded = [None, None]
            if self.copy_stream is not None:
                # the first copies wait for all decode work queued so far on the reserved slots
                ev = torch.cuda.current_stream(self.slots.device).record_event()
                self._freed = [ev, ev]
            self._active = True
            self._stats.chunks += 1
        if first_moe_index is not None:
            self._check_layer(first_moe_index)
            if self._buffer_layer[first_moe_index % 2] != first_moe_index:
                self._load(first_moe_index)

    def layer(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, moe_index: int,
              next_moe_index: int | None = None) -> torch.Tensor:
        self._check_layer(moe_index)
        self.start(None)
        b = moe_index % 2
        if self._buffer_layer[b] != moe_index:
            self._load(moe_index)
        if next_moe_index is not None:
            self._check_layer(next_moe_index)
            nb = next_moe_index % 2
            # a next layer of the same parity would overwrite this layer's buffer: it is loaded
            # on its own call instead
            if nb != b and self._buffer_layer[nb] != next_moe_index:
                self._load(next_moe_index)

        dev = self.slots.device
        xd, idd, wd = x.to(dev), ids.to(dev), weights.to(dev)
        if self.grouped:
            return self._layer_grouped(xd, idd, wd, moe_index).to(x.device)
        flat_ids = idd.reshape(-1)
        # TorchExpertExecutor's grouping, step for step
        order = torch.argsort(flat_ids, stable=True)
        experts_t, counts_t = torch.unique_consecutive(flat_ids[order], return_counts=True)
        token_of = order // idd.shape[1]
        flat_w = wd.reshape(-1)[order]
        # LRU: one step per layer call; the resident experts routed here are used now (no sync)
        table = self.table
        assert self._resident_row is not None
        table.step.add_(1)
        routed = torch.zeros(self.experts, dtype=torch.bool, device=dev).index_fill_(0, experts_t.to(torch.int64), True)
        hit_slot = torch.where(routed, self._resident_row[moe_index], table.trash_slot)
        table.last_use_flat[hit_slot] = table.step.expand(self.experts)
        # the one host read of the layer: which experts, how many tokens each (waits for the
        # routing, not for the copies: the compute stream has not been told to wait for them yet)
        n = experts_t.numel()
        host = torch.cat([experts_t.to(torch.int64), counts_t]).tolist()
        experts, counts = host[:n], host[n:]
        missing = self._missing[moe_index]
        n_streamed_used = len(set(experts).intersection(missing))
        self._stats.layers += 1
        self._stats.in_place += n - n_streamed_used
        self._stats.streamed_unused += len(missing) - n_streamed_used

        stream = self._compute_stream()
        if stream is not None:
            loaded = self._loaded[b]
            assert loaded is not None
            stream.wait_event(loaded)
        pool = self.slots
        packed = isinstance(pool, PackedPool)  # dequantized slots, float32 products (the packed executor's)
        out = torch.zeros(xd.shape, dtype=torch.float32 if packed else xd.dtype, device=dev)
        slot_of = self._slot_of[moe_index]
        start = 0
        for expert, count in zip(experts, counts, strict=True):
            slot = slot_of[expert]
            rows = token_of[start:start + count]
            y = pool.forward(slot, moe_index, xd[rows]) * flat_w[start:start + count, None]
            out.index_add_(0, rows, y.to(out.dtype))
            start += count
        if stream is not None:
            self._freed[b] = stream.record_event()
        return out.to(x.device, x.dtype)

    def _layer_grouped(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                       moe_index: int) -> torch.Tensor:
        """layer() through the grouped kernels (engine/gpu/grouped.py): no host read."""
        assert self._resident_row is not None and self._slot_dev is not None and self._missing_dev is not None
        assert self._kernels is not None and self._counts is not None
        b = moe_index % 2
        table, E = self.table, self.experts
        slot_of = self._slot_dev[moe_index]
        layout = self._kernels.group_entries(ids, slot_of)  # queued before the wait for the copies
        flat_ids = ids.reshape(-1).to(torch.int64)
        routed = torch.zeros(E, dtype=torch.bool, device=ids.device).index_fill_(0, flat_ids, True)
        # LRU as in the loop path: one step per call, the resident experts routed here used now
        table.step.add_(1)
        hit_slot = torch.where(routed, self._resident_row[moe_index], table.trash_slot)
        table.last_use_flat[hit_slot] = table.step.expand(E)
        missing = self._missing_dev[moe_index]
        self._counts += torch.stack([(routed & ~missing).sum(), (missing & ~routed).sum()])
        self._stats.layers += 1
        stream = self._compute_stream()
        if stream is not None:
            loaded = self._loaded[b]
            assert loaded is not None
            stream.wait_event(loaded)
        pool = self.slots
        if isinstance(pool, PackedPool):
            out = pool.kernels[moe_index].grouped_experts(x, ids, weights, slot_of, layout=layout)
        else:
            assert isinstance(pool, ExpertSlots)
            out = self._kernels.grouped_experts(x, ids, weights, slot_of, pool.w13, pool.w2, layout)
        if stream is not None:
            self._freed[b] = stream.record_event()
        return out

    def finish(self) -> None:
        """Registers the buffers' streamed experts as resident and releases the rest (see the
        module docstring); a no-op when not active."""
        if not self._active:
            return
        stream = self._compute_stream()
        if stream is not None:
            for ev in self._loaded:
                if ev is not None:
                    stream.wait_event(ev)
        E = self.experts
        keep_slots: list[int] = []
        keep_flat: list[int] = []
        for layer in sorted(self._issued):
            b = layer % 2
            for e in self._missing[layer]:
                slot = self._slot_of[layer][e]
                # spare slots always stay; a buffer's slots only for the layer it holds now
                if slot != self._buffers[b][e] or self._buffer_layer[b] == layer:
                    keep_slots.append(slot)
                    keep_flat.append(layer * E + e)
        kept = set(keep_slots)
        self.table.step.add_(1)  # registered experts are strictly the freshest
        self.table.register(keep_slots, keep_flat)
        self.table.release([s for s in (*self._buffers[0], *self._buffers[1], *self._spare) if s not in kept])
        self._stats.registered += len(keep_slots)
        self._active = False
        self._buffers, self._slot_of, self._missing = [], [], []
        self._spare, self._issued = [], set()
        self._buffer_layer = [None, None]
        self._resident_row = None
        self._slot_dev = self._missing_dev = None
        self._loaded = [None, None]
        self._freed = [None, None]

    # ---------------------------------------------------------------- internals
    def _load(self, layer: int) -> None:
        """Issues the copies of `layer`'s non-resident experts into buffer layer % 2 (or, for the
        experts given spare slots, into those)."""
        b = layer % 2
        slot_of = self._slot_of[layer]
        missing = self._missing[layer]
        base = layer * self.experts
        banks = self.banks
        if self.copy_stream is None:
            self._copy(missing, slot_of, base)
        else:
            freed = self._freed[b]
            assert freed is not None
            self.copy_stream.wait_event(freed)
            with torch.cuda.stream(self.copy_stream):
                self._copy(missing, slot_of, base)
            self._loaded[b] = self.copy_stream.record_event()
        self._buffer_layer[b] = layer
        self._issued.add(layer)
        self._stats.streamed += len(missing)
        self._stats.bytes_streamed += len(missing) * banks.expert_bytes

    def _copy(self, experts: list[int], slot_of: list[int], base: int) -> None:
        """Bank experts base + e into slot_of[e], one DMA per tensor, on the current stream."""
        pool, banks = self.slots, self.banks
        if isinstance(pool, PackedPool):
            for e in experts:
                pool.copy_expert(slot_of[e], base + e)
            return
        assert isinstance(pool, ExpertSlots)
        for e in experts:
            pool.w13[slot_of[e]].copy_(banks.w13[base + e], non_blocking=True)
            pool.w2[slot_of[e]].copy_(banks.w2[base + e], non_blocking=True)

    def _compute_stream(self) -> torch.cuda.Stream | None:
        if self.copy_stream is None:
            return None
        return torch.cuda.current_stream(self.slots.device)

    def _check_layer(self, moe_index: int) -> None:
        if not 0 <= moe_index < self.table.layers:
            raise ValueError(f"MoE layer {moe_index} out of range [0, {self.table.layers})")

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        if self.slots.device.type == "cuda":
            return t.pin_memory().to(self.slots.device, non_blocking=True)
        return t.to(self.slots.device)
