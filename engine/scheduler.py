"""Continuous batching: admission with prefix reuse, chunked prefill, batched decode, finishing.

Contract: `Scheduler.step()` advances every running request by one forward pass: each decoding
request contributes one token, prefilling requests contribute chunks up to `prefill_chunk` tokens
in total. Admission restores the longest reusable prefix from the radix cache (KV slots, and for
recurrent layers the snapshot at that exact position) and prefills only the rest. A finished
request's computed tokens are inserted into the cache with its final recurrent state as the
snapshot, so the next request that extends it resumes there. Only the engine thread calls this.
"""

from __future__ import annotations

from collections import deque

import torch

from engine.cache.pools import KVPool, StatePool
from engine.cache.radix import RadixCache
from engine.errors import CapacityError, EngineError
from engine.model.batch import ForwardBatch, SeqEntry
from engine.model.decoder import Decoder
from engine.options import EngineOptions
from engine.request import Phase, Request
from engine.sampling import sample


class Scheduler:
    def __init__(self, decoder: Decoder, opts: EngineOptions, dtype: torch.dtype) -> None:
        self.decoder, self.opts = decoder, opts
        cfg = decoder.cfg
        self.device = torch.device(opts.device)
        self.hybrid = cfg.is_hybrid
        self.kv = KVPool(cfg, opts.kv_tokens, dtype, self.device)
        self.states = StatePool(cfg, opts.state_slots if self.hybrid else 0, dtype, self.device)
        self.cache = RadixCache(self.kv.free, self.states.free, self.device)
        self.eos = set(cfg.eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    # ------------------------------------------------------------------ admission
    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.opts.max_running:
            req = self.waiting[0]
            if self.hybrid and self.states.num_free == 0 and not self.cache.evict_state():
                return  # wait for a running request to hand its state back
            self.waiting.popleft()
            match = self.cache.match(req.prompt, len(req.prompt) - 1, need_state=self.hybrid)
            self.cache.lock(match.node)
            req.match_node, req.prefix_len, req.computed = match.node, match.length, match.length
            req.owned = match.length
            req.anchors = [a for a in req.anchors if match.length < a.position < len(req.prompt)]
            req.kv_slots = match.slots.clone()
            req.handle.cached_tokens = match.length
            if self.hybrid:
                slot = self.states.alloc()
                assert slot is not None
                if match.state_slot >= 0:
                    self.states.copy(slot, match.state_slot)
                else:
                    self.states.reset(slot)
                req.state_slot = slot
            if req.params.seed is not None:
                req.generator = torch.Generator().manual_seed(req.params.seed)
            elif not req.params.greedy:
                req.generator = torch.Generator()
                req.generator.seed()
            req.phase = Phase.PREFILL
            self.running.append(req)

    def _alloc_kv(self, n: int) -> torch.Tensor:
        slots = self.kv.alloc(n)
        if slots is None:
            self.cache.evict(n - self.kv.num_free)
            slots = self.kv.alloc(n)
        if slots is None:
            raise CapacityError(f"KV cache full: {n} more tokens needed, {self.kv.num_free} free of {self.kv.capacity}")
        return slots

    # ------------------------------------------------------------------ step
    def step(self) -> None:
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
        budget = self.opts.prefill_chunk
        for req in self.running:
            if req.phase is Phase.DECODE:
                entries.append((req, [req.output[-1]]))
        for req in self.running:
            if req.phase is Phase.PREFILL and budget > 0:
                end = min(req.computed + budget, len(req.prompt))
                stop_at = next((a.position for a in req.anchors if a.position > req.computed), None)
                if stop_at is not None:
                    end = min(end, stop_at)  # a chunk ends at each checkpoint so its state can be saved
                chunk = req.prompt[req.computed:end]
                budget -= len(chunk)
                entries.append((req, chunk))
        batch_entries, ids, pos = [], [], []
        for req, toks in list(entries):
            try:
                new = self._alloc_kv(len(toks))
            except CapacityError as e:
                entries.remove((req, toks))
                self._finish(req, "error", e)
                continue
            assert req.kv_slots is not None
            req.kv_slots = torch.cat([req.kv_slots, new])
            batch_entries.append(SeqEntry(len(ids), len(toks), req.computed, req.kv_slots, req.state_slot))
            ids.extend(toks)
            pos.extend(range(req.computed, req.computed + len(toks)))
        if not entries:
            return
        batch = ForwardBatch(torch.tensor(ids, dtype=torch.long, device=self.device),
                             torch.tensor(pos, dtype=torch.long, device=self.device), batch_entries)
        try:
            hidden = self.decoder.forward(batch, self.kv, self.states)
            logits = self.decoder.logits(hidden[batch.last_token_index()])
        except Exception as e:  # a failed step must not take the engine down
            err = e if isinstance(e, EngineError) else EngineError(f"forward pass failed: {type(e).__name__}: {e}")
            for req, _ in entries:
                self._finish(req, "error", err, keep_cache=False)
            return
        for row, (req, toks) in enumerate(entries):
            req.computed += len(toks)
            if req.phase is Phase.PREFILL and any(a.position == req.computed for a in req.anchors):
                self._checkpoint(req)
            if req.phase is Phase.PREFILL and req.computed < len(req.prompt):
                continue
            req.phase = Phase.DECODE
            self._sample(req, logits[row])

    def _sample(self, req: Request, logits: torch.Tensor) -> None:
        if req.capture_logits:
            req.handle.logits.append(logits.detach().cpu().clone())
        try:
            token = sample(logits, req.params, req.generator, req.constraint)
        except Exception as e:  # a bad constraint must fail its request, not the engine
            self._finish(req, "error", EngineError(f"sampling failed: {type(e).__name__}: {e}"))
            return
        req.output.append(token)
        req.handle._emit(token)
        p = req.params
        if token in p.stop_token_ids or (token in self.eos and not p.ignore_eos):
            self._finish(req, "stop")
        elif len(req.output) >= p.max_tokens or len(req.prompt) + len(req.output) >= req.max_len:
            self._finish(req, "length")

    def _checkpoint(self, req: Request) -> None:
        """Publishes the computed prefix to the radix cache with a snapshot of the state after it."""
        snap = -1
        if self.hybrid:
            snap = self.states.alloc()
            if snap is None and self.cache.evict_state():
                snap = self.states.alloc()
            if snap is None:
                return  # no room for a snapshot: the checkpoint is skipped, never wrong
            self.states.copy(snap, req.state_slot)
        assert req.kv_slots is not None and req.match_node is not None
        n = req.computed
        node, existing = self.cache.insert(req.prompt[:n], req.kv_slots[:n])
        if existing > req.owned:
            # Another request cached these tokens first: use its slots, free our duplicates.
            self.kv.free(req.kv_slots[req.owned:existing])
            req.kv_slots = torch.cat([self.cache.path_slots(node), req.kv_slots[n:]])
        self.cache.lock(node)
        self.cache.unlock(req.match_node)
        req.match_node, req.owned = node, n
        if snap >= 0:
            displaced = self.cache.attach_state(node, snap)
            if displaced >= 0:
                self.states.free(displaced)

    def fail_all(self, err: EngineError) -> None:
        """Ends every request with `err` after an unexpected failure, dropping their cache state."""
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
                displaced = self.cache.attach_state(node, req.state_slot)
                if displaced >= 0:
                    self.states.free(displaced)
                req.state_slot = -1
        else:
            self.kv.free(slots[req.owned:])
        if req.state_slot >= 0:
            self.states.free(req.state_slot)
            req.state_slot = -1
        self.cache.unlock(req.match_node)
        req.kv_slots = None
