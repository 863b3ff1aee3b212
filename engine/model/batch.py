"""The forward context of one engine step: ragged sequences flattened into one token batch.

Contract: `ForwardBatch` lists, per sequence, where its new tokens sit in the flat batch, how many
of its tokens are already cached, the KV slot of every token (cached and new), its recurrent state
slot and the cuts: positions inside the new tokens whose recurrent state is also kept, each in a
slot of its own (checkpoints taken inside one pass instead of a pass ending at each). Filled by the
scheduler; read by the decoder. `PassMeta` is what the layers of one forward pass read besides the
hidden states (positions, rotary limit, and per kind of layer the form its mix across tokens takes):
made from a `ForwardBatch` for a pass that runs eagerly, or over the fixed buffers of a captured
pass (engine/model/decode_graph.py). Layers that mix across tokens walk `batch.seqs` when the meta
names no device-side form; everything else runs on the flat batch.
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
    # (offset, slot) ascending, 0 < offset < length: the recurrent state after the first `offset`
    # new tokens is also written to state slot `slot` (a checkpoint inside the chunk)
    cuts: tuple[tuple[int, int], ...] = ()

    @property
    def end(self) -> int:
        return self.start + self.length

    def pieces(self) -> list[tuple[int, int, int]]:
        """The new tokens as (start, end, save_to) in the flat batch, split at the cuts: each piece
        but the last saves the state after it into its cut's slot (-1: no save)."""
        out, a = [], self.start
        for offset, slot in self.cuts:
            out.append((a, self.start + offset, slot))
            a = self.start + offset
        out.append((a, self.end, -1))
        return out


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]
    seqs: list[SeqEntry]
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


@dataclass
class PassMeta:
    positions: torch.Tensor  # [N] long, each token's position
    limit: int  # > every position, known on the host: the rotary tables cover it
    batch: ForwardBatch | None = None  # the sequences the eager attention core and chunked DeltaNet walk
    # full attention through the split-K decode kernel: engine/model/decode_attention.py's DecodeMeta
    # (device-side KV table and lengths), or None for the per-sequence core over `batch`
    decode: Any = None
    state_slots: torch.Tensor | None = None  # [N] one new token per sequence: each one's recurrent state slot
    captured: bool = False  # captured whole: the routed experts run as the executor's graph steps
    ring: Any = None  # with `decode`, the sliding-window layers' DecodeMeta over their rings (DecodeMeta.for_ring)
