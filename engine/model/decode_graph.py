"""Decode-sized forward passes replayed from one CUDA graph each.

Contract: `DecodeGraphs(decoder, tokens)` runs `forward(batch, kv, states)` for the batches it
`accepts`: exactly `tokens` tokens (any mix of sequences; for a model with Gated DeltaNet layers,
one new token per sequence), with the decoder's results. The whole pass is one CUDA graph, captured
on its second call and replayed afterwards: the embedding, and per layer the attention inputs
(projections, norms, rotary), the attention core (KV write and split-K attention over the
device-side lengths of engine/model/decode_attention.py) or the Gated DeltaNet step (conv window
and recurrent state read and written through device-side state slots), the output projection, the
residuals and norms, the router, the routed experts (the expert cache's device step,
engine/gpu/device_step.py: cache plan, fetch, GPU experts, the CPU branch's doorbell), the shared
expert, and the final norm. Before each replay the step's token ids, positions, new KV slots, KV
slot table, lengths and state slots are copied into fixed buffers; nothing in the pass reads the
device from the host, and no Python runs per layer.

The rotary tables, the KV pool and the state pool are captured by reference: when the tables grow
(a longer sequence than any before) or another pool comes, the graph is dropped and captured again.
`usable(decoder, tokens)` says whether the decoder can run this way: an expert executor whose
decode step can be enqueued inside a capture (`supports_graph_step(tokens)`, then `graph_step(x,
ids, weights, moe_index)`) or whose call is capture-safe as it is (`capture_safe`). Off CUDA the
same pass runs eagerly with the plain attention core and nothing is captured (how the CPU tests
check that it computes what the plain pass does).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from engine.cache.pools import KVPool, StatePool
from engine.config import FULL_ATTENTION
from engine.graphs import GraphCache
from engine.model.attention import attention_core, attention_inputs, attention_output
from engine.model.batch import ForwardBatch
from engine.model.linear_attention import gated_deltanet_decode
from engine.model.moe import feed_forward
from engine.model.ops import embed_tokens, rms_norm

if TYPE_CHECKING:
    from engine.model.decode_attention import DecodeMeta
    from engine.model.decoder import Decoder


def usable(decoder: Decoder, tokens: int) -> bool:
    ex = decoder.executor
    supports = getattr(ex, "supports_graph_step", None)
    return (supports is not None and supports(tokens)) or getattr(ex, "capture_safe", False)


class _PassExperts:
    """The routed experts as the captured pass calls them: the executor's capture-safe decode step
    when it has one (`graph_step`), else its plain call; `with_side_work` queues other work that
    needs only x (the shared expert) inside that step, while the GPU would wait for the CPU branch
    or the fetch (`graph_step_with_side`), else runs it after."""

    def __init__(self, decoder: Decoder) -> None:
        self.d = decoder  # read at call time: a benchmark swaps the executor for its dense pass

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, moe_index: int) -> torch.Tensor:
        ex = self.d.executor
        step = getattr(ex, "graph_step", None)
        return step(x, ids, weights, moe_index) if step is not None else ex(x, ids, weights, moe_index)

    def with_side_work(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, moe_index: int,
                       side: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        step = getattr(self.d.executor, "graph_step_with_side", None)
        if step is not None:
            return step(x, ids, weights, moe_index, side)
        return self(x, ids, weights, moe_index), side()


class DecodeGraphs:
    def __init__(self, decoder: Decoder, tokens: int) -> None:
        self.d = decoder
        self._experts = _PassExperts(decoder)
        cfg, w = decoder.cfg, decoder.weights
        self.tokens = n = tokens
        dev = w.final_norm.device  # the embedding may live in host memory (engine/gpu/setup.py)
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.state_slots = torch.zeros(n, dtype=torch.long, device=dev)
        self.final = torch.zeros(n, cfg.hidden_size, dtype=w.embed.dtype, device=dev)
        self.recurrent = any(t != FULL_ATTENTION for t in cfg.layer_types)
        self.limit = 1  # rotary table size the captured pass was built with
        self.capture = dev.type == "cuda"
        self._graph = GraphCache(f"decode pass ({tokens} tokens)", enabled=self.capture)
        self._rotary_version = -1
        self._kv: KVPool | None = None
        self._states: StatePool | None = None
        self._meta: DecodeMeta | None = None  # CUDA: the device-side lengths the captured attention reads
        self._batch: ForwardBatch | None = None  # off CUDA: the batch the eager attention core walks
        self.steps = 0  # passes run

    def accepts(self, batch: ForwardBatch) -> bool:
        return batch.num_tokens == self.tokens and (not self.recurrent or all(s.length == 1 for s in batch.seqs))

    # ------------------------------------------------------------------ the captured pass
    def _attention(self, li: int, x: torch.Tensor) -> torch.Tensor:
        d = self.d
        lw = d.weights.layers[li]
        assert lw.attention is not None and self._kv is not None
        q, k, v, gate = attention_inputs(x, lw.attention, d.cfg, d.rotary, self.positions, self.limit)
        ki = d._kv_index[li]
        k_cache, v_cache = self._kv.k[ki], self._kv.v[ki]
        if self._meta is not None:
            from engine.model.decode_attention import decode_attention  # triton: CUDA only

            o = decode_attention(q, k, v, k_cache, v_cache, self._meta, d.cfg.sliding_window, d.cfg.head_dim**-0.5)
        else:
            assert self._batch is not None
            o = attention_core(q, k, v, d.cfg, self._batch, k_cache, v_cache)
        return attention_output(o, gate, lw.attention)


    def _pass(self) -> None:
        d = self.d
        cfg, w = d.cfg, d.weights
        eps, zc = cfg.rms_norm_eps, cfg.norm_zero_centered
        h = embed_tokens(self.input_ids, w.embed)
        for li, lw in enumerate(w.layers):
            x = rms_norm(h, lw.input_norm, eps, zc)
            if cfg.layer_types[li] == FULL_ATTENTION:
                x = self._attention(li, x)
            else:
                assert lw.linear_attention is not None and self._states is not None
                si = d._state_index[li]
                x = gated_deltanet_decode(x, lw.linear_attention, cfg, self.state_slots, self._states.conv[si],
                                          self._states.ssm[si])
            h = feed_forward(h, x, lw, cfg, self._experts)
        self.final.copy_(rms_norm(h, w.final_norm, eps, zc))

    # ------------------------------------------------------------------ one step
    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: KVPool, states: StatePool) -> torch.Tensor:
        d = self.d
        if not self.accepts(batch):
            raise ValueError(f"this graph serves {self.tokens} tokens"
                             f"{', one per sequence' if self.recurrent else ''}; the batch does not fit")
        # the rotary tables are sized ahead (doubling), and the pass is recaptured when they grow
        limit = max(batch.position_limit, self.limit)
        d.rotary.prepare(limit, self.final.device, self.final.dtype)
        if d.rotary.version != self._rotary_version or kv is not self._kv or states is not self._states:
            self._graph.clear()
            self._rotary_version = d.rotary.version
            self.limit = d.rotary.size
            self._kv, self._states = kv, states
            if self.capture:
                from engine.model.decode_attention import DecodeMeta  # triton: CUDA only

                self._meta = DecodeMeta.empty(self.tokens, kv.k.shape[1], self.final.device)
        streamer = getattr(d.executor, "streamer", None)
        if streamer is not None and streamer.active:  # a large forward stopped midway
            streamer.finish()
        self.input_ids.copy_(batch.input_ids)
        self.positions.copy_(batch.positions)
        if self.recurrent:
            self.state_slots.copy_(batch.state_slots(self.state_slots.device))
        if self._meta is not None:
            self._meta.fill(batch)
        self._batch = batch
        self._graph.run(0, self._pass)
        self._batch = None
        self.steps += 1
        return self.final.clone()

    # ------------------------------------------------------------------ staged steps
    def replayable(self, kv: KVPool, states: StatePool) -> bool:
        """`forward_staged` may run: the pass is captured (off CUDA: has run) for these pools and
        the current rotary tables, so nothing is rebuilt, read or captured on the host."""
        ready = self._graph.captured == 1 if self.capture else self.steps > 0
        return (ready and self._kv is kv and self._states is states
                and self.d.rotary.version == self._rotary_version)

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
        if meta is not None:
            from engine.model.decode_staging import stage_pass  # triton: CUDA only

            stage_pass(staged, ids, self.input_ids, self.positions, meta.new_slots, meta.lengths, meta.table)
        else:
            self.input_ids.copy_(ids)
            self.positions.copy_(staged[0])
        self._batch = batch
        self._graph.run(0, self._pass)
        self._batch = None
        self.steps += 1
        return self.final

    @property
    def captured(self) -> int:
        return self._graph.captured
