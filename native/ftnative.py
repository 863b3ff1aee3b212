"""Checked Python front end of the native CPU expert executor (`native._ftnative`).

Contract: `moe_layer(x, ids, weights, experts, out=None)` computes, for T tokens each routed to k
experts (flat rows of the bank `experts`, an `ExpertWeights` of any format),
out[t] = sum_j weights[t, j] * down(silu(gate(x[t])) * up(x[t])) with float32 accumulation.
The extension takes raw addresses, so every argument is checked here first (a bad pointer in C++
is a crash, not an exception); the bank's layout was checked when its `ExpertWeights` was made.
Wrong inputs raise ValueError. The GIL is released during the call; calls from several Python
threads are serialized by the pool. `read_ranges` is the plain-read bandwidth reference and
`call_overhead_us` the fixed cost of one call.

Settings are set by calls, never read from the environment (the engine's options do that once,
engine/options.py): `set_isa(name)` forces a SIMD path, `set_num_threads(n)` sizes the pool
(default: one per physical core), `set_prefetch_bytes(n)` the software prefetch distance. Import
raises ImportError, saying how to build, when the extension is missing.
"""

from __future__ import annotations

import atexit
import os
import sys
from typing import Any

import torch

from native.formats import ExpertWeights

ISAS = ("avx512bf16", "avx512", "avx2", "scalar")


def _load() -> Any:
    try:
        from native import _ftnative  # type: ignore[attr-defined]
    except ImportError as exc:
        raise ImportError(
            f"the native expert executor is not built ({exc}). Reinstall with a C++17 compiler present "
            f"(`pip install -e .`), or build it in place: `{os.path.basename(sys.executable)} native/build.py`"
        ) from exc
    return _ftnative


_ext = _load()
atexit.register(_ext.shutdown)
atexit.register(_ext.poll_stop)  # runs first (atexit is last-in, first-out)


def supported_isas() -> list[str]:
    return list(_ext.supported_isas())


def get_isa() -> str:
    return _ext.get_isa()


def set_isa(name: str) -> None:
    """Force a SIMD path ('auto' = best available); ValueError if unknown or unsupported here."""
    _ext.set_isa(name)


def set_prefetch_bytes(n: int) -> None:
    """The software prefetch distance on each weight row, in bytes (0 = off; default 1024)."""
    _ext.set_prefetch_bytes(int(n))


def prefetch_bytes() -> int:
    return _ext.prefetch_bytes()


def set_chunk_rows(n: int) -> None:
    """Rows of the work chunk a pool thread takes at a time (a multiple of 4 in [4, 4096]; default
    16): a benchmark knob (evals/native/chunk_probe.py), not an engine option."""
    _ext.set_chunk_rows(int(n))


def chunk_rows() -> int:
    return _ext.chunk_rows()


def set_num_threads(n: int, pin: bool = True) -> None:
    """Restart the pool with n threads (0 = one per physical core), pinned one per core if `pin`."""
    _ext.set_num_threads(int(n), bool(pin))


def num_threads() -> int:
    return _ext.num_threads()


def set_worker_spin_us(us: int) -> None:
    """How long idle pool workers spin before they sleep (process-wide; default 100 us). Longer
    saves the wake-up of sleeping workers when calls come every few hundred microseconds, at the
    price of busy cores between calls."""
    if isinstance(us, bool) or not isinstance(us, int) or not 0 <= us <= 1_000_000:
        _fail(f"worker spin must be an int of microseconds in [0, 1000000], got {us!r}")
    _ext.set_worker_spin_us(us)


def worker_spin_us() -> int:
    return _ext.worker_spin_us()


def num_pinned() -> int:
    return _ext.num_pinned()


def physical_cores() -> int:
    return _ext.physical_cores()


def shutdown() -> None:
    _ext.shutdown()


def call_overhead_us(reps: int = 2000) -> float:
    """Median time of a minimal layer call (1 token, 32x32 expert) on the current pool, in us."""
    return float(_ext.call_overhead_us(reps))


def _fail(msg: str) -> None:
    raise ValueError(msg)


