"""Overlapped decode: the next pass is queued before this pass's tokens are read.

Contract: `DecodePipeline(decoder, kv, states, device, width)`, owned by a `Scheduler` (and holding
no reference back to it), serves `Scheduler.step()` in steady decode: every running request
decoding one token per pass through a captured decode graph (engine/model/decode_graph.py), at most
`width` of them, none waiting to be admitted, none with a constraint, forced ids or
captured logits. `may_start(running, entries)` says whether the serial step may hand its pass over
(and loads, once per width while nothing is in flight, the staging kernels: a first launch may
load a module, which can wait for a device that waits for the host; for the same reason the first
real pass of each width and sampling mix runs settled, `_settle_once`, and Triton loads wait for
the device: engine/gpu/load_guard.py).
`start(reqs, hidden)` queues the LM head and every row's draw on the device (engine/sampling.py
`queue_draw`: the serial draw, the generator's number taken now) and a kernel that writes the
tokens into page-locked memory, then an event; nothing waits. `advance(running, admitting)` queues
the next pass when it may (`_next_graph`): its token ids are the previous draws, still on the
device; its positions and new KV slots are read from page-locked memory by a kernel that also
gives the KV table one slot per row in place (engine/model/decode_staging.py). Then it waits for
the oldest pass's event only and returns its draws (`Completed`), which the scheduler turns into
tokens. So the host's work between passes (building the step, the launches, reading, emitting,
the stop checks) runs while the GPU computes the next pass, instead of in a gap between two
passes. `complete_oldest()` waits for and returns the oldest pass without queueing more.

What may happen while a pass is in flight is restricted (`Scheduler` and this module keep to it):
no read of device memory into pageable memory and no pageable copy to the device (either would
wait for the queued pass while holding a driver lock the host-issued expert fetch needs:
evals/gpu/dma_hang_probe.py), so KV slots come from the free list on the host and every request's
new slots wait in `Request.kv_tail` until the pipeline drains; no finish, checkpoint, eviction or
admission. A token that ends its request (a stop id, the length) or is a decode anchor arrives
while the next pass, which feeds it, is in flight: the request finishes (or checkpoints) once that
pass is done, with that token's KV and state computed (the scheduler's extra step for a decode
anchor), and nothing more is queued until then. A failed draw (NaN logits) ends its request with
the sampler's error and without caching its state (the next pass fed a token that is not in its
output). A failure the executor reports after a pass (`check`) comes back as the `Completed`
pass's `error`, with nothing left in flight.

Off CUDA the same logic runs synchronously (no page-locked memory, no events; the pass builds the
batch the eager attention core walks): how the CPU tests compare it with the serial scheduler.
Off by default (experimental): the option overlap_decode (`--overlap-decode`,
`FREETOKEN_OVERLAP_DECODE=1`) turns it on. The twelfth GPU session found it hanging on both real
shapes: the staging kernel met a new Triton specialisation while a pass was in flight and its
module load waited for a device that waited for the host-issued copies. Fixed since (one
specialisation, engine/gpu/load_guard.py for any other load, a settled first pass per top-k's k);
the thirteenth session ran it on both real-shape benchmarks (no hang, +12 % tok/s) and through the
GPU equality tests one request at a time. It stays opt-in until the concurrent GPU test with it on
(width changes under overlap) has run.
The option overlap_width (default 1) bounds the sequences of an overlapped pass: single-sequence
decode ran overlapped in the capped engine tests (eleventh GPU session) and three requests at width
4 in evals/gpu/overlap_probe.py (twelfth, once the first-run settle had cured the 3 -> 2 width
change); wider passes stay opt-in until the GPU tests have run them. The CPU tests run wider ones.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from types import ModuleType

import torch

from engine.cache.pools import KVPool, StatePool
from engine.errors import EngineError
from engine.model.batch import ForwardBatch, SeqEntry
from engine.model.decode_graph import DecodeGraphs
from engine.model.decoder import Decoder
from engine.request import Phase, Request
from engine.sampling import queue_draw

log = logging.getLogger("freetoken.engine")


def servable(req: Request) -> bool:
    """A request whose passes the pipeline may run: decoding, its token drawn on the device."""
    return (req.phase is Phase.DECODE and req.constraint is None and req.forced is None and not req.capture_logits
            and req.pending_anchor is None and req.finish_pending is None and not req.handle.aborted)


@dataclass
class _Pass:
    """One queued pass: its sequences in row order, the draws on the device (the next pass's token
    ids) and their host copy, valid once `done` has fired."""

    reqs: list[Request]
    next_ids: torch.Tensor  # [n] long, device
    host: torch.Tensor  # [n, 2] float64 (index, valid), page-locked on CUDA
    done: torch.cuda.Event | None


@dataclass
class Completed:
    """A pass whose draws have been read: its requests in row order and each row's [index, valid]
    (engine/sampling.py `read_draw`), or the executor's error that ended the pass. `drained`:
    nothing is in flight behind it (a finish may happen now; otherwise it waits for the next pass)."""

    reqs: list[Request]
    draws: list[list[float]]
    drained: bool
    error: EngineError | None = None


class DecodePipeline:
    def __init__(self, decoder: Decoder, kv: KVPool, states: StatePool, device: torch.device, width: int = 1) -> None:
        self.decoder, self.kv, self.states = decoder, kv, states
        self.device = device
        self.width = width
        self.cuda = self.device.type == "cuda"
        self._kernels: ModuleType | None = None  # engine/model/decode_staging.py, on CUDA (triton)
        if self.cuda:
            # (a Triton load while a pass waits for the host waits for the device first: the load
            # guard the device steps install, engine/gpu/load_guard.py)
            from engine.model import decode_staging

            self._kernels = decode_staging
        self.inflight: deque[_Pass] = deque()
        self.drain_requested = False  # the engine wants a point with nothing in flight (a device read)
        # per width, two page-locked buffers each for the staged inputs and the draws, used in turn:
        # a pass's buffers are rewritten two passes later, after its event (made while nothing is in
        # flight: allocating page-locked memory may wait for the device)
        self._buffers: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        self._flip = 0
        self.staged_by_width: dict[int, int] = {}  # passes queued from the previous pass's draws, per width
        self._warmed: set[int] = set()  # widths whose staging kernels are loaded
        # (stage, width, sampling kinds) whose real launches have run once with nothing in flight
        self._settled: set[tuple[str, int, tuple[tuple[bool, int, bool], ...]]] = set()

    @property
    def staged(self) -> int:
        """Passes queued from the previous pass's draws, all widths."""
        return sum(self.staged_by_width.values())

    # ------------------------------------------------------------------ eligibility
    def graph_for(self, n: int) -> DecodeGraphs | None:
        """The decode graph that would run an n-sequence pass, when it is ready to replay staged
        inputs (captured on CUDA; run once off CUDA)."""
        g = self.decoder.graphs.get(n)
        return g if g is not None and g.replayable(self.kv, self.states) else None

    def may_start(self, running: list[Request], entries: list[tuple[Request, list[int]]]) -> bool:
        """The serial step about to run (`entries` of the `running` requests) may hand its draws to
        the pipeline instead of reading them (then its page-locked buffers exist: made here, while
        nothing is in flight)."""
        n = len(entries)
        if (self.inflight or self.drain_requested or n != len(running) or n > self.width
                or not all(len(toks) == 1 and servable(req) for req, toks in entries) or self.graph_for(n) is None):
            return False
        if n not in self._buffers:  # now, before the pass is queued
            pin = self.cuda
            self._buffers[n] = ([torch.zeros(2, n, dtype=torch.long, pin_memory=pin) for _ in range(2)],
                                [torch.zeros(n, 2, dtype=torch.float64, pin_memory=pin) for _ in range(2)])
        try:
            self._warm(n)
        except Exception as exc:  # e.g. a staging kernel that does not compile: serial, as a failed capture
            log.warning("overlapped decode turned off: preparing a %d-sequence pass failed: %s", n, exc)
            self.width = 0
            return False
        return True

    def _warm(self, n: int) -> None:
        """Compiles and launches, once per width and while nothing is in flight, the kernels a
        staged pass adds that the real passes' settled first runs (`_settle_once`) do not launch
        before a pass is in flight: the staging kernels (a compile failure here turns the pipeline
        off) and the online fetch ratio's rewrite (CachedExpertExecutor.check, after each completed
        pass); then waits. A kernel's first launch may load its module, and loading can wait for a
        device that waits for the host-issued fetch (engine/gpu/device_step.py `_enqueue`)."""
        if n in self._warmed or self._kernels is None:
            return
        with torch.inference_mode():
            ids = torch.zeros(n, dtype=torch.long, device=self.device)
            scratch = [torch.zeros(n, dtype=torch.long, device=self.device) for _ in range(3)]
            table = torch.zeros(n, 1, dtype=torch.int32, device=self.device)
            lengths = torch.zeros(n, dtype=torch.int32, device=self.device)
            host_in, host_out = self._buffers[n][0][0], self._buffers[n][1][0]
            host_in.zero_()  # positions 0: the scratch table has one column
            self._kernels.stage_pass(host_in, ids, *scratch, lengths, table)
            self._kernels.publish_draws(torch.zeros(n, 2, dtype=torch.float64, device=self.device), host_out, ids)
            torch.empty((), dtype=torch.float64, device=self.device).fill_(0.5)
            torch.cuda.current_stream(self.device).synchronize()
        self._warmed.add(n)

    def _next_graph(self, running: list[Request], admitting: bool) -> DecodeGraphs | None:
        """The graph of the pass after the newest one in flight, when that pass may be queued."""
        last = self.inflight[-1]
        if len(self.inflight) > 1 or self.drain_requested or running != last.reqs:
            return None
        if admitting:
            return None  # admit first
        n = len(last.reqs)
        g = self.graph_for(n)
        if g is None or self.kv.num_free < n:
            return None  # a longer rotary table, another pool or eviction: the serial step does those
        for req in last.reqs:
            if not servable(req):
                return None
            # the token in flight ends the request by length: no pass after it
            made = len(req.output) + 1
            if made >= req.params.max_tokens or len(req.prompt) + made >= req.max_len:
                return None
            if _next_position(req) >= g.limit:
                return None
        return g

    # ------------------------------------------------------------------ queueing
    def start(self, reqs: list[Request], hidden: torch.Tensor) -> None:
        """After a pass the serial step built and queued (`may_start` said yes) for `reqs`, in row
        order: its draws, queued, not read."""
        self._settle_once("start", reqs)
        self._queue_draws(reqs, hidden)

    def _settle_once(self, stage: str, reqs: list[Request]) -> None:
        """Called before a stage's launches: the first time it runs for a width and sampling mix,
        they wait for the device first, so whatever they load for the first time (the draws' torch
        kernels, which torch picks by width and sampling kind, top-k's k included; CUDA loads modules
        lazily) loads behind nothing that waits for the host. In "next" the replay, which waits for
        the host, comes after the staging kernel and before the draws, whose kernels "start" has
        loaded already. Later passes run as they are."""
        key = (stage, *_mix(reqs))
        if key not in self._settled:
            if self.cuda:
                torch.cuda.current_stream(self.device).synchronize()
            self._settled.add(key)

    @torch.inference_mode()
    def _queue_draws(self, reqs: list[Request], hidden: torch.Tensor) -> None:
        draws = _draws(self.decoder.logits(hidden), reqs, [r.generator for r in reqs])
        self._flip ^= 1
        host = self._buffers[len(reqs)][1][self._flip]
        done = None
        if self._kernels is not None:
            next_ids = torch.empty(len(reqs), dtype=torch.long, device=draws.device)
            self._kernels.publish_draws(draws, host, next_ids)  # a kernel, not a copy (see decode_staging)
            done = torch.cuda.Event()
            done.record()
        else:
            host.copy_(draws)
            next_ids = draws[:, 0].long()
        self.inflight.append(_Pass(reqs, next_ids, host, done))

    @torch.inference_mode()
    def _queue_next(self, g: DecodeGraphs) -> None:
        """The pass after the newest one in flight (`g`, from `_next_graph`), for the same
        sequences, fed its draws."""
        last = self.inflight[-1]
        reqs, n = last.reqs, len(last.reqs)
        slots = self.kv.take(n)
        assert slots is not None  # _next_graph saw room
        positions = [_next_position(req) for req in reqs]
        for req, slot in zip(reqs, slots, strict=True):
            req.kv_tail.append(slot)
        staged = self._stage(positions, slots)
        batch = None if self.cuda else _eager_batch(reqs)
        self._settle_once("next", reqs)
        hidden = g.forward_staged(last.next_ids, staged, batch)
        self._queue_draws(reqs, hidden)
        self.staged_by_width[n] = self.staged_by_width.get(n, 0) + 1

    def _stage(self, positions: list[int], slots: list[int]) -> torch.Tensor:
        """[positions, slots] in one of two page-locked buffers per width (the other may still be read
        by the pass before: each is rewritten only after a later pass's event)."""
        buf = self._buffers[len(slots)][0][self._flip ^ 1]  # the buffers of the pass this one queues
        buf.copy_(torch.tensor([positions, slots], dtype=torch.long))  # host to host
        return buf  # on CUDA read by the pass's staging kernel through its device mapping

    # ------------------------------------------------------------------ completing
    def advance(self, running: list[Request], admitting: bool) -> Completed:
        """One scheduler step while a pass is in flight: queue the next one when allowed (the same
        `running` requests, none `admitting`), then complete the oldest."""
        g = self._next_graph(running, admitting)
        if g is not None:
            self._queue_next(g)
        return self.complete_oldest()

    def abandon(self) -> None:
        """After an unexpected failure: waits for the device, forgets what was in flight (its tokens
        unread) and moves every pending KV slot into its request, so the requests can be released."""
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()
        reqs = {id(r): r for p in self.inflight for r in p.reqs}
        self.inflight.clear()
        for req in reqs.values():
            _flush(req)

    def complete_oldest(self) -> Completed:
        """Waits for the oldest pass in flight and returns its draws."""
        p = self.inflight.popleft()
        if p.done is not None:
            p.done.synchronize()
        drained = not self.inflight
        if drained:
            self.drain_requested = False
            for req in p.reqs:
                _flush(req)
        try:
            self.decoder.executor.check(len(p.reqs), wait=False)
        except EngineError as err:
            self.abandon()
            return Completed(p.reqs, [], True, err)
        return Completed(p.reqs, p.host.tolist(), drained)


