"""Recurrent-state checkpoints in two tiers: device snapshot slots and a host-memory spill pool.

Contract:
- The device `StatePool` holds live requests' working states and device checkpoints; device
  checkpoints never exceed `device_cap` (EngineOptions.checkpoint_slots) nor the pool's free room.
  The `HostStatePool` holds spilled checkpoints, never more than its capacity.
- `save(node, src, meta, requester, donate)` keeps the state in device slot `src` as the
  checkpoint at radix `node`: into a free device slot when the budget allows, else by moving the
  first snapshot in eviction order (engine/anchors.py) down to the host tier; a new checkpoint
  that ranks strictly below every device candidate on (protected, priority) competes for the host
  tier directly (not kept when the device holds no checkpoint at all: every slot is a live
  request's working state). With `donate`
  the caller hands `src` over (a finished request's working state): it is attached or freed.
- `working_slot(requester)` returns a free device slot for a live request, spilling the first
  device checkpoint in eviction order to the host when the pool is full (None if impossible).
- `cut_slot(meta, depth, requester)` returns a device slot for a checkpoint a pass writes inside a
  chunk: a free one, else one freed by spilling the first device checkpoint in eviction order when
  that one ranks strictly below the new one on (protected, priority) (None otherwise).
- `restore(match, dst)` copies the matched checkpoint (either tier) into working slot `dst`.
- Spilling into a full host tier drops the first host snapshot in eviction order, or the spilled
  one itself when it ranks strictly below all of them on (protected, priority).
- `kv_leaf_key(requester)` orders radix leaves for KV eviction by the same policy.
- `listing(session)` / `budget()` report what is held. Only the engine thread mutates.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from engine.anchors import PROTECT_PER_SESSION, SessionActivity, SnapshotMeta, eviction_key
from engine.cache.pools import HostStatePool, StatePool
from engine.cache.radix import Match, Node, RadixCache

_NEWEST = 1 << 62  # a checkpoint not yet in the cache ranks as the most recently used


class CheckpointStore:
    def __init__(self, cache: RadixCache, states: StatePool, host: HostStatePool, device_cap: int) -> None:
        self.cache, self.states, self.host = cache, states, host
        self.device_cap = min(device_cap, states.capacity)  # an explicit shared pool may be smaller
        self.activity = SessionActivity()

    # ------------------------------------------------------------------ policy
    def _ordered(self, nodes: list[Node], requester: str | None, extra: Node | None = None) -> list[Node]:
        """`nodes` in eviction order (first = first to go). `extra` joins the protection ranking
        (a snapshot about to be stored counts towards its session's best N)."""
        protected = self._protected(nodes + ([extra] if extra is not None else []))
        return sorted(nodes, key=lambda x: self._key(x, x in protected, requester))

    def _key(self, node: Node, protected: bool, requester: str | None) -> tuple[int, ...]:
        assert node.meta is not None
        return eviction_key(node.meta, node.last_access, protected, requester, self.activity)

    def _protected(self, nodes: list[Node]) -> set[Node]:
        every = {id(x): x for x in self.cache.snapshot_nodes() + nodes}.values()
        by_session: dict[str, list[Node]] = {}
        for x in every:
            assert x.meta is not None
            if x.meta.session is not None and self.activity.returning(x.meta.session):
                by_session.setdefault(x.meta.session, []).append(x)
        out: set[Node] = set()
        for held in by_session.values():
            held.sort(key=lambda x: (x.meta.priority, x.last_access), reverse=True)  # type: ignore[union-attr]
            out.update(held[:PROTECT_PER_SESSION])
        return out

    def _outranked(self, new: Node, first: Node, requester: str | None) -> bool:
        """True when the first candidate in eviction order still ranks strictly above `new` on
        (protected, priority): then `new` is the one not kept."""
        prot = self._protected([new])
        a = self._key(new, new in prot, requester)[:2]
        b = self._key(first, first in prot, requester)[:2]
        return a < b

    def kv_leaf_key(self, requester: str | None) -> Callable[[Node], tuple[Any, ...]]:
        """Order for evicting radix leaves (KV): leaves without a snapshot first (least recent
        first; on a hybrid model no request can resume inside them), then leaves holding one in
        the checkpoint eviction order (their snapshot goes with their KV)."""
        protected = self._protected([])

        def key(x: Node) -> tuple[Any, ...]:
            if x.meta is None:
                return (0, (), x.last_access)
            return (1, self._key(x, x in protected, requester), x.last_access)

        return key

    # ------------------------------------------------------------------ device tier
    def _device_nodes(self, exclude: Node | None = None) -> list[Node]:
        return [x for x in self.cache.snapshot_nodes() if x.state_slot >= 0 and x is not exclude]

    def save(self, node: Node, src: int, meta: SnapshotMeta, requester: str | None, donate: bool) -> bool:
        """Keeps the state in device slot `src` as `node`'s checkpoint; True when kept."""
        if node.has_state:
            # The same prefix's state is already held (it is deterministic): keep the better label.
            assert node.meta is not None
            if meta.priority > node.meta.priority:
                node.meta = meta
            if donate:
                self.states.free(src)
            return True
        old_meta, node.meta = node.meta, meta  # provisional, so the policy can rank the new one
        while self.cache.num_snapshots >= self.device_cap or (not donate and self.states.num_free == 0):
            held = self._ordered(self._device_nodes(exclude=node), requester, extra=node)
            if not held or self._outranked(node, held[0], requester):
                # Below every device checkpoint: it competes for the host tier instead. With no
                # device checkpoint at all (every slot a working state) it is not kept.
                kept = bool(held) and self._host_room(node, requester)
                if kept:
                    host_slot = self.host.alloc()
                    assert host_slot is not None
                    self.host.store(host_slot, self.states, src)
                    self.cache.attach_host(node, host_slot, meta)
                else:
                    node.meta = old_meta
                if donate:
                    self.states.free(src)
                return kept
            self._spill(held[0], requester)
        slot = src if donate else self.states.alloc()
        assert slot is not None
        if not donate:
            self.states.copy(slot, src)
        displaced = self.cache.attach_state(node, slot, meta)
        assert displaced < 0
        return True

    def working_slot(self, requester: str | None) -> int | None:
        while self.states.num_free == 0:
            held = self._ordered(self._device_nodes(), requester)
            if not held:
                return None
            self._spill(held[0], requester)
        return self.states.alloc()

    def cut_slot(self, meta: SnapshotMeta, depth: int, requester: str | None) -> int | None:
        """A device slot for a checkpoint a pass is about to write at `depth` (labelled `meta`): a free
        one, else one freed by spilling the first device checkpoint in eviction order to the host
        tier when it ranks strictly below the new one on (protected, priority), so `save` would spill
        it for the new one too; None otherwise (the chunk then ends at the anchor, and `save` decides
        there, after the cuts before it are stored)."""
        if self.states.num_free:
            return self.states.alloc()
        held = self._ordered(self._device_nodes(), requester)
        new = Node(key=[], value=torch.empty(0, dtype=torch.long), parent=None, depth=depth, last_access=_NEWEST,
                   meta=meta)
        prot = self._protected([new])
        if not held or (self._key(held[0], held[0] in prot, requester)[:2]
                        >= self._key(new, new in prot, requester)[:2]):
            return None
        self._spill(held[0], requester)
        return self.states.alloc()

    def restore(self, match: Match, dst: int) -> bool:
        """Copies the matched checkpoint into `dst` (zeroes it when there is none); True if it came
        from the host tier."""
        if match.state_slot >= 0:
            self.states.copy(dst, match.state_slot)
            return False
        if match.host_slot >= 0:
            self.host.load(self.states, dst, match.host_slot)
            return True
        self.states.reset(dst)
        return False

    # ------------------------------------------------------------------ host tier
    def _host_room(self, node: Node, requester: str | None) -> bool:
        """Frees a host slot for `node`'s snapshot if the policy ranks it above the first host
        snapshot in eviction order (dropping that one); False when it is not to be kept there."""
        if self.host.num_free:
            return True
        held = self._ordered([x for x in self.cache.snapshot_nodes() if x.host_slot >= 0], requester, extra=node)
        if not held or self._outranked(node, held[0], requester):
            return False
        self.cache.drop_state(held[0])
        return True

    def _spill(self, node: Node, requester: str | None) -> None:
        """Moves `node`'s device snapshot to the host tier, or drops it when the host tier keeps
        better ones (or has no slots at all)."""
        if not self._host_room(node, requester):
            self.cache.drop_state(node)
            return
        host_slot = self.host.alloc()
        assert host_slot is not None
        self.host.store(host_slot, self.states, node.state_slot)
        self.states.free(self.cache.spill(node, host_slot))

    # ------------------------------------------------------------------ inspection
    def listing(self, session: str | None = None, slot_bytes: int = 0) -> list[dict[str, object]]:
        out: list[dict[str, object]] = []
        for x in sorted(self.cache.snapshot_nodes(), key=lambda x: (x.depth, x.last_access)):
            assert x.meta is not None
            if session is not None and x.meta.session != session:
                continue
            out.append({"session": x.meta.session, "position": x.depth, "kind": x.meta.kind,
                        "priority": x.meta.priority, "bytes": slot_bytes,
                        "tier": "device" if x.state_slot >= 0 else "host", "last_access": x.last_access})
        return out

    def budget(self, slot_bytes: int) -> dict[str, int]:
        return {"device_slots": self.device_cap, "device_used": self.cache.num_snapshots,
                "host_slots": self.host.capacity, "host_used": self.cache.num_host_snapshots,
                "slot_bytes": slot_bytes}