def _check_rows(name: str, t: Any, shape: tuple[int, ...] | None, dtypes: tuple[torch.dtype, ...]) -> None:
    """A CPU tensor of one of `dtypes`, [rows, cols] with contiguous rows (the checks cost ~1 us)."""
    if not isinstance(t, torch.Tensor):
        _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_cpu:
        _fail(f"{name} must be on the CPU, got {t.device}")
    if t.dtype not in dtypes:
        _fail(f"{name} must be {' or '.join(map(str, dtypes))}, got {t.dtype}")
    if t.dim() != 2 or (shape is not None and t.shape != shape):
        _fail(f"{name} must have shape {shape or '[rows, cols]'}, got {tuple(t.shape)}")
    if t.stride(1) != 1 and t.shape[1] > 1:
        _fail(f"{name} rows must be contiguous (stride(1) == 1), got strides {t.stride()}")


_ACT = (torch.bfloat16, torch.float32)


def moe_layer(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    experts: ExpertWeights,
    out: torch.Tensor | None = None,
    id_offset: int = 0,
    skip_negative: bool = False,
    split: tuple[int, int] | None = None,
) -> torch.Tensor:
    """See the module docstring. x, out: [T, H] bf16/float32 with contiguous rows (any row stride);
    ids: [T, k] int64 contiguous, bank row = id + id_offset; weights: [T, k] float32 contiguous;
    out is overwritten. With `skip_negative`, entries whose id is < 0 are left out (computed
    elsewhere: the GPU's share of a split layer) and cost no weight reads. `split` = (bank row,
    first): that expert's intermediate rows [first, I) only (bf16 / f32 weights; `first` a multiple
    of 16 in (0, I)), the split expert whose other rows run on the GPU."""
    if type(experts) is not ExpertWeights:
        _fail(f"experts must be a native.formats.ExpertWeights, got {type(experts).__name__}")
    _check_rows("x", x, None, _ACT)
    t_count, hidden = x.shape
    if hidden != experts.hidden:
        _fail(f"x must be [T, {experts.hidden}], got shape {tuple(x.shape)}")
    _check_rows("ids", ids, None, (torch.int64,))
    if ids.shape[0] != t_count or ids.shape[1] == 0:
        _fail(f"ids must be [T={t_count}, k>0], got shape {tuple(ids.shape)}")
    _check_rows("weights", weights, ids.shape, (torch.float32,))
    if not (ids.is_contiguous() and weights.is_contiguous()):
        _fail("ids and weights must be contiguous")
    if out is None:
        out = torch.empty((t_count, hidden), dtype=x.dtype)
    else:
        _check_rows("out", out, x.shape, _ACT)
    if t_count:
        pair = None if split is None else torch.tensor(split, dtype=torch.int64)
        _ext.moe_layer(*_layer_args(x, out, ids, weights, experts), id_offset, skip_negative,
                       0 if pair is None else pair.data_ptr())
    return out


def _layer_args(x: torch.Tensor, out: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                experts: ExpertWeights) -> tuple[Any, ...]:
    return (x.data_ptr(), x.dtype == torch.bfloat16, x.stride(0), out.data_ptr(), out.dtype == torch.bfloat16,
            out.stride(0), x.shape[0], x.shape[1], experts.inter, ids.data_ptr(), weights.data_ptr(), ids.shape[1],
            *experts.native_args)


