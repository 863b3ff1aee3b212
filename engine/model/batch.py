"""The forward context of one engine step: ragged sequences flattened into one token batch.

Contract: `ForwardBatch` lists, per sequence, where its new tokens sit in the flat batch, how many
of its tokens are already cached, the KV slot of every token (cached and new) and its recurrent
state slot. Layers that mix across tokens (attention, Gated DeltaNet) walk `seqs`; everything else
runs on the flat batch. Filled by the scheduler; read by the decoder.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class SeqEntry:
    start: int  # offset of this sequence's new tokens in the flat batch
    length: int  # new tokens this step
    cached_len: int  # tokens already in the KV cache / recurrent state
    kv_slots: torch.Tensor  # [cached_len + length] long, KV slot of every token so far
    state_slot: int = -1  # recurrent state slot (hybrid models)

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]
    seqs: list[SeqEntry]
    # decode-sized batches on CUDA: the device-side lengths of engine/model/decode_attention.py,
    # built by the first attention layer of the pass and shared by the others
    decode_meta: Any = None
    _state_slots: torch.Tensor | None = field(default=None, repr=False)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def position_limit(self) -> int:
        """One past the largest position in the batch, known on the host (no device read)."""
        return max((s.cached_len + s.length for s in self.seqs), default=1)

    def state_slots(self, device: torch.device) -> torch.Tensor:
        """Each sequence's recurrent state slot as a long tensor on `device`, made once per batch
        (every Gated DeltaNet layer of the pass reads it)."""
        if self._state_slots is None or self._state_slots.device != device:
            self._state_slots = torch.tensor([s.state_slot for s in self.seqs], dtype=torch.long).to(device)
        return self._state_slots

    def last_token_index(self) -> torch.Tensor:
        return torch.tensor([s.end - 1 for s in self.seqs], dtype=torch.long, device=self.input_ids.device)
