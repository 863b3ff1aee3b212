"""Decode-sized forward passes replayed from one CUDA graph each.

Contract: `DecodeGraphs(run, rotary, recurrent, tokens, dtype, device, hidden)` serves the batches it
`accepts`: exactly `tokens` tokens (any mix of sequences; with `recurrent` layers, one new token per
sequence). `forward(batch, kv, states)` copies the step's token ids, positions, KV slots, KV slot
table, lengths and state slots into fixed buffers and runs `run` (the decoder's one forward pass,
engine/model/decoder.py) over them with a `PassMeta` that names those buffers and `captured` set:
eagerly the first time (kernels compile, lazy state settles), captured into one CUDA graph the
second, replayed afterwards (engine/graphs.py). The whole pass is the graph: the embedding, every
layer (attention through the split-K decode kernel, engine/model/decode_attention.py; the Gated
DeltaNet step through device-side state slots; the routed experts as the executor's graph steps,
the shared expert as their side work), and the final norm. Nothing in it reads the device from the
host, and no Python runs per layer on replay. The result is `run`'s on the same batch.

The rotary tables, the KV pool and the state pool are captured by reference: when the tables grow
(a longer sequence than any before) or another pool comes, the graph is dropped and captured again.
Off CUDA the same pass runs eagerly with the per-sequence attention core over the batch and nothing
is captured (how the CPU tests check that it computes what the plain pass does).
`forward_staged` replays the pass for the next step of the same sequences without the host
(engine/decode_pipeline.py); `replayable` says when it may.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.cache.pools import KVPool, StatePool
from engine.graphs import GraphCache
from engine.model.batch import ForwardBatch, PassMeta
from engine.model.ops import Rotary

PassFn = Callable[[torch.Tensor, PassMeta, KVPool, StatePool], torch.Tensor]


class DecodeGraphs:
    def __init__(self, run: PassFn, rotary: Rotary, recurrent: bool, tokens: int, dtype: torch.dtype,
                 device: torch.device, hidden: int) -> None:
        self._run = run
        self.rotary = rotary
        self.tokens = n = tokens
        self.recurrent = recurrent
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.state_slots = torch.zeros(n, dtype=torch.long, device=device)
        self.final = torch.zeros(n, hidden, dtype=dtype, device=device)
        self.limit = 1  # rotary table size the captured pass was built with
        self.capture = device.type == "cuda"
        self._graph = GraphCache(f"decode pass ({tokens} tokens)", enabled=self.capture)
        self._rotary_version = -1
        self._kv: KVPool | None = None
        self._states: StatePool | None = None
        self._meta = PassMeta(self.positions, self.limit, state_slots=self.state_slots if recurrent else None,
                              captured=True)
        self.steps = 0  # passes run

    def accepts(self, batch: ForwardBatch) -> bool:
        return batch.num_tokens == self.tokens and (not self.recurrent or all(s.length == 1 for s in batch.seqs))

    def _pass(self) -> None:
        assert self._kv is not None and self._states is not None
        self.final.copy_(self._run(self.input_ids, self._meta, self._kv, self._states))

    # ------------------------------------------------------------------ one step
    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: KVPool, states: StatePool) -> torch.Tensor:
        if not self.accepts(batch):
            raise ValueError(f"this graph serves {self.tokens} tokens"
                             f"{', one per sequence' if self.recurrent else ''}; the batch does not fit")
        # the rotary tables are sized ahead (doubling), and the pass is recaptured when they grow
        limit = max(batch.position_limit, self.limit)
        self.rotary.prepare(limit, self.final.device, self.final.dtype)
        meta = self._meta
        if self.rotary.version != self._rotary_version or kv is not self._kv or states is not self._states:
            self._graph.clear()
            self._rotary_version = self.rotary.version
            self.limit = meta.limit = self.rotary.size
            self._kv, self._states = kv, states
            if self.capture:
                from engine.model.decode_attention import DecodeMeta  # triton: CUDA only

                meta.decode = DecodeMeta.empty(self.tokens, kv.k.shape[1], self.final.device)
        self.input_ids.copy_(batch.input_ids)
        self.positions.copy_(batch.positions)
        if self.recurrent:
            self.state_slots.copy_(batch.state_slots(self.state_slots.device))
        if meta.decode is not None:
            meta.decode.fill(batch)
        meta.batch = batch
        self._graph.run(0, self._pass)
        meta.batch = None
        self.steps += 1
        return self.final.clone()

    # ------------------------------------------------------------------ staged steps
    def replayable(self, kv: KVPool, states: StatePool) -> bool:
        """`forward_staged` may run: the pass is captured (off CUDA: has run) for these pools and
        the current rotary tables, so nothing is rebuilt, read or captured on the host."""
        ready = self._graph.captured == 1 if self.capture else self.steps > 0
        return (ready and self._kv is kv and self._states is states
                and self.rotary.version == self._rotary_version)

    @torch.inference_mode()
    def forward_staged(self, ids: torch.Tensor, staged: torch.Tensor, batch: ForwardBatch | None = None) -> torch.Tensor:
        """The pass after the previous one for the same sequences in the same rows
        (engine/decode_pipeline.py): `ids` [n] the tokens on the device (the previous pass's draws),
        `staged` [2, n] each row's position and new KV slot, in page-locked memory on CUDA (read by
        a kernel, engine/model/decode_staging.py: no copy engine involved). Each row's KV table gains
        its new slot in place (the rows keep the slots the pass before wrote); the state slots are
        the previous pass's. Positions must lie below `limit`. Off CUDA `batch` (the same sequences)
        drives the eager attention core. Only queued device work: nothing is read. Returns the final
        hidden states buffer itself, which the next pass overwrites in stream order."""
        meta = self._meta
        decode = meta.decode
        if decode is not None:
            from engine.model.decode_staging import stage_pass  # triton: CUDA only

            stage_pass(staged, ids, self.input_ids, self.positions, decode.new_slots, decode.lengths, decode.table)
        else:
            self.input_ids.copy_(ids)
            self.positions.copy_(staged[0])
        meta.batch = batch
        self._graph.run(0, self._pass)
        meta.batch = None
        self.steps += 1
        return self.final

    @property
    def captured(self) -> int:
        return self._graph.captured