class HostTask:
    """One MoE layer call with fixed buffers, run later by `run()` or by the native poller thread
    when its doorbell rings (`serve_doorbell`): the CPU branch of a graph-captured decode step.
    The buffers are checked here once and must stay alive and in place as long as the task (the
    task keeps references to them); ids < 0 are skipped. A failure inside the poller cannot raise:
    it zeroes `out`, and `check()` raises it afterwards."""

    def __init__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: ExpertWeights,
                 out: torch.Tensor, id_offset: int = 0) -> None:
        if type(experts) is not ExpertWeights:
            _fail(f"experts must be a native.formats.ExpertWeights, got {type(experts).__name__}")
        _check_rows("x", x, None, _ACT)
        if x.shape[1] != experts.hidden or x.shape[0] == 0:
            _fail(f"x must be [T>0, {experts.hidden}], got shape {tuple(x.shape)}")
        _check_rows("ids", ids, None, (torch.int64,))
        if ids.shape[0] != x.shape[0] or ids.shape[1] == 0 or not ids.is_contiguous():
            _fail(f"ids must be contiguous [T={x.shape[0]}, k>0], got shape {tuple(ids.shape)}")
        _check_rows("weights", weights, ids.shape, (torch.float32,))
        if not weights.is_contiguous():
            _fail("weights must be contiguous")
        _check_rows("out", out, x.shape, _ACT)
        self._buffers = (x, ids, weights, out, experts)
        self._words: torch.Tensor | None = None
        self._fetch_buffers: tuple[torch.Tensor, ...] | None = None
        self.address: int = _ext.host_task_create(*_layer_args(x, out, ids, weights, experts), id_offset, True)

    def run(self) -> None:
        _ext.host_task_run(self.address)

    def serve_doorbell(self, words: torch.Tensor) -> None:
        """Has the native poller thread run this task whenever words[0] becomes nonzero (it clears
        it, runs, then sets words[1] = 1): the doorbell a captured graph rings with a stream write
        and waits on with a stream wait (native/src/poller.h). `words`: 2 int32, page-locked; or 3,
        words[2] the GPU's ready word (1 while the GPU waits for this answer), and each run counts
        which branch finished last (`poll_lateness`)."""
        if not (isinstance(words, torch.Tensor) and words.dtype == torch.int32 and words.numel() in (2, 3)
                and words.is_contiguous() and words.is_pinned()):
            _fail("words must be a contiguous page-locked int32 tensor of 2 or 3 elements")
        if self._words is not None:
            _fail("this task already serves a doorbell")
        words.zero_()
        ready = words.data_ptr() + 8 if words.numel() == 3 else 0
        _ext.poll_register(self.address, words.data_ptr(), words.data_ptr() + 4, ready)
        self._words = words

    def serve_fetch(self, copy: torch.Tensor, banks_w13: torch.Tensor, banks_w2: torch.Tensor,
                    slots_w13: torch.Tensor, slots_w2: torch.Tensor, stream: int, context: int,
                    word: torch.Tensor, deadline_ms: int = 5000, scratch: int = -1) -> None:
        """Before each run from the doorbell, the poller has this layer's fetches issued (native/src/
        dma_fetch.h): for every i with copy[i] >= 0 (n = copy.numel() // 2), bank row copy[i] of both
        banks into slot copy[n + i] of both slot tensors, as host-to-device copies on `stream` (a
        CUstream of `context`); then `word` = 1, from the host once the stream has drained. Copies
        that have not landed after `deadline_ms` fail the task and release the GPU's wait (the
        step's check raises) instead of holding the step for good.
        Banks: page-locked host tensors [rows, ...]; slots: CUDA tensors [slots, ...] of the same row
        shape and dtype; copy and word page-locked (int64, int32). Call before `serve_doorbell`.
        With `scratch` >= 0 (a slot index past the table's, bf16 / f32 weights) the copy list is
        followed by the split expert's entry, copy[2n] = bank row (-1: none) and copy[2n + 1] = r
        (2n + 2 elements in all): its first r intermediate rows go into slot `scratch` with the
        fetch, and this task's runs compute its rows [r, I) (native/src/dma_fetch.h)."""
        if deadline_ms <= 0:
            _fail(f"deadline_ms must be positive, got {deadline_ms}")
        if self._words is not None:
            _fail("serve_fetch must come before serve_doorbell (the poller reads the fetch unlocked)")
        extra = 2 if scratch >= 0 else 0
        if not (copy.dtype == torch.int64 and copy.is_contiguous() and copy.is_pinned() and copy.numel() % 2 == 0
                and copy.numel() > extra):
            _fail(f"copy must be a contiguous page-locked int64 tensor of 2n + {extra} > {extra} elements")
        if not (word.dtype == torch.int32 and word.numel() == 1 and word.is_pinned()):
            _fail("word must be one page-locked int32")
        for bank, slot, name in ((banks_w13, slots_w13, "w13"), (banks_w2, slots_w2, "w2")):
            if bank.device.type != "cpu" or not bank.is_contiguous() or not slot.is_contiguous() or not slot.is_cuda:
                _fail(f"{name}: banks must be contiguous host tensors and slots contiguous CUDA tensors")
            if bank.shape[1:] != slot.shape[1:] or bank.dtype != slot.dtype:
                _fail(f"{name}: bank rows {tuple(bank.shape[1:])} {bank.dtype} and slots "
                      f"{tuple(slot.shape[1:])} {slot.dtype} differ")
        if banks_w13.shape[0] != banks_w2.shape[0] or slots_w13.shape[0] != slots_w2.shape[0]:
            _fail("the two banks (and the two slot tensors) must have as many rows")
        slot_rows = slots_w13.shape[0]
        if scratch >= 0:
            if banks_w13.dtype not in (torch.bfloat16, torch.float32) or not 0 <= scratch < slot_rows:
                _fail(f"a split expert needs bf16 / f32 banks and a scratch slot in [0, {slot_rows}), got "
                      f"{banks_w13.dtype}, {scratch}")
            slot_rows = scratch  # the table's slots come before it: a copy-list entry may not name it
        row_bytes = [t[0].numel() * t.element_size() for t in (banks_w13, banks_w2)]
        _ext.host_task_set_fetch(self.address, copy.data_ptr(), (copy.numel() - extra) // 2, banks_w13.data_ptr(),
                                 banks_w2.data_ptr(), slots_w13.data_ptr(), slots_w2.data_ptr(), row_bytes[0],
                                 row_bytes[1], banks_w13.shape[0], slot_rows, stream, context,
                                 word.data_ptr(), deadline_ms, scratch, banks_w2.shape[2],
                                 banks_w2.shape[1], banks_w13.element_size(), 0, 0, 0, 0, 0, 0, 0)
        self._fetch_buffers = (copy, banks_w13, banks_w2, slots_w13, slots_w2, word)

    def serve_packed_fetch(self, copy: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                           gscale: torch.Tensor | None, row_offset: int, slots: torch.Tensor,
                           down_offset: int, slot_gscale: torch.Tensor, stream: int, context: int,
                           word: torch.Tensor, deadline_ms: int = 5000, bias: torch.Tensor | None = None,
                           slot_bias: torch.Tensor | None = None) -> None:
        """`serve_fetch` for packed experts (engine/gpu/quant/slots.py): copy-list entry r >= 0 copies
        bank expert r - row_offset of one layer's page-locked `gate_up` [E, 2I, rb] and `down`
        [E, H, rb'] (uint8) into slot copy[n + i] of `slots` ([S, stride] uint8 on the GPU: gate_up
        bytes first, down bytes `down_offset` later), and with `gscale` ([E, 3] float32, page-locked)
        the expert's global scales into `slot_gscale` [S, 3]; with `bias` ([E, W] float32, page-locked,
        this layer's rows) its biases into `slot_bias` [S, W]. No split expert."""
        if deadline_ms <= 0:
            _fail(f"deadline_ms must be positive, got {deadline_ms}")
        if self._words is not None:
            _fail("serve_packed_fetch must come before serve_doorbell (the poller reads the fetch unlocked)")
        if not (copy.dtype == torch.int64 and copy.is_contiguous() and copy.is_pinned() and copy.numel() % 2 == 0
                and copy.numel() > 0):
            _fail("copy must be a contiguous page-locked int64 tensor of 2n > 0 elements")
        if not (word.dtype == torch.int32 and word.numel() == 1 and word.is_pinned()):
            _fail("word must be one page-locked int32")
        for name, bank in (("gate_up", gate_up), ("down", down)):
            if bank.dtype != torch.uint8 or bank.device.type != "cpu" or not bank.is_contiguous() or bank.dim() != 3:
                _fail(f"{name}: expected a contiguous host uint8 [E, rows, row_bytes] bank")
        if gate_up.shape[0] != down.shape[0]:
            _fail("gate_up and down must hold as many experts")
        if not (slots.dtype == torch.uint8 and slots.dim() == 2 and slots.is_cuda and slots.stride(1) == 1):
            _fail("slots must be a row-contiguous CUDA uint8 [S, stride]")
        gu_bytes, d_bytes = gate_up[0].numel(), down[0].numel()
        if down_offset < gu_bytes or down_offset + d_bytes > slots.shape[1]:
            _fail(f"an expert of {gu_bytes} + {d_bytes} bytes (down at {down_offset}) does not fit "
                  f"slots of {slots.shape[1]} bytes")
        gs_bank = gs_slot = 0
        if gscale is not None:
            if not (gscale.dtype == torch.float32 and gscale.is_contiguous() and tuple(gscale.shape) ==
                    (gate_up.shape[0], 3) and slot_gscale.is_cuda and slot_gscale.is_contiguous()
                    and tuple(slot_gscale.shape) == (slots.shape[0], 3)):
                _fail("gscale must be a contiguous float32 [E, 3] bank and slot_gscale [S, 3] on the GPU")
            gs_bank, gs_slot = gscale.data_ptr(), slot_gscale.data_ptr()
        bias_bank = bias_slot = bias_bytes = 0
        if bias is not None:
            if not (slot_bias is not None and bias.dtype == slot_bias.dtype == torch.float32 and bias.is_contiguous()
                    and slot_bias.is_contiguous() and slot_bias.is_cuda and bias.dim() == slot_bias.dim() == 2
                    and bias.shape[0] == gate_up.shape[0] and bias.shape[1] == slot_bias.shape[1]
                    and slot_bias.shape[0] == slots.shape[0]):
                _fail("bias must be a contiguous float32 [E, W] bank and slot_bias [S, W] on the GPU")
            assert slot_bias is not None
            bias_bank, bias_slot, bias_bytes = bias.data_ptr(), slot_bias.data_ptr(), bias.shape[1] * 4
        _ext.host_task_set_fetch(self.address, copy.data_ptr(), copy.numel() // 2, gate_up.data_ptr(),
                                 down.data_ptr(), slots.data_ptr(), slots.data_ptr() + down_offset, gu_bytes,
                                 d_bytes, gate_up.shape[0], slots.shape[0], stream, context, word.data_ptr(),
                                 deadline_ms, -1, 0, 0, 0, row_offset, slots.stride(0), gs_bank, gs_slot,
                                 bias_bank, bias_slot, bias_bytes)
        self._fetch_buffers = (copy, gate_up, down, slots, slot_gscale, word,
                               *(t for t in (gscale, bias, slot_bias) if t is not None))

    def fetch(self) -> None:
        """The task's fetch issued in this thread, as the poller does before each run (a test hook)."""
        _ext.host_task_fetch(self.address)

    def status(self) -> tuple[int, int, str]:
        """(runs, failures, first error message)."""
        return _ext.host_task_status(self.address)

    def check(self) -> None:
        runs, failures, error = self.status()
        if failures:
            raise RuntimeError(f"native host task failed {failures} of {runs} runs: {error}")

    def __del__(self) -> None:
        address = getattr(self, "address", 0)
        if address and _ext is not None:
            if getattr(self, "_words", None) is not None:
                _ext.poll_unregister(address)
            _ext.host_task_free(address)
            self.address = 0


