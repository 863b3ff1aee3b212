"""Warm-up: the engine's kernels compiled before the first real request, not during it.

Contract: `warm_up(engine, seed=0)` runs a fixed set of requests of random token ids through
`engine` (idle, nothing queued) and then empties its prefix cache and checkpoints, so it leaves
no cached prefix behind; it returns what it ran: {"requests", "prompt_tokens", "reused_tokens"
(prompt tokens served from the prefix cache and checkpoints), "seconds"}.

On CUDA most of a request's first-time cost is compilation: Triton JIT-compiles each kernel (and a
variant per integer argument that is 1, a multiple of 16 or neither) and autotunes the Gated
DeltaNet kernels the first time a shape is seen, and decode passes are captured into CUDA graphs on
their second step. A coding agent's first requests would pay all of that in their time to first
token (tens of seconds on a Qwen3.6-35B-A3B-shaped model). The set reaches each prefill regime the
engine has: a full `prefill_chunk`-token chunk (the streamed prefill when the expert cache has one,
engine/gpu/prefill.py) and a short tail; prompts that extend a cached prefix by 2, 5 and 8 tokens
(passes small enough for the decode attention kernel, one per split count it takes), a few, a few dozen
(per-layer planning of cache misses) and a few hundred tokens (streamed again), each with lengths on
both sides of the multiple-of-16 specialisation; a fresh prompt of a few hundred; a prompt resumed
from a mid-prompt checkpoint; and several greedy decode steps each (eager, captured, replayed).
Lengths shrink to fit a small KV pool; a pool too small for the first request gets no warm-up.
Prompts are random: the warm-up computes real passes of the real model, only their tokens are
meaningless.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from engine.sampling import SamplingParams

if TYPE_CHECKING:
    from engine.engine import Engine

DECODE_STEPS = 6  # eager, captured, then replayed: every decode-pass graph built once
# passes of 2-8 tokens run the split-K decode attention, whose split count is 32, 16 or 8 there (1 token: 64)
SMALL_APPENDS = (2, 5, 8)


def plan(chunk: int, kv_tokens: int, step_tokens: int) -> tuple[list[tuple[int, int]], int]:
    """The warm-up's requests as (shared prefix length, new tokens), the prefix taken from the first
    request's prompt (a chunk plus a tail), then extensions of it, each kept in its regime; and the
    mid-prompt position the first request checkpoints (off any chunk boundary), which the last
    request resumes from."""
    base_chunk = max(16, min(chunk, (kv_tokens // 4) // 16 * 16))
    tail = max(step_tokens + 3, 11)
    base = base_chunk + tail
    room = kv_tokens - base - DECODE_STEPS - 2
    mid = base_chunk // 2 - 3
    if room < 0:
        return [], mid  # a pool too small for even the first request: no warm-up
    out = [(0, base)]
    for extra in (step_tokens, *SMALL_APPENDS, 45, 96, 304, 333):
        if 0 < extra <= room:
            out.append((base, extra))
    if room >= 333:
        out.append((0, 333))  # a fresh prompt streamed, with no prefix
    if kv_tokens - mid - DECODE_STEPS - 2 >= 200:
        out.append((mid, 200))  # resumed from the checkpoint at `mid`
    return out, mid


def warm_up(engine: Engine, seed: int = 0) -> dict[str, float]:
    t0 = time.monotonic()
    opts = engine.opts
    limit = min(engine.max_model_len, opts.kv_tokens)
    step_tokens = int(getattr(engine.decoder.executor, "step_tokens", 0) or 0)
    requests, mid = plan(opts.prefill_chunk, limit, step_tokens)
    if not requests:
        return {"requests": 0, "prompt_tokens": 0, "reused_tokens": 0, "seconds": time.monotonic() - t0}
    gen = torch.Generator().manual_seed(seed)
    vocab = engine.cfg.vocab_size
    base: list[int] = []  # the first request's prompt, which the others extend
    params = SamplingParams(max_tokens=DECODE_STEPS, ignore_eos=True)
    tokens = reused = 0
    for i, (shared, new) in enumerate(requests):
        prompt = base[:shared] + torch.randint(0, vocab, (new,), generator=gen).tolist()
        checkpoints = [mid, len(prompt)] if i == 0 else None
        handle = engine.submit(prompt, params, checkpoints=checkpoints, session="freetoken-warmup")
        for _ in handle:
            pass
        if handle.error is not None:
            raise handle.error
        tokens += len(prompt)
        reused += handle.cached_tokens
        if i == 0:
            base = prompt
    engine.reset_cache()
    return {"requests": len(requests), "prompt_tokens": tokens, "reused_tokens": reused,
            "seconds": time.monotonic() - t0}
