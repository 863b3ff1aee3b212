"""A generation request as the scheduler tracks it, and the handle its caller holds.

Contract: `RequestHandle` is the caller's side: iterate it to receive token ids as they are
produced (blocking), then read `finish_reason` ("stop", "length", "abort" or "error"), `error`,
`prompt_tokens`, `cached_tokens`, `reuse` (an `engine.anchors.ReuseInfo`, set at admission
before the first token) and, when asked for, `logits` (one float32 row per emitted token). `abort()` may be called from any thread. A `listener` given at creation is called on the
engine thread with each token id and finally with None (async front ends bridge through it; it
must be quick and must not raise). `Request` is the scheduler's side and is touched
only by the engine thread.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import Enum

import torch

from engine.anchors import Anchor, DecodeAnchor, ReuseInfo
from engine.cache.radix import Node
from engine.errors import EngineError
from engine.sampling import SamplingParams, TokenConstraint

_ids = itertools.count()
_DONE = object()


class Phase(Enum):
    WAITING = 0
    PREFILL = 1
    DECODE = 2
    FINISHED = 3


class RequestHandle:
    def __init__(self, rid: str, prompt_tokens: int, listener: Callable[[int | None], object] | None = None) -> None:
        self.rid = rid
        self._listener = listener
        self.prompt_tokens = prompt_tokens
        self.cached_tokens = 0
        self.reuse: ReuseInfo | None = None  # set at admission, before the first token
        self.output_ids: list[int] = []
        self.finish_reason: str | None = None
        self.error: EngineError | None = None
        self.logits: list[torch.Tensor] = []
        self._queue: queue.Queue[object] = queue.Queue()
        self._aborted = threading.Event()
        self._done = threading.Event()

    def __iter__(self) -> Iterator[int]:
        while True:
            item = self._queue.get()
            if item is _DONE:
                return
            assert isinstance(item, int)
            yield item

    def result(self, timeout: float | None = None) -> list[int]:
        """Blocks until the request ends; returns all generated ids (raises its error, if any)."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.rid} still running")
        if self.error is not None:
            raise self.error
        return self.output_ids

    def abort(self) -> None:
        self._aborted.set()

    @property
    def aborted(self) -> bool:
        return self._aborted.is_set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    # engine thread side
    def _emit(self, token: int) -> None:
        self.output_ids.append(token)
        self._queue.put(token)
        if self._listener is not None:
            self._listener(token)

    def _finish(self, reason: str, error: EngineError | None = None) -> None:
        self.finish_reason, self.error = reason, error
        self._done.set()
        self._queue.put(_DONE)
        if self._listener is not None:
            self._listener(None)


@dataclass(eq=False)
class Request:
    prompt: list[int]
    params: SamplingParams
    handle: RequestHandle
    capture_logits: bool = False
    constraint: TokenConstraint | None = None
    max_len: int = 0  # context limit: prompt + output never exceeds it
    rid: int = field(default_factory=lambda: next(_ids))
    phase: Phase = Phase.WAITING
    output: list[int] = field(default_factory=list)
    kv_slots: torch.Tensor | None = None  # slot of every computed token
    computed: int = 0  # tokens whose KV / state are computed
    prefix_len: int = 0  # tokens reused from the cache at admission
    owned: int = 0  # leading KV slots owned by the radix cache (reused or checkpointed); the rest are ours
    anchors: list[Anchor] = field(default_factory=list)  # prompt positions to snapshot, ascending
    decode_anchors: list[DecodeAnchor] = field(default_factory=list)
    session: str | None = None
    forced: list[int] | None = None  # replay: these ids replace the sampled ones, then "stop"
    pending_anchor: DecodeAnchor | None = None  # generated last step: checkpoint after this step
    decode_anchor_at: int = 0  # len(output) when a decode anchor last fired
    finish_pending: str | None = None  # finish reason held back for that one extra step
    finish_error: EngineError | None = None  # with finish_pending "error": a failed draw, nothing cached
    kv_tail: list[int] = field(default_factory=list)  # KV slots taken while passes were in flight, not yet in kv_slots
    match_node: Node | None = None
    state_slot: int = -1
    generator: torch.Generator | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output