def poll_served() -> int:
    """Tasks the doorbell poller has run so far (all tasks)."""
    return _ext.poll_served()


def poll_copier_state() -> tuple[bool, bool, bool]:
    """(up, pending, copying): the copier thread runs (until it does, the poller issues fetches
    itself), a host-issued fetch was handed to it and not yet taken, and it is inside one
    (native/src/poller.h); a diagnostic for a step that waits for its copies."""
    up, pending, copying = _ext.poll_copier_state()
    return bool(up), bool(pending), bool(copying)


TIMELINE_FIELDS = ("served", "cpu_ns", "gaps", "gap_ns", "fetches", "fetch_ns", "fetch_late")


def poll_timeline() -> dict[str, int]:
    """Sums since start (take deltas): `served` doorbell requests and `cpu_ns`, the poller's time from
    seeing each doorbell to writing its answer (the CPU branch, the hand-off to the copier included);
    `gaps` / `gap_ns`, the intervals from an answer to the next registered task's doorbell (a decode
    step's layer l to l + 1: the GPU's part alone); `fetches` host-issued fetches, `fetch_ns` from
    their doorbell until the copier was done (with the host-written word: the copies landed) and
    `fetch_late` those done after the poller's answer (native/src/poller.h)."""
    return dict(zip(TIMELINE_FIELDS, (int(v) for v in _ext.poll_timeline()), strict=True))


