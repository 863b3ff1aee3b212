"""Continuous batching: admission with prefix reuse, chunked prefill, batched decode, finishing.

Contract: `Scheduler.step()` advances every running request by one forward pass: each decoding
request contributes one token, prefilling requests contribute chunks up to `prefill_chunk` tokens in
total. Admission restores the longest reusable prefix from the radix cache (KV slots, and for
recurrent layers the deepest checkpoint at or before the first divergence, from the device or the
host tier) and prefills only the rest; `RequestHandle.reuse` says what was reused. Anchors inside a
prefill chunk are checkpointed within its pass (the recurrent layers write the state at each into a
free state slot, `SeqEntry.cuts`, one freed by spilling a device checkpoint the new one outranks to
the host tier when none is free; a chunk ends early only at an anchor no slot can be had for, and at every anchor on models with
sliding-window rings, whose rings a cut cannot keep), so anchors add no forward passes. A generated `DecodeAnchor` token is checkpointed after the next step has computed it
(one extra step, not reported, when the request ends on it). A finished request's computed tokens
(prompt + output) are inserted into the cache with its final recurrent state as a checkpoint of kind
"request_end", so the next request that extends it resumes there. Checkpoint slots and eviction:
engine/cache/checkpoints.py and engine/anchors.py. `forced_output` replaces sampled ids (after the
real logits were captured) and finishes with "stop" when exhausted. In steady decode through
captured graphs the passes run overlapped (engine/decode_pipeline.py: each queued before the
previous pass's tokens are read); a step then completes the oldest pass in flight, and a finish the
tokens call for waits for the pass already queued behind them (`accept(defer=True)`, `decoded`).
Only the engine thread calls this.
"""

from __future__ import annotations

from collections import deque

import torch

from engine.anchors import Anchor, DecodeAnchor, ReuseInfo, SnapshotMeta, decode_anchor_at
from engine.cache.checkpoints import CheckpointStore
from engine.cache.pools import HostStatePool, KVPool, StatePool
from engine.cache.radix import RadixCache
from engine.decode_pipeline import Completed, DecodePipeline
from engine.errors import CapacityError, EngineError
from engine.model.batch import ForwardBatch, SeqEntry
from engine.model.decoder import Decoder
from engine.options import EngineOptions
from engine.request import Phase, Request
from engine.sampling import read_draw, sample, sampling_failed