def _mix(reqs: list[Request]) -> tuple[int, tuple[tuple[bool, int, bool], ...]]:
    """A pass's width and the sampling kinds of its rows: what decides the kernels it launches."""
    return len(reqs), tuple(sorted({_kind(r) for r in reqs}))


def _kind(req: Request) -> tuple[bool, int, bool]:
    """What a request's draw launches: greedy, or sampled with top-k (its k: torch's top-k picks its
    kernels by k and the row length) and / or top-p filtering."""
    p = req.params
    return p.greedy, 0 if p.greedy else p.top_k, not p.greedy and p.top_p < 1.0


def _draws(logits: torch.Tensor, reqs: list[Request], generators: list[torch.Generator | None]) -> torch.Tensor:
    """[n, 2] float64 on logits' device: each row's (token, valid) as the serial sampler would draw
    it (engine/sampling.py `queue_draw`; the argmax of the step's logits for a greedy row)."""
    greedy = logits.argmax(dim=-1) if any(r.params.greedy for r in reqs) else None
    rows = []
    for row, (req, gen) in enumerate(zip(reqs, generators, strict=True)):
        if req.params.greedy:
            assert greedy is not None
            rows.append(torch.stack([greedy[row].double(), greedy.new_ones((), dtype=torch.float64)]))
        else:
            rows.append(queue_draw(logits[row], req.params, gen))
    return torch.stack(rows)


def _next_position(req: Request) -> int:
    """Where the request's next fed token goes: one past every token with a KV slot."""
    assert req.kv_slots is not None
    return req.kv_slots.shape[0] + len(req.kv_tail)


def _flush(req: Request) -> None:
    if req.kv_tail and req.kv_slots is not None:
        tail = torch.tensor(req.kv_tail, dtype=torch.long, device=req.kv_slots.device)
        req.kv_slots = torch.cat([req.kv_slots, tail])
    req.kv_tail.clear()


def _eager_batch(reqs: list[Request]) -> ForwardBatch:
    """Off CUDA: the batch of a staged pass (the eager attention core walks every sequence's slots)."""
    seqs = []
    for row, req in enumerate(reqs):
        assert req.kv_slots is not None
        slots = torch.cat([req.kv_slots, torch.tensor(req.kv_tail, dtype=torch.long)])
        seqs.append(SeqEntry(row, 1, slots.shape[0] - 1, slots, req.state_slot))
    ids = torch.zeros(len(reqs), dtype=torch.long)  # unused: the pass reads the staged ids
    return ForwardBatch(ids, torch.tensor([s.cached_len for s in seqs]), seqs)