def poll_lateness() -> tuple[int, int]:
    """(CPU-late, GPU-late): doorbell runs so far whose CPU branch finished after the GPU's own branch
    of the layer, and before it; counted for tasks that serve a 3-word doorbell."""
    cpu, gpu = _ext.poll_lateness()
    return int(cpu), int(gpu)


def host_task_failures() -> int:
    """Failed HostTask runs and fetches so far (every task): unchanged means nothing new to report."""
    return int(_ext.host_task_failures())


def host_task_busy_ns() -> int:
    """Nanoseconds spent inside HostTask runs so far (every task, both hand-offs)."""
    return int(_ext.host_task_busy_ns())


def read_ranges(ranges: list[tuple[int, int]]) -> int:
    """Reads every (address, bytes) range with the pool's threads; returns an XOR checksum.
    Addresses must come from live CPU tensors (e.g. `ExpertWeights.expert_ranges`)."""
    return _ext.read_ranges([int(p) for p, _ in ranges], [int(n) for _, n in ranges])


def read_tensor(t: torch.Tensor) -> int:
    """Reads all of a contiguous CPU tensor's bytes with the pool's threads."""
    if not isinstance(t, torch.Tensor) or not t.is_cpu or not t.is_contiguous():
        _fail("t must be a contiguous CPU tensor")
    return read_ranges([(t.data_ptr(), t.numel() * t.element_size())])