class Scheduler:
    def __init__(self, decoder: Decoder, opts: EngineOptions, dtype: torch.dtype) -> None:
        self.decoder, self.opts = decoder, opts
        cfg = decoder.cfg
        self.device = torch.device(opts.device)
        self.hybrid = cfg.is_hybrid
        # checkpoints inside a pass: the recurrent layers write the state at a cut; sliding-window
        # rings cannot (a chunk still ends at each anchor on models that have them)
        self.cuts_in_pass = not cfg.sliding_attention_layer_ids
        self.kv = KVPool(cfg, opts.kv_tokens, dtype, self.device)
        self.states = StatePool(cfg, opts.device_state_slots if self.hybrid else 0, dtype, self.device)
        self.host_states = HostStatePool(cfg, opts.host_checkpoint_slots if self.hybrid else 0, dtype, self.device)
        self.cache = RadixCache(self.kv.free, self.states.free, self.device, free_host=self.host_states.free)
        self.store = CheckpointStore(self.cache, self.states, self.host_states, opts.checkpoint_slots)
        self.eos = set(cfg.eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.prefill_passes = 0  # forward passes that computed prompt tokens, since the start
        # steady decode through captured graphs: the next pass queued before this one's tokens are read
        self.pipeline = (DecodePipeline(decoder, self.kv, self.states, self.device, opts.overlap_width)
                         if opts.overlap_decode else None)

    @property
    def in_flight(self) -> bool:
        """A pass is queued whose tokens are not read yet (engine/decode_pipeline.py): no device
        read into pageable memory until it is done."""
        return self.pipeline is not None and bool(self.pipeline.inflight)

    @property
    def staged_passes(self) -> int:
        """Passes queued before the previous pass's tokens were read, so far (0 without the overlap)."""
        return self.pipeline.staged if self.pipeline is not None else 0

    def drain(self) -> None:
        """Completes every pass in flight (before anything replaces what they use)."""
        pipeline = self.pipeline
        while pipeline is not None and pipeline.inflight:
            self._complete(pipeline.complete_oldest())

    def request_drain(self) -> None:
        """The next step completes what is in flight without queueing more."""
        if self.pipeline is not None:
            self.pipeline.drain_requested = True

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    # ------------------------------------------------------------------ admission
    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.opts.max_running:
            req = self.waiting[0]
            slot = -1
            if self.hybrid:
                # Taken before the match: making room may move a checkpoint to the host tier,
                # where the match below still finds it.
                got = self.store.working_slot(req.session)
                if got is None:
                    return  # wait for a running request to hand its state back
                slot = got
            self.waiting.popleft()
            self.store.activity.admit(req.session)
            match = self.cache.match(req.prompt, len(req.prompt) - 1, need_state=self.hybrid)
            self.cache.lock(match.node)
            req.match_node, req.prefix_len, req.computed = match.node, match.length, match.length
            req.owned = match.length
            req.anchors = [a for a in req.anchors if match.length < a.position <= len(req.prompt)]
            req.kv_slots = match.slots.clone()
            req.handle.cached_tokens = match.length
            from_host = False
            if self.hybrid:
                from_host = self.store.restore(match, slot)
                req.state_slot = slot
            meta = match.node.meta if self.hybrid and match.length else None
            req.handle.reuse = ReuseInfo(kv_tokens=match.length, state_position=match.length,
                                         checkpoint_kind=meta.kind if meta else None, from_host=from_host,
                                         recomputed_tokens=len(req.prompt) - match.length)
            if req.params.seed is not None:
                req.generator = torch.Generator().manual_seed(req.params.seed)
            elif not req.params.greedy:
                req.generator = torch.Generator()
                req.generator.seed()
            req.phase = Phase.PREFILL
            self.running.append(req)

    def _alloc_kv(self, n: int, requester: str | None) -> torch.Tensor:
        slots = self.kv.alloc(n)
        if slots is None:
            self.cache.evict(n - self.kv.num_free, self.store.kv_leaf_key(requester))
            slots = self.kv.alloc(n)
        if slots is None:
            raise CapacityError(f"KV cache full: {n} more tokens needed, {self.kv.num_free} free of {self.kv.capacity}")
        return slots

    # ------------------------------------------------------------------ step
    def step(self) -> None:
        pipeline = self.pipeline
        if pipeline is not None and pipeline.inflight:
            self._complete(pipeline.advance(self.running, self._admitting))
            return
        for req in [r for r in self.running if r.handle.aborted]:
            self._finish(req, "abort")
        if any(r.handle.aborted for r in self.waiting):
            for req in [r for r in self.waiting if r.handle.aborted]:
                self.waiting.remove(req)
                req.handle._finish("abort")
        self._admit()
        if not self.running:
            return
        entries: list[tuple[Request, list[int]]] = []
        cuts: dict[int, list[tuple[Anchor, int]]] = {}  # id(request): the checkpoints inside its chunk
        budget = self.opts.prefill_chunk
        for req in self.running:
            if req.phase is Phase.DECODE:
                entries.append((req, [req.output[-1]]))
        for req in self.running:
            if req.phase is Phase.PREFILL and budget > 0:
                end = min(req.computed + budget, len(req.prompt))
                end, cuts[id(req)] = self._cuts(req, end)
                chunk = req.prompt[req.computed:end]
                budget -= len(chunk)
                entries.append((req, chunk))
        batch_entries: list[SeqEntry] = []
        ids: list[int] = []
        pos: list[int] = []
        for req, toks in list(entries):
            try:
                new = self._alloc_kv(len(toks), req.session)
            except CapacityError as e:
                entries.remove((req, toks))
                self._free_cuts(cuts.pop(id(req), []))
                if req.finish_pending is not None:  # only the extra step for a decode anchor: skip it
                    self._finish(req, req.finish_pending)
                else:
                    self._finish(req, "error", e)
                continue
            assert req.kv_slots is not None
            req.kv_slots = torch.cat([req.kv_slots, new])
            inside = tuple((a.position - req.computed, slot) for a, slot in cuts.get(id(req), []) if slot >= 0)
            batch_entries.append(SeqEntry(len(ids), len(toks), req.computed, req.kv_slots, req.state_slot, inside))
            ids.extend(toks)
            pos.extend(range(req.computed, req.computed + len(toks)))
        if not entries:
            for held in cuts.values():
                self._free_cuts(held)
            return
        if any(req.phase is Phase.PREFILL for req, _ in entries):
            self.prefill_passes += 1
        batch = ForwardBatch(torch.tensor(ids, dtype=torch.long, device=self.device),
                             torch.tensor(pos, dtype=torch.long, device=self.device), batch_entries)
        overlap = pipeline is not None and pipeline.may_start(self.running, entries)
        try:
            hidden = self.decoder.forward(batch, self.kv, self.states)
            if overlap:
                assert pipeline is not None
                pipeline.start([req for req, _ in entries], hidden)
                self._complete(pipeline.advance(self.running, self._admitting))
                return
            # a decode batch (one token per sequence) needs no gather of the last tokens
            last = hidden if len(ids) == len(batch.seqs) else hidden[batch.last_token_index()]
            logits = self.decoder.logits(last)
            # every greedy pick of the step in one kernel, queued before the wait and read in one
            # transfer after it (a pick per row was a launch and a host read each)
            picks = logits.argmax(dim=-1) if any(_greedy(req) for req, _ in entries) else None
            # failures where nothing could raise (the CPU branch's host tasks)
            self.decoder.executor.check(len(ids))
            greedy_ids = picks.tolist() if picks is not None else None
        except Exception as e:  # a failed step must not take the engine down
            if pipeline is not None:
                pipeline.abandon()  # nothing may stay in flight while the requests are released
            err = e if isinstance(e, EngineError) else EngineError(f"forward pass failed: {type(e).__name__}: {e}")
            for held in cuts.values():
                self._free_cuts(held)
            for req, _ in entries:
                self._finish(req, "error", err, keep_cache=False)
            return
        # every cut's slot goes to the store before any request samples (its listener may look at
        # the slots: each is then free, a checkpoint or a request's working state)
        for req, _ in entries:
            for a, slot in cuts.pop(id(req), []):
                self._checkpoint(req, SnapshotMeta(a.kind, a.priority, req.session), a.position, slot)
        for row, (req, toks) in enumerate(entries):
            req.computed += len(toks)
            if req.phase is Phase.PREFILL:
                anchor = next((a for a in req.anchors if a.position == req.computed), None)
                if anchor is not None:
                    self._checkpoint(req, SnapshotMeta(anchor.kind, anchor.priority, req.session))
                if req.computed < len(req.prompt):
                    continue
            elif self.decoded(req):
                continue
            req.phase = Phase.DECODE
            self._sample(req, logits[row], greedy_ids[row] if greedy_ids is not None else None)

    @property
    def _admitting(self) -> bool:
        """A waiting request would be admitted at the next serial step."""
        return bool(self.waiting) and len(self.running) < self.opts.max_running

    def _complete(self, done: Completed) -> None:
        """A pass the pipeline completed: each request's draw becomes its token (a finish it calls
        for waits for the pass still in flight behind it, `defer`), or the pass's error ends them."""
        if done.error is not None:
            for req in done.reqs:
                self._finish(req, "error", done.error, keep_cache=False)
            return
        for req, (index, valid) in zip(done.reqs, done.draws, strict=True):
            req.computed += 1
            if not done.drained:
                assert req.pending_anchor is None and req.finish_pending is None, "queued past an ending"
            if self.decoded(req):
                continue
            try:
                token = read_draw([index, valid])
            except ValueError as e:
                self.end(req, "error", sampling_failed(e), defer=not done.drained, keep_cache=False)
                continue
            self.accept(req, token, defer=not done.drained)

    def decoded(self, req: Request) -> bool:
        """After a pass fed a decoding request its last token: the checkpoint a decode anchor asked
        for, and the finish held back for that pass; True when the request is finished."""
        if req.pending_anchor is not None:
            # The anchor token was fed this step: the state now includes it.
            da, req.pending_anchor = req.pending_anchor, None
            self._checkpoint(req, SnapshotMeta(da.kind, da.priority, req.session))
        if req.finish_pending is not None:
            # a held-back error: the pass fed a token that is not in the output, keep none of it
            self._finish(req, req.finish_pending, req.finish_error, keep_cache=req.finish_error is None)
            return True
        return False

    def _sample(self, req: Request, logits: torch.Tensor, pick: int | None = None) -> None:
        """`pick`: the row's argmax, computed with the step's (used for a greedy request without a
        constraint: what `sample` would return)."""
        forced = req.forced
        if forced is not None and len(req.output) >= len(forced):
            self._finish(req, "stop")  # an empty forced list: prefill only
            return
        if req.capture_logits:
            req.handle.logits.append(logits.detach().cpu().clone())
        try:
            if forced is not None:
                # Replay: the forward pass (and the captured logits) are real, the id is given.
                token = forced[len(req.output)]
            elif pick is not None and _greedy(req):
                token = pick
            else:
                token = sample(logits, req.params, req.generator, req.constraint)
        except Exception as e:  # a bad constraint must fail its request, not the engine
            self._finish(req, "error", sampling_failed(e))
            return
        self.accept(req, token)

    def accept(self, req: Request, token: int, defer: bool = False) -> None:
        """A request's next token: emitted, then the stop and length checks and decode anchors.
        `defer`: a pass that feeds it is already queued (engine/decode_pipeline.py), so a finish
        waits for that pass like a decode anchor's (`decoded`)."""
        req.output.append(token)
        req.handle._emit(token)
        p = req.params
        forced = req.forced
        reason = None
        if (token in p.stop_token_ids or (token in self.eos and not p.ignore_eos)
                or (forced is not None and len(req.output) >= len(forced))):
            reason = "stop"
        elif len(req.output) >= p.max_tokens or len(req.prompt) + len(req.output) >= req.max_len:
            reason = "length"
        anchor = self._decode_anchor(req, token)
        if anchor is not None:
            # Its state exists only once the next step feeds it; a finishing request runs that
            # step anyway (output already complete, its logits unreported) so the anchor is kept.
            req.pending_anchor, req.finish_pending = anchor, reason
        elif reason is not None:
            self.end(req, reason, defer=defer)

    def end(self, req: Request, reason: str, error: EngineError | None = None, defer: bool = False,
            keep_cache: bool = True) -> None:
        """Finishes the request now, or (`defer`) once the pass already queued for it is done; a
        deferred finish without `keep_cache` must carry its error."""
        if not defer:
            self._finish(req, reason, error, keep_cache)
            return
        assert keep_cache or error is not None
        req.finish_pending, req.finish_error = reason, error

    def _decode_anchor(self, req: Request, token: int) -> DecodeAnchor | None:
        anchor = decode_anchor_at(req.decode_anchors, req.output, req.decode_anchor_at)
        if anchor is not None:
            req.decode_anchor_at = len(req.output)
        return anchor

    def _cuts(self, req: Request, end: int) -> tuple[int, list[tuple[Anchor, int]]]:
        """The anchors strictly inside the chunk [computed, end), each with the state slot its
        checkpoint is written to inside the pass (-1 for models without per-sequence state, which
        only publish the prefix; with no free slot the store spills a device checkpoint the new one
        strictly outranks, `CheckpointStore.cut_slot`), and the chunk's end: it stops at the first anchor for which no state
        slot can be had, or at the first anchor on a model with sliding-window rings (its state
        is then the working state after the pass, as at `end`)."""
        out: list[tuple[Anchor, int]] = []
        for a in req.anchors:
            if a.position <= req.computed:
                continue
            if a.position >= end:
                break
            if not self.cuts_in_pass:
                return a.position, out
            slot = -1
            if self.hybrid:
                got = self.store.cut_slot(SnapshotMeta(a.kind, a.priority, req.session), a.position, req.session)
                if got is None:
                    return a.position, out
                slot = got
            out.append((a, slot))
        return end, out

    def _free_cuts(self, held: list[tuple[Anchor, int]]) -> None:
        for _, slot in held:
            if slot >= 0:
                self.states.free(slot)

    def _checkpoint(self, req: Request, meta: SnapshotMeta, at: int | None = None, slot: int = -1) -> None:
        """Publishes the computed prefix (prompt + output so far; the first `at` tokens when given)
        to the radix cache and keeps a checkpoint of the state after it when the policy finds room
        (skipped, never wrong): the working state, or the state a cut wrote to `slot` inside the
        pass (the slot then belongs to the store, kept as the checkpoint or freed)."""
        assert req.kv_slots is not None and req.match_node is not None
        n = req.computed if at is None else at
        node, existing = self.cache.insert(req.tokens[:n], req.kv_slots[:n])
        if existing > req.owned:
            # Another request cached these tokens first: use its slots, free our duplicates.
            self.kv.free(req.kv_slots[req.owned:existing])
            req.kv_slots = torch.cat([self.cache.path_slots(node), req.kv_slots[n:]])
        self.cache.lock(node)
        self.cache.unlock(req.match_node)
        req.match_node, req.owned = node, n
        if self.hybrid:
            if slot >= 0:
                self.store.save(node, slot, meta, req.session, donate=True)
            else:
                self.store.save(node, req.state_slot, meta, req.session, donate=False)

    def reset_cache(self) -> None:
        """Drops every cached prefix and checkpoint (both tiers); only while no request runs."""
        if self.running:
            raise EngineError("cannot reset the prefix cache while requests are running")
        self.cache.reset()

    def fail_all(self, err: EngineError) -> None:
        """Ends every request with `err` after an unexpected failure, dropping their cache state."""
        if self.pipeline is not None:
            self.pipeline.abandon()
        for req in list(self.running):
            self._finish(req, "error", err, keep_cache=False)
        while self.waiting:
            self.waiting.popleft().handle._finish("error", err)

    # ------------------------------------------------------------------ finishing
    def _finish(self, req: Request, reason: str, error: EngineError | None = None, keep_cache: bool = True) -> None:
        if req in self.running:
            self.running.remove(req)
            self._release(req, keep_cache)
        req.phase = Phase.FINISHED
        req.handle._finish(reason, error)

    def _release(self, req: Request, keep_cache: bool) -> None:
        """Hands computed KV (and the final state as a snapshot) to the radix cache."""
        assert req.kv_slots is not None and req.match_node is not None
        slots = req.kv_slots
        n = req.computed
        if keep_cache and n > req.owned:
            node, existing = self.cache.insert(req.tokens[:n], slots[:n])
            if existing > req.owned:
                self.kv.free(slots[req.owned:existing])
            if n < len(slots):
                self.kv.free(slots[n:])
            if self.hybrid:
                self.store.save(node, req.state_slot, SnapshotMeta("request_end", 0, req.session), req.session,
                                donate=True)
                req.state_slot = -1
        else:
            self.kv.free(slots[req.owned:])
        if req.state_slot >= 0:
            self.states.free(req.state_slot)
            req.state_slot = -1
        self.cache.unlock(req.match_node)
        req.kv_slots = None


def _greedy(req: Request) -> bool:
    """The request's next token is the logits' argmax (no constraint, no forced ids)."""
    return req.params.greedy and req.constraint is None and req.forced is None
