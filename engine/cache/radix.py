"""Radix tree over token ids: shared KV slots and recurrent-state snapshots for prefix reuse.

Contract:
- `match(tokens, limit, need_state)` finds the longest cached prefix of `tokens` no longer than
  `limit`. Without `need_state` any prefix is reusable (attention KV is position-exact); with it,
  only a prefix ending where a state snapshot was stored, so a recurrent layer never resumes from
  a state that does not belong to that exact prefix. The match is split at its end so the caller
  can `lock` the node (locked nodes and their ancestors are never evicted).
- `insert(tokens, slots)` adds a computed sequence and returns how many leading tokens were
  already present (the caller frees its own duplicate slots in that range from its matched length).
- `attach_state(node, slot, meta)` stores a device snapshot taken after the node's last token;
  the tree owns it from then on (a previous device snapshot there is returned for freeing; a host
  copy there is freed). A node holds at most one snapshot, in one tier: `spill(node, host_slot)`
  moves it to the host tier (returns the device slot to free), `attach_host(node, host_slot,
  meta)` stores one there directly, `drop_state(node)` frees it.
  `snapshot_nodes()` lists the nodes holding one; which to move or drop is the caller's policy
  (engine/cache/checkpoints.py).
- `match(..., need_state=True)` accepts a snapshot in either tier (`Match.host_slot`).
- `evict(n_tokens, key)` frees unlocked leaves in ascending `key` order until n KV slots were
  released (default key: the leaf's snapshot priority, then least recently used). `evict_state()` drops the
  least-recently-used unlocked device snapshot. Freed slots go back through the callbacks given
  at construction.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.anchors import SnapshotMeta


@dataclass(eq=False)
class Node:
    key: list[int]
    value: torch.Tensor  # KV slot per token of `key`
    parent: Node | None
    depth: int  # tokens from the root through the end of this edge
    children: dict[int, Node] = field(default_factory=dict)
    lock: int = 0
    last_access: int = 0
    state_slot: int = -1  # device snapshot after this node's last token
    host_slot: int = -1  # or the same snapshot spilled to the host tier
    meta: SnapshotMeta | None = None  # set whenever a snapshot is held

    @property
    def has_state(self) -> bool:
        return self.state_slot >= 0 or self.host_slot >= 0


@dataclass
class Match:
    node: Node  # deepest node of the reusable prefix (the root when nothing matches)
    length: int
    slots: torch.Tensor  # KV slots of the reusable prefix
    state_slot: int  # device snapshot at `length`, or -1 (also -1 when length == 0)
    host_slot: int = -1  # host-tier snapshot at `length` when there is no device one, or -1


class RadixCache:
    def __init__(self, free_kv: Callable[[torch.Tensor], None], free_state: Callable[[int], None],
                 device: torch.device | str = "cpu", free_host: Callable[[int], None] | None = None) -> None:
        self._free_kv, self._free_state = free_kv, free_state
        self._free_host = free_host or (lambda slot: None)
        self.device = torch.device(device)
        self.root = Node(key=[], value=torch.empty(0, dtype=torch.long, device=self.device), parent=None, depth=0)
        self.root.lock = 1
        self._clock = itertools.count(1)
        self.cached_tokens = 0
        self.num_snapshots = 0  # device snapshots
        self.num_host_snapshots = 0
        self._held: dict[Node, None] = {}  # nodes holding a snapshot, in insertion order

    # ------------------------------------------------------------------ lookup
    def match(self, tokens: list[int], limit: int, need_state: bool) -> Match:
        tick = next(self._clock)
        node, pos = self.root, 0
        path_slots: list[torch.Tensor] = []
        best = Match(self.root, 0, self.root.value, -1)
        while pos < limit:
            child = node.children.get(tokens[pos])
            if child is None:
                break
            n = _common(child.key, tokens, pos, limit)
            if n < len(child.key):
                if need_state:
                    break  # a snapshot sits only at an edge's end
                child = self._split(child, n)
            node, pos = child, pos + n
            node.last_access = tick
            path_slots.append(node.value)
            if not need_state or node.has_state:
                best = Match(node, pos, torch.cat(path_slots), node.state_slot, node.host_slot)
        return best

    def lock(self, node: Node) -> None:
        while node is not None:
            node.lock += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: Node) -> None:
        while node is not None:
            node.lock -= 1
            node = node.parent  # type: ignore[assignment]

    def path_slots(self, node: Node) -> torch.Tensor:
        """KV slots of every token from the root through `node`."""
        parts = []
        while node is not None and node is not self.root:
            parts.append(node.value)
            node = node.parent  # type: ignore[assignment]
        return torch.cat(parts[::-1]) if parts else self.root.value

    # ------------------------------------------------------------------ insert
    def insert(self, tokens: list[int], slots: torch.Tensor) -> tuple[Node, int]:
        """Returns (node ending at len(tokens), number of leading tokens that were already cached)."""
        tick = next(self._clock)
        node, pos = self.root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                leaf = Node(key=list(tokens[pos:]), value=slots[pos:].clone(), parent=node, depth=len(tokens),
                            last_access=tick)
                node.children[tokens[pos]] = leaf
                self.cached_tokens += len(leaf.key)
                return leaf, pos
            n = _common(child.key, tokens, pos, len(tokens))
            if n < len(child.key):
                child = self._split(child, n)
            node, pos = child, pos + n
            node.last_access = tick
        return node, pos

    def attach_state(self, node: Node, slot: int, meta: SnapshotMeta | None = None) -> int:
        """Owns `slot` as the device snapshot at `node`; returns a displaced slot to free, or -1."""
        old = node.state_slot
        if node.host_slot >= 0:  # the device copy supersedes a spilled one
            self._free_host(node.host_slot)
            node.host_slot = -1
            self.num_host_snapshots -= 1
        node.state_slot = slot
        node.meta = meta or node.meta or SnapshotMeta()
        self._held[node] = None
        if old < 0:
            self.num_snapshots += 1
        return old

    def spill(self, node: Node, host_slot: int) -> int:
        """Records that `node`'s device snapshot now lives in `host_slot`; returns the device slot
        (the caller copied it down and frees it)."""
        old = node.state_slot
        assert old >= 0 and node.host_slot < 0
        node.state_slot, node.host_slot = -1, host_slot
        self.num_snapshots -= 1
        self.num_host_snapshots += 1
        return old

    def attach_host(self, node: Node, host_slot: int, meta: SnapshotMeta) -> None:
        """Owns `host_slot` as `node`'s snapshot, stored straight into the host tier."""
        assert not node.has_state
        node.host_slot, node.meta = host_slot, meta
        self.num_host_snapshots += 1
        self._held[node] = None

    def drop_state(self, node: Node) -> None:
        """Frees `node`'s snapshot, whichever tier holds it."""
        if node.state_slot >= 0:
            self._free_state(node.state_slot)
            node.state_slot = -1
            self.num_snapshots -= 1
        if node.host_slot >= 0:
            self._free_host(node.host_slot)
            node.host_slot = -1
            self.num_host_snapshots -= 1
        node.meta = None
        self._held.pop(node, None)

    def snapshot_nodes(self) -> list[Node]:
        return list(self._held)

    def _split(self, child: Node, n: int) -> Node:
        """Cut `child`'s edge after n tokens; returns the new upper node (no snapshot)."""
        parent = child.parent
        assert parent is not None and 0 < n < len(child.key)
        upper = Node(key=child.key[:n], value=child.value[:n], parent=parent,
                     depth=child.depth - len(child.key) + n, lock=child.lock, last_access=child.last_access)
        parent.children[child.key[0]] = upper
        child.key, child.value, child.parent = child.key[n:], child.value[n:], upper
        upper.children[child.key[0]] = child
        return upper

    # ------------------------------------------------------------------ eviction
    def _nodes(self) -> list[Node]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def evict(self, n_tokens: int, key: Callable[[Node], Any] | None = None) -> int:
        # Default: a leaf holding a high-priority snapshot goes after lower ones; LRU among equals.
        key = key or (lambda x: (x.meta.priority if x.meta else 0, x.last_access))
        freed = 0
        while freed < n_tokens:
            leaves = [x for x in self._nodes() if not x.children and x.lock == 0 and x is not self.root]
            if not leaves:
                break
            for leaf in sorted(leaves, key=key):
                freed += self._remove_leaf(leaf)
                if freed >= n_tokens:
                    break
        return freed

    def evict_state(self) -> bool:
        held = [x for x in self._held if x.state_slot >= 0 and x.lock == 0]
        if not held:
            return False
        self.drop_state(min(held, key=lambda x: x.last_access))  # a node never holds both tiers
        return True

    def _remove_leaf(self, leaf: Node) -> int:
        parent = leaf.parent
        assert parent is not None
        del parent.children[leaf.key[0]]
        self._free_kv(leaf.value)
        self.drop_state(leaf)
        self.cached_tokens -= len(leaf.key)
        return len(leaf.key)

    def reset(self) -> None:
        for child in list(self.root.children.values()):
            stack = [child]
            while stack:
                node = stack.pop()
                stack.extend(node.children.values())
                self._free_kv(node.value)
                self.drop_state(node)
        self.root.children.clear()
        self._held.clear()
        self.cached_tokens = 0  # device snapshots
        self.num_host_snapshots = 0
        self._held = {}  # nodes holding a snapshot, in insertion order


def _common(key: list[int], tokens: list[int], pos: int, limit: int) -> int:
    n = min(len(key), limit - pos)
    for i in range(n):
        if key[i] != tokens[pos + i]:
            return i
    return n
