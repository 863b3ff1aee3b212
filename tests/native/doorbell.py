"""The GPU's side of the doorbell (native/src/poller.h), played from Python on plain memory for the
native tests: page-locked words are only needed where a GPU writes them."""

from __future__ import annotations

import time

import torch


def doorbell_words(n: int = 2) -> torch.Tensor:
    """n int32 words that HostTask.serve_doorbell accepts on a machine without CUDA."""
    words = torch.zeros(n, dtype=torch.int32)
    words.is_pinned = lambda: True  # type: ignore[method-assign]
    return words


def ring_and_wait(words: torch.Tensor, timeout: float = 5.0) -> bool:
    """words[0] = 1 (the stream write), then wait for the poller's words[1] = 1 and clear it (the
    stream wait and its write back); False if no answer came in time."""
    words[0] = 1
    deadline = time.monotonic() + timeout
    while int(words[1]) != 1 and time.monotonic() < deadline:
        time.sleep(0.0005)
    answered = int(words[1]) == 1
    words[1] = 0
    return answered


def wait_word(word: torch.Tensor, timeout: float = 5.0) -> bool:
    """Wait for word[0] == 1 (what a stream wait on the copier's word does); False on timeout."""
    deadline = time.monotonic() + timeout
    while int(word[0]) != 1 and time.monotonic() < deadline:
        time.sleep(0.0005)
    return int(word[0]) == 1
