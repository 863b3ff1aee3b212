"""Semantic anchors: where the engine snapshots recurrent state, and which snapshots it keeps.

Contract:
- `Anchor(position, kind, priority)`: snapshot the recurrent state after prompt tokens
  [0, position) while prefilling. `kind` is the caller's label ("system_end", "user_start",
  "assistant_start", "tool_result_start", "before_runtime_context", "prompt_end", "position", ...);
  the engine only stores and reports it. Legacy `submit(checkpoints=[p])` means
  `Anchor(p, "position", 0)`.
- `DecodeAnchor(token_id, kind, priority, preceded_by, min_gap)`: while decoding, each time the
  engine generates `token_id` right after the tokens `preceded_by`, at least `min_gap` tokens
  after the request's last decode checkpoint (or the start of its output), snapshot the state
  after that token (`decode_anchor_at` picks the one that fires, the highest priority). A token's state only exists once the next step
  has fed it through the model, so the checkpoint's position is (index of the token in
  prompt + output) + 1 and it is taken at the end of that next step. A request that ends on the
  token (stop token, max_tokens, forced output exhausted) runs that one extra step before it
  finishes; the caller sees the same tokens, finish reason and logits as without the anchor.
- `ReuseInfo`: what admission reused, on `RequestHandle.reuse` before the first token is emitted.
- `SnapshotMeta` / `eviction_key`: the eviction policy, below.

Eviction policy (both tiers: device checkpoint slots and the host spill tier). Under pressure the
snapshot with the smallest key goes first (on the device it moves down to the host tier; on the
host it is dropped). The key is, in order:
1. protected last: each *returning* session (one with at least two requests among the last
   `ACTIVE_WINDOW` admissions) keeps its `PROTECT_PER_SESSION` best snapshots (highest priority,
   then most recent) until nothing else is left;
2. lower `priority` first;
3. a side request (session None, or a session that is not returning) evicts its own session's
   snapshots before anyone else's of the same priority;
4. snapshots of sessions with fewer recent requests first (one-off side sessions before the
   main conversation);
5. least recently used first (LRU is the floor when everything else ties); a snapshot's recency
   is the last time a request's match or insert passed through its radix node.
A new snapshot competes with the ones already in a full tier: when every one there ranks
strictly above it on (protected, priority) it goes straight to the next tier (or is not kept), so
a flood of low-value snapshots never pushes out better ones. A live request always gets a working state slot: when the device pool is
full, the first device snapshot in this order moves to the host tier. Snapshots of nodes locked
by running requests are candidates too (admission copies a snapshot into the request's working
slot at once; locks only pin KV). KV eviction uses the same order for radix leaves that hold a
snapshot, after the leaves that hold none (nothing can resume inside those on a hybrid model).
Session None is never "returning": untagged requests get LRU-by-priority only.

Per-sequence state that a snapshot holds: Gated DeltaNet's conv window and SSM state, and each
sliding-window layer's ring of its last keys and values (the KV pool keeps only the
full-attention layers' tokens: engine/cache/pools.py), so a model with either resumes only where
a snapshot was taken, with exactly the state a cold prefill reaches there.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass

PROTECT_PER_SESSION = 2  # a returning session's best snapshots that are evicted last
ACTIVE_WINDOW = 32  # admissions looked back at to call a session "returning"


@dataclass(frozen=True)
class Anchor:
    position: int  # checkpoint = state after prompt tokens [0, position)
    kind: str
    priority: int = 0  # higher = kept longer under eviction pressure


@dataclass(frozen=True)
class DecodeAnchor:
    token_id: int  # checkpoint right after the engine generates this token (see module docstring)
    kind: str
    priority: int = 0
    preceded_by: tuple[int, ...] = ()  # ... when the output before it ends with these ids
    min_gap: int = 0  # ... and at least this many tokens after the last decode checkpoint


def decode_anchor_at(anchors: Sequence[DecodeAnchor], output: Sequence[int], last: int,
                     n: int | None = None) -> DecodeAnchor | None:
    """The decode anchor that fires on token `n - 1` of `output` (default: its last token), None if
    none does; `last` is the output length when the previous decode anchor fired (0 if none has)."""
    n = len(output) if n is None else n
    if n <= 0:
        return None
    token, best = output[n - 1], None
    for a in anchors:
        if a.token_id != token or n - last < a.min_gap or (best is not None and a.priority <= best.priority):
            continue
        k = len(a.preceded_by)
        if k and (n - 1 < k or tuple(output[n - 1 - k:n - 1]) != a.preceded_by):
            continue
        best = a
    return best


@dataclass
class ReuseInfo:
    kv_tokens: int  # prompt tokens whose KV came from the cache
    state_position: int  # position of the restored recurrent checkpoint (non-hybrid: equals kv_tokens)
    checkpoint_kind: str | None  # kind of the checkpoint used, None if none
    from_host: bool  # restored from the host-memory spill tier
    recomputed_tokens: int  # prompt tokens prefilled = len(prompt) - reused position


@dataclass
class SnapshotMeta:
    """What the policy knows of one stored snapshot (owned by its radix node)."""
    kind: str = "position"
    priority: int = 0
    session: str | None = None


class SessionActivity:
    """Admissions of the last `window` requests, per session: who is the returning conversation."""

    def __init__(self, window: int = ACTIVE_WINDOW) -> None:
        self._recent: deque[str | None] = deque(maxlen=window)
        self._counts: Counter[str | None] = Counter()

    def admit(self, session: str | None) -> None:
        if len(self._recent) == self._recent.maxlen:
            self._counts[self._recent[0]] -= 1
        self._recent.append(session)
        self._counts[session] += 1

    def requests(self, session: str | None) -> int:
        return 0 if session is None else self._counts[session]

    def returning(self, session: str | None) -> bool:
        return self.requests(session) >= 2


def eviction_key(meta: SnapshotMeta, last_access: int, protected: bool, requester: str | None,
                 activity: SessionActivity) -> tuple[int, int, int, int, int]:
    """Sort key of a snapshot under pressure from a request of session `requester`: smallest
    goes first (see the module docstring)."""
    side = not activity.returning(requester)
    own_first = 0 if side and meta.session == requester else 1
    return (int(protected), meta.priority, own_first, activity.requests(meta.session), last_access)


def anchors_from(checkpoints: list[int] | None, anchors: list[Anchor] | None) -> list[Anchor]:
    """Merges legacy positions and anchors, one per position (the highest priority wins)."""
    by_pos: dict[int, Anchor] = {}
    for a in [Anchor(int(p), "position", 0) for p in checkpoints or []] + list(anchors or []):
        old = by_pos.get(a.position)
        if old is None or a.priority > old.priority:
            by_pos[a.position] = a
    return [by_pos[p] for p in sorted(by_pos)]
