"""Lazily captured CUDA graphs, one per key: the pattern the decode paths share.

Contract: `GraphCache(name)`; `run(key, fn)` calls `fn` (which only queues work on the current
stream, reading and writing fixed buffers) eagerly the first time a key is seen (kernels compile,
lazy state settles), captures it into a CUDA graph the second time and replays that graph, and
replays it afterwards. A capture that fails is logged once, with `name` and the key, and that key
runs eagerly until `clear()`: correct, only slower. `enabled=False` always runs `fn` eagerly (off
CUDA, or with graphs turned off). All graphs share one memory pool; they must replay in stream
order, never concurrently (`pool` shares one pool with other caches). Python's garbage collector
is off during a capture. `clear()` drops every graph (when something they captured by reference
is replaced) and forgets which keys failed; a cache that made its own pool takes a fresh one
then, since PyTorch's allocator refuses to capture into a pool whose graphs were all destroyed
while its memory is still cached. `captured` counts the graphs.
"""

from __future__ import annotations

import gc
import logging
import time
import traceback
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

import torch

from engine import late_work

log = logging.getLogger("freetoken.engine")


def _where(exc: BaseException) -> str:
    """The innermost frame of this project's code in `exc`'s traceback, as file:line in function:
    what a capture's failure report needs to name the operation that broke it."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if "/engine/" in f.filename or "/freetoken_agent/" in f.filename] or frames
    if not ours:
        return "unknown"
    f = ours[-1]
    return f"{Path(f.filename).name}:{f.lineno} in {f.name}: {f.line}"


class GraphCache:
    def __init__(self, name: str, enabled: bool = True, pool: Any = None) -> None:
        self.name = name
        self.enabled = enabled
        self._own_pool = pool is None
        self.pool = (pool or torch.cuda.graph_pool_handle()) if enabled else None
        self._graphs: dict[Hashable, torch.cuda.CUDAGraph] = {}
        self._seen: set[Hashable] = set()
        self._failed: set[Hashable] = set()

    def run(self, key: Hashable, fn: Callable[[], object]) -> None:
        graph = self._graphs.get(key)
        if graph is not None:
            graph.replay()
            return
        if self.enabled and key in self._seen and key not in self._failed:
            graph = torch.cuda.CUDAGraph()
            # No garbage collection while capturing: a collection can run a finalizer that
            # synchronises the device (engine/gpu/setup.py unregisters page-locked banks that
            # way), which is illegal inside a capture: the capture is lost, and so is the
            # finalizer's work. torch.cuda.graph collects once before it starts.
            collecting = gc.isenabled()
            gc.disable()
            began = time.monotonic()
            try:
                with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                    fn()
            except Exception as exc:  # torch raises AcceleratorError or RuntimeError
                # nothing captured ran, so the state fn updates is as before: run it eagerly
                self._failed.add(key)
                self._renew_pool()  # a failed capture may leave the pool as clear() does
                log.warning("%s %s: CUDA graph capture failed, running eagerly: %s (at %s)", self.name, key,
                            str(exc).splitlines()[0], _where(exc))
            else:
                self._graphs[key] = graph
                late_work.note("capture", f"{self.name} {key}", time.monotonic() - began)
                graph.replay()
                return
            finally:
                if collecting:
                    gc.enable()
        self._seen.add(key)
        fn()

    def clear(self) -> None:
        had_graphs = bool(self._graphs)
        self._graphs.clear()
        self._seen.clear()
        self._failed.clear()
        if had_graphs:
            self._renew_pool()

    def _renew_pool(self) -> None:
        """A fresh pool when this cache made its own: once every graph of a pool is destroyed its use
        count is 0 but its blocks stay cached until the allocator frees them, and capturing into it
        again fails an internal assertion (use_count > 0). The old pool's memory returns to the
        device when the allocator next releases cached blocks (empty_cache, or a failed cudaMalloc)."""
        if self.enabled and self._own_pool:
            self.pool = torch.cuda.graph_pool_handle()

    @property
    def captured(self) -> int:
        return len(self._graphs)
