"""The engine's public face: load a model, submit token ids, stream token ids back.

Contract: `Engine(model_dir, opts)` loads the model; `Engine.from_decoder(decoder, opts)` wraps an
already built one (random weights: engine/weights/dummy.py) with the same setup after loading.
`submit(prompt_ids, params)` validates the request (a bad one raises `RequestError` at once) and
returns a `RequestHandle` whose iteration yields generated ids as they are produced. Requests
submitted from any thread are batched together by one background engine thread. `generate(...)`
is the one-call convenience iterator.
Recurrent-state checkpoints are requested with anchors (engine/anchors.py) and inspected with
`checkpoints(session)` / `checkpoint_budget()`; `reset_cache()` empties the prefix cache. With
`opts.gpu_memory` on CUDA, routed experts run through the GPU expert cache (engine/gpu/setup.py) and
`gpu_budget` says how the cap was split; `memory_report()` reads it with the device's free memory and
`set_gpu_memory(total)` rebuilds the expert cache under a new cap between two steps
(engine/gpu/elastic.py); `set_pools(kv_tokens, checkpoint_slots, ...)` resizes the KV pool and the
checkpoint slots while idle; with `opts.follow_free_memory` a watcher thread moves the cap with the
device's free memory. The engine knows nothing of text, chat formats or HTTP.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from engine.anchors import Anchor, DecodeAnchor, anchors_from
from engine.cache.pools import KVPool, StatePool
from engine.config import ModelConfig
from engine.errors import ConfigError, EngineError, RequestError
from engine.model.decoder import Decoder
from engine.model.load import load_decoder, parse_dtype
from engine.model.ops import use_kernels
from engine.moe.native import apply_native_options
from engine.options import EngineOptions
from engine.request import Request, RequestHandle
from engine.sampling import SamplingParams, TokenConstraint
from engine.scheduler import Scheduler
from engine.watchdog import StepWatch
from engine.weights.loader import Progress

log = logging.getLogger("freetoken.engine")


class Engine:
    def __init__(self, model_dir: Path | str, opts: EngineOptions | None = None,
                 progress: Progress | None = None) -> None:
        opts = opts or EngineOptions()
        _apply_process_options(opts)
        dtype = parse_dtype(opts.dtype) if opts.dtype else None
        decoder = load_decoder(model_dir, opts.device, dtype, opts.executor, progress, opts.native_pool_threads)
        self._start(decoder, opts)

    @classmethod
    def from_decoder(cls, decoder: Decoder, opts: EngineOptions | None = None) -> Engine:
        """An engine around a decoder built some other way (engine/weights/dummy.py's random
        weights): the same setup as after loading, `opts.gpu_memory` included. `opts.device` must
        be where the decoder's dense weights live; its dtype and executor are the decoder's own
        (`opts.dtype` and `opts.executor` are not consulted)."""
        opts = opts or EngineOptions()
        where, want = decoder.weights.final_norm.device, torch.device(opts.device)
        if where.type != want.type or (want.index is not None and where != want):
            raise ConfigError(f"the decoder's weights are on {where} but the engine options say {want}")
        _apply_process_options(opts)
        engine = cls.__new__(cls)
        engine._start(decoder, opts)
        return engine

    def _start(self, decoder: Decoder, opts: EngineOptions) -> None:
        """Everything after the decoder exists: the GPU expert cache, the scheduler, the loop state."""
        from engine.gpu.budget import resolve_checkpoint_slots

        self.dtype = decoder.weights.embed.dtype
        opts = resolve_checkpoint_slots(opts, decoder.cfg, self.dtype)
        self.opts = opts
        self.decoder = decoder
        self.cfg = decoder.cfg
        self.gpu_budget = None
        self._cache_stats: dict[str, float] = {}
        self._cache_stats_at = 0.0
        self._stop_follow = threading.Event()
        if opts.gpu_memory:
            from engine.gpu.setup import attach_expert_cache

            self.gpu_budget = attach_expert_cache(decoder, opts, self.dtype)
        self.max_model_len = opts.max_model_len or self.cfg.max_position_embeddings
        self.scheduler = Scheduler(decoder, opts, self.dtype)
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._next_id = 0
        self._inbox: deque[Request] = deque()
        self._step_lock = threading.Lock()  # held while a step runs: lets inspection see a settled state
        self._stats: dict[str, int] = {}
        self._publish_stats()
        self._watch = StepWatch(opts.step_watch_s)  # a step that never returns is reported (engine/watchdog.py)
        if self.gpu_budget is not None and opts.follow_free_memory:
            threading.Thread(target=self._follow_loop, args=(opts.follow_free_memory,), name="freetoken-memory",
                             daemon=True).start()

    # ------------------------------------------------------------------ API
    def submit(self, prompt_ids: list[int], params: SamplingParams | None = None,
               capture_logits: bool = False, constraint: TokenConstraint | None = None,
               listener: Callable[[int | None], object] | None = None,
               checkpoints: list[int] | None = None, anchors: list[Anchor] | None = None,
               decode_anchors: list[DecodeAnchor] | None = None, session: str | None = None,
               forced_output: list[int] | None = None) -> RequestHandle:
        """Queues a request. `checkpoints` (legacy) and `anchors` ask for recurrent-state snapshots
        at prompt positions, `decode_anchors` after generated tokens (engine/anchors.py);
        `session` tags them for the eviction policy; `forced_output` replaces each sampled token by
        the next forced id (the forward pass and captured logits are the real ones) and finishes
        the request with "stop" when the list is exhausted (trace replay only). Anchor positions
        outside (0, len(prompt)] or already covered by the reused prefix are ignored."""
        params = params or SamplingParams()
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise RequestError("prompt is empty: at least one token is needed")
        bad = next((t for t in prompt if not 0 <= t < self.cfg.vocab_size), None)
        if bad is not None:
            raise RequestError(f"token id {bad} out of range [0, {self.cfg.vocab_size})")
        limit = min(self.max_model_len, self.opts.kv_tokens)
        if len(prompt) >= limit:
            raise RequestError(f"prompt is too long: {len(prompt)} tokens > {limit - 1} maximum")
        forced = None if forced_output is None else [int(t) for t in forced_output]
        # A bad forced id would fail the whole batch's forward pass, not just this request.
        bad = next((t for t in forced or [] if not 0 <= t < self.cfg.vocab_size), None)
        if bad is not None:
            raise RequestError(f"forced_output token id {bad} out of range [0, {self.cfg.vocab_size})")
        if any(not isinstance(a, Anchor) for a in anchors or []) or any(
                not isinstance(a, DecodeAnchor) for a in decode_anchors or []):
            raise RequestError("anchors must be Anchor and decode_anchors DecodeAnchor instances")
        with self._cv:
            if self._closed:
                raise RequestError("engine is shut down")
            self._next_id += 1
            handle = RequestHandle(f"req-{self._next_id}", len(prompt), listener)
            self._inbox.append(Request(prompt=prompt, params=params, handle=handle,
                                       capture_logits=capture_logits, constraint=constraint, max_len=limit,
                                       anchors=anchors_from(checkpoints, anchors),
                                       decode_anchors=list(decode_anchors or []), session=session,
                                       forced=forced))
            self._ensure_thread()
            self._cv.notify()
        return handle

    def checkpoints(self, session: str | None = None) -> list[dict[str, object]]:
        """Held recurrent-state checkpoints (of `session` only, when given; None lists all), shallowest
        first: each
        {"session", "position", "kind", "priority", "bytes", "tier": "device"|"host", "last_access"}.
        Empty for models without recurrent layers. Safe from any thread."""
        with self._step_lock:
            s = self.scheduler
            return s.store.listing(session, s.states.slot_bytes())

    def checkpoint_budget(self) -> dict[str, int]:
        """{"device_slots", "device_used", "host_slots", "host_used", "slot_bytes"}; safe from any thread."""
        with self._step_lock:
            s = self.scheduler
            return s.store.budget(s.states.slot_bytes())

    def reset_cache(self) -> None:
        """Drops all cached prefixes and checkpoints; raises EngineError while requests run."""
        with self._cv, self._step_lock:
            if self._inbox or self.scheduler.has_work:
                raise EngineError("cannot reset the prefix cache while requests are queued or running")
            self.scheduler.reset_cache()
            self._publish_stats()

    def generate(self, prompt_ids: list[int], params: SamplingParams | None = None) -> Iterator[int]:
        handle = self.submit(prompt_ids, params)
        try:
            yield from handle
        finally:
            if not handle.done:
                handle.abort()
        if handle.error is not None:
            raise handle.error

    def stalled_step_s(self) -> float | None:
        """How long the running step has taken when it is past the step watch's threshold
        (`opts.step_watch_s`), else None. Safe from any thread."""
        return self._watch.running_for() if self._watch.stalled() else None

    def close(self) -> None:
        self._stop_follow.set()
        self._watch.stop()
        with self._cv:
            self._closed = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ loop
    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, name="freetoken-engine", daemon=True)
            self._thread.start()
            self._watch.start()

    def _loop(self) -> None:
        # Only this thread steps the scheduler; other threads meet it at the inbox, so a long step
        # never blocks submit() or close() (set_pools() swaps it only while nothing is queued or runs).
        while True:
            with self._cv:
                # read each round: set_pools() may replace it while the engine is idle
                while not self._inbox and not self.scheduler.has_work and not self._closed:
                    self._cv.wait()
                sched = self.scheduler
                while self._inbox:
                    sched.add(self._inbox.popleft())
                closed = self._closed
            if closed:
                for req in list(sched.waiting) + list(sched.running):
                    req.handle.abort()
                if not sched.has_work:
                    return
            with self._step_lock:
                self._watch.begin()
                try:
                    sched.step()
                    self._refresh_cache_stats()
                    self._publish_stats()
                except Exception as e:  # never let the engine thread die with requests waiting on it
                    sched.fail_all(EngineError(f"engine step failed: {type(e).__name__}: {e}"))
                finally:
                    self._watch.end()

    def stats(self) -> dict[str, int]:
        """What other threads may read without waiting for a step: {"running", "waiting",
        "kv_tokens", "kv_tokens_used", "staged_passes", "prefill_passes"} as of the end of the last
        step (KV tokens in use count the prefix cache's slots too; staged passes: decode passes
        queued before the previous pass's tokens were read, engine/decode_pipeline.py, since the
        pools were made; prefill passes: forward passes that computed prompt tokens, since then).
        Safe from any thread; never blocks."""
        out = dict(self._stats)
        out["waiting"] += len(self._inbox)
        return out

    def _publish_stats(self) -> None:
        """Engine thread (or a caller holding the step lock): the figures `stats()` returns."""
        s = self.scheduler
        self._stats = {"running": len(s.running), "waiting": len(s.waiting), "kv_tokens": s.kv.capacity,
                       "kv_tokens_used": s.kv.capacity - s.kv.num_free, "staged_passes": s.staged_passes,
                       "prefill_passes": s.prefill_passes}

    def _refresh_cache_stats(self) -> None:
        """Copies the expert cache's device counters to the host at most once a second, here on the
        engine thread (a read from another thread could meet a CUDA graph capture in progress)."""
        # `stats` synchronises the device and reads it (~60 us per token on the H200 if read every step)
        if time.monotonic() - self._cache_stats_at < 1.0 or not self.decoder.executor.has_stats:
            return
        if self.scheduler.in_flight:  # the read would wait for the queued pass: after the next step
            self.scheduler.request_drain()
            return
        self._cache_stats_at = time.monotonic()
        s = self.decoder.executor.stats
        if s is None:
            return
        self._cache_stats = {"hits": s.hits, "misses": s.misses, "fetched": s.fetched, "hit_rate": s.hit_rate}

    def gpu_report(self) -> dict[str, object] | None:
        """The GPU cap, how it was split, the measured peak allocation, and the expert cache's counters
        (as of the last refresh); None without --gpu-memory. Safe from any thread."""
        if self.gpu_budget is None:
            return None
        b = self.gpu_budget
        return {"cap_bytes": b.total, "peak_allocated_bytes": torch.cuda.max_memory_allocated(self.opts.device),
                "budget": {"dense": b.dense, "kv": b.kv, "states": b.states, "workspace": b.workspace,
                           "experts": b.experts},
                "expert_cache": dict(self._cache_stats) if self._cache_stats else None}

    def memory_report(self) -> dict[str, object]:
        """GET /v1/memory: the device, its free and total bytes (CUDA), `gpu_report()` (None
        without an expert cache), the pool sizes and `kv_bytes`: bytes per cached token (the
        full-attention layers' KV), per sequence for the sliding-window layers (their rings: fixed
        by the window, whatever the context) and per state slot (rings and recurrent states; each
        running request holds one, each checkpoint one). Safe from any thread."""
        o, cfg = self.opts, self.decoder.cfg
        out: dict[str, object] = {"device": o.device, "gpu_memory": self.gpu_report(),
                                  "pools": {"kv_tokens": o.kv_tokens, "checkpoint_slots": o.checkpoint_slots,
                                            "host_checkpoint_slots": o.host_checkpoint_slots},
                                  "kv_bytes": {"full_per_token": KVPool.bytes_per_slot(cfg, self.dtype),
                                               "sliding_per_sequence": StatePool.ring_bytes_per_slot(cfg, self.dtype),
                                               "state_slot": StatePool.bytes_per_slot(cfg, self.dtype)}}
        if torch.device(self.opts.device).type == "cuda":
            free, total = torch.cuda.mem_get_info(torch.device(self.opts.device))
            out.update(device_free_bytes=free, device_total_bytes=total)
        return out

    def set_gpu_memory(self, total: int) -> dict[str, object]:
        """Rebuilds the GPU expert cache under a new cap (engine/gpu/elastic.py) at the next safe
        point: between two steps, running requests keep their KV cache and states and go on with an
        empty expert cache. ConfigError (nothing changed) for an engine without a cache or a cap too
        small for its fixed parts. Returns the new `memory_report()`."""
        from engine.gpu.elastic import rebuild_expert_cache

        with self._step_lock:  # rebuild_expert_cache refuses an engine without a cache
            self.scheduler.drain()  # no pass may still use the old cache
            self.gpu_budget = rebuild_expert_cache(self.decoder, self.opts, self.dtype, total)
            self._cache_stats, self._cache_stats_at = {}, 0.0
            if torch.device(self.opts.device).type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.opts.device)  # the peak beside the new cap
        return self.memory_report()

    def set_pools(self, kv_tokens: int | None = None, checkpoint_slots: int | None = None,
                  host_checkpoint_slots: int | None = None) -> dict[str, object]:
        """Resizes the KV pool (tokens) and the recurrent-state checkpoint slots (device, host) while
        no request is queued or running (their KV and states live there): every cached prefix and
        checkpoint is dropped. With an expert cache the cap stays and the expert slots take the
        difference. Raises EngineError while busy, ConfigError for a size the cap (or the options'
        rules) cannot take; nothing changes then. Returns the new `memory_report()`."""
        changes = {k: v for k, v in (("kv_tokens", kv_tokens), ("checkpoint_slots", checkpoint_slots),
                                     ("host_checkpoint_slots", host_checkpoint_slots)) if v is not None}
        from engine.gpu.budget import resolve_checkpoint_slots
        from engine.gpu.elastic import rebuild_expert_cache, release_device_memory

        # the options' own checks first; checkpoint_slots -1 is sized for the cap in force
        opts = resolve_checkpoint_slots(self.opts.replace(**changes), self.cfg, self.dtype,
                                        self.gpu_budget.total if self.gpu_budget is not None else 0)

        with self._cv, self._step_lock:
            if self._inbox or self.scheduler.has_work:
                raise EngineError("cannot resize the KV pool or checkpoint slots while requests are queued or running")
            _check_host_room(self.cfg, self.opts, opts, self.dtype)
            experts_first = False
            if self.gpu_budget is not None:
                from engine.gpu.budget import dense_bytes, split_gpu_memory

                banks = self.decoder.weights.experts
                new = split_gpu_memory(self.gpu_budget.total, self.cfg, opts, self.dtype,
                                       dense_bytes(self.decoder.weights, torch.device(opts.device)), banks.expert_bytes)
                # larger pools under the same cap: the expert slots make room before the pools grow
                experts_first = new.experts < self.gpu_budget.experts
                if experts_first:
                    self.gpu_budget = rebuild_expert_cache(self.decoder, opts, self.dtype, self.gpu_budget.total)
            # the old pools go first (a shrink is usually asked for because memory is short); the
            # engine thread is parked on the condition we hold, and other threads read `stats()`
            old_opts = self.opts
            del self.scheduler
            self.decoder.drop_graphs()  # captured passes hold the old pools' tensors
            release_device_memory()
            try:
                self.scheduler = Scheduler(self.decoder, opts, self.dtype)
            except RuntimeError as e:  # torch.OutOfMemoryError on CUDA, an allocator's RuntimeError on the CPU
                release_device_memory()
                self.scheduler = Scheduler(self.decoder, old_opts, self.dtype)
                if experts_first:  # the split of the pools that stay
                    assert self.gpu_budget is not None
                    self.gpu_budget = rebuild_expert_cache(self.decoder, old_opts, self.dtype, self.gpu_budget.total)
                raise ConfigError(f"the new pools could not be allocated on {opts.device} ({e}); the previous "
                                  f"sizes were restored") from None
            self.opts = opts
            self._publish_stats()
            if self.gpu_budget is not None and not experts_first:
                self.gpu_budget = rebuild_expert_cache(self.decoder, opts, self.dtype, self.gpu_budget.total)
        return self.memory_report()

    def follow_free_memory(self, probe: Callable[[], tuple[int, int, int]] | None = None) -> bool:
        """One look at the device's free memory (`probe()` -> (free, reserved, total) bytes; default
        the CUDA device's): rebuilds the expert cache under `follow_target`'s cap when it moved
        enough; True if it did. A cap the fixed parts cannot take is logged, not raised."""
        from engine.gpu.budget import device_memory
        from engine.gpu.elastic import follow_target

        if self.gpu_budget is None:
            return False
        banks = self.decoder.weights.experts
        free, reserved, total = (probe or (lambda: device_memory(self.opts.device)))()
        target = follow_target(self.gpu_budget, banks.expert_bytes, banks.rows, free, reserved, total)
        if target is None:
            return False
        before = self.gpu_budget.total
        try:
            self.set_gpu_memory(target)
        except ConfigError as e:
            log.warning("free GPU memory changed, but the expert cache could not follow: %s", e)
            return False
        log.warning("free GPU memory changed: the engine's cap %.2f -> %.2f GiB (expert cache rebuilt)",
                    before / 2**30, target / 2**30)
        return True

    def _follow_loop(self, every: float) -> None:
        while not self._stop_follow.wait(every):
            try:
                self.follow_free_memory()
            except Exception:  # a failed look must not end the watching
                log.exception("looking at the GPU's free memory failed")


def _pool_bytes(cfg: ModelConfig, opts: EngineOptions, dtype: torch.dtype) -> tuple[int, int]:
    """(bytes on the engine's device, bytes in host memory) of the KV pool and the state slots."""
    state = StatePool.bytes_per_slot(cfg, dtype) if cfg.is_hybrid else 0
    device = KVPool.bytes_per_slot(cfg, dtype) * opts.kv_tokens + state * opts.device_state_slots
    return device, state * opts.host_checkpoint_slots


def _check_host_room(cfg: ModelConfig, old: EngineOptions, new: EngineOptions, dtype: torch.dtype) -> None:
    """ConfigError when the new pools need more host memory than is free now plus what the old ones
    free (a CPU engine's pools are all in host memory): a count far too large is refused before
    anything is dropped, not left to the allocator (or the kernel's OOM killer)."""
    import os

    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # no such figure here: the allocator decides
        return
    on_host = torch.device(new.device).type == "cpu"
    (dev_old, host_old), (dev_new, host_new) = _pool_bytes(cfg, old, dtype), _pool_bytes(cfg, new, dtype)
    need = host_new - host_old + (dev_new - dev_old if on_host else 0)
    if need > free:
        raise ConfigError(f"the new pools need {need / 2**30:.2f} GiB more host memory, {free / 2**30:.2f} GiB are free")


def _apply_process_options(opts: EngineOptions) -> None:
    """What the options set for the whole process: torch's threads, the fused-kernel switches and
    the native executor's settings (engine/moe/native.py)."""
    if opts.threads:
        torch.set_num_threads(opts.threads)
    use_kernels(opts.kernels)
    apply_native_options(opts.native)
