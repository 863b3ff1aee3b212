"""The one generic MoE decoder, configured per family by `ModelConfig`.

Contract: `Decoder(cfg, weights, executor)`; `forward(batch, kv, states)` runs the embedding, every
layer (mixer by `layer_types`, MLP by `moe_layers`), and the final norm, returning hidden states
[N, H] while updating the KV and state pools for the batch's sequences; `logits(hidden)` applies
the LM head in float32. No family-specific code paths beyond the traits in the config.
Full-attention layers attend over the KV pool, sliding-window layers over each sequence's ring in
the state pool (engine/cache/pools.py), Gated DeltaNet layers carry their state there too.

The layers run in one place, `run(input_ids, meta, kv, states)`, which reads everything about the
pass besides the hidden states from its `PassMeta` (engine/model/batch.py). An eager pass builds
the meta from the batch (`pass_meta`). With `cuda_graphs` set (by the engine) and an executor whose
graph steps can be captured (`capturable`), passes of up to GRAPH_TOKENS tokens (for hybrid models,
one new token per sequence) go through a `DecodeGraphs` per size (engine/model/decode_graph.py),
which captures this same `run` over fixed buffers once and replays it; `graphs` maps each size to
its captured pass. `drop_graphs()` forgets them (the executor's setter does: they hold its kernels).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType

import torch
import torch.nn.functional as F

from engine.cache.pools import KVPool, StatePool, ring_length
from engine.config import FULL_ATTENTION, LINEAR_ATTENTION, ModelConfig
from engine.model.attention import DECODE_ATTENTION_TOKENS, full_attention
from engine.model.batch import ForwardBatch, PassMeta
from engine.model.decode_graph import DecodeGraphs
from engine.model.linear_attention import gated_deltanet
from engine.model.mla import decode_kernel_serves, mla_attention
from engine.model.moe import feed_forward
from engine.model.ops import Rotary, embed_tokens, rms_norm
from engine.moe.base import ExpertExecutor
from engine.weights.layout import DecoderWeights

GRAPH_TOKENS = DECODE_ATTENTION_TOKENS  # passes of up to this many tokens may run through decode graphs


class Decoder:
    def __init__(self, cfg: ModelConfig, weights: DecoderWeights, executor: ExpertExecutor) -> None:
        self.cfg = cfg
        self.weights = weights
        self._graphs: dict[int, DecodeGraphs] = {}
        self._executor = executor
        self.rotary = Rotary(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
        # Position of each layer within its pool (KV pools hold only full-attention layers, the
        # state pool the recurrent layers' states and the sliding-window layers' rings).
        self._kv_index = {li: i for i, li in enumerate(cfg.full_attention_layer_ids)}
        self._state_index = {li: i for i, li in enumerate(cfg.linear_attention_layer_ids)}
        self._ring_index = {li: i for i, li in enumerate(cfg.sliding_attention_layer_ids)}
        self._ring = ring_length(cfg)
        self._recurrent = cfg.is_hybrid  # per-sequence state: one new token per sequence in a graph
        # MLA shapes the latent decode kernel does not take attend per sequence: no decode graphs
        self._eager_only = cfg.attention_kind == "mla" and not decode_kernel_serves(cfg)
        # decode-sized passes through CUDA graphs (engine/model/decode_graph.py), when the engine
        # turns it on and the executor can be captured
        self.cuda_graphs = False

    @property
    def executor(self) -> ExpertExecutor:
        return self._executor

    @executor.setter
    def executor(self, executor: ExpertExecutor) -> None:
        self._executor = executor
        self.drop_graphs()  # captured passes hold the old executor's kernels

    @property
    def graphs(self) -> Mapping[int, DecodeGraphs]:
        """The captured passes so far, by token count."""
        return MappingProxyType(self._graphs)

    def drop_graphs(self) -> None:
        """Forgets every captured decode pass (they hold the executor's and the pools' tensors): the
        next decode steps capture anew."""
        self._graphs.clear()

    @property
    def device(self) -> torch.device:
        """Where the pass computes (the embedding may live in host memory: engine/gpu/setup.py)."""
        return self.weights.final_norm.device

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: KVPool, states: StatePool) -> torch.Tensor:
        graph = self._graph_for(batch)
        if graph is not None:
            self.executor.begin_forward(0)
            return graph.forward(batch, kv, states)
        self.executor.begin_forward(batch.num_tokens * self.cfg.top_k)
        return self.run(batch.input_ids, self.pass_meta(batch), kv, states)

    def _graph_for(self, batch: ForwardBatch) -> DecodeGraphs | None:
        n = batch.num_tokens
        if not self.cuda_graphs or self._eager_only or not 0 < n <= GRAPH_TOKENS:
            return None
        graph = self._graphs.get(n)
        if graph is None and self.executor.capturable(n):
            graph = self._graphs[n] = DecodeGraphs(self.run, self.rotary, self._recurrent, n, self.weights.embed.dtype,
                                                   self.device, self.cfg.hidden_size)
        return graph if graph is not None and graph.accepts(batch) else None

    def pass_meta(self, batch: ForwardBatch) -> PassMeta:
        """The meta of an eager pass over `batch`: the split-K decode attention's device-side lengths
        for a decode-sized pass on CUDA, the state slots when every sequence has one new token."""
        dev = self.device
        decode = ring = None
        attends = self._kv_index or self._ring_index
        if dev.type == "cuda" and batch.num_tokens <= DECODE_ATTENTION_TOKENS and attends and not self._eager_only:
            decode, ring = self.kernel_metas(batch)
        slots = None
        if self._recurrent and all(s.length == 1 for s in batch.seqs):
            slots = batch.state_slots(dev)
        return PassMeta(batch.positions, batch.position_limit, batch, decode, slots, ring=ring)

    def kernel_metas(self, batch: ForwardBatch) -> tuple[object, object]:
        """The split-K decode kernel's tables for `batch`: over the KV pool, and over the rings
        (None without sliding-window layers)."""
        from engine.model.decode_attention import DecodeMeta  # triton: CUDA only

        dev = self.device
        ring = None
        if self._ring_index:
            if all(s.length == 1 for s in batch.seqs):
                slots = batch.state_slots(dev)  # made once per batch: the pass meta's too
            else:
                slots = torch.tensor([s.state_slot for s in batch.seqs for _ in range(s.length)]).to(dev)
            ring = DecodeMeta.for_ring(batch.positions, slots, self._ring)
        return DecodeMeta.build(batch, dev), ring

    def run(self, input_ids: torch.Tensor, meta: PassMeta, kv: KVPool, states: StatePool) -> torch.Tensor:
        """The forward pass itself: [N] token ids -> final hidden states [N, H]."""
        cfg, w = self.cfg, self.weights
        if self._ring_index and meta.decode is not None and meta.ring is None:
            # a captured pass (one token per sequence): the rings' table from its own buffers
            from engine.model.decode_attention import DecodeMeta  # triton: CUDA only

            assert meta.state_slots is not None
            meta = dataclasses.replace(meta, ring=DecodeMeta.for_ring(meta.positions, meta.state_slots, self._ring))
        h = embed_tokens(input_ids, w.embed)
        eps, zc = cfg.rms_norm_eps, cfg.norm_zero_centered
        for li, lw in enumerate(w.layers):
            x = rms_norm(h, lw.input_norm, eps, zc)
            kind = cfg.layer_types[li]
            if kind == FULL_ATTENTION:
                ki = self._kv_index[li]
                if lw.mla is not None:
                    x = mla_attention(x, lw.mla, cfg, self.rotary, meta, kv.k[ki])
                else:
                    assert lw.attention is not None
                    x = full_attention(x, lw.attention, cfg, self.rotary, meta, kv.k[ki], kv.v[ki])
            elif kind != LINEAR_ATTENTION:  # sliding window: the sequence's ring in the state pool
                assert lw.attention is not None
                k_rows, v_rows = states.ring_rows(self._ring_index[li])
                x = full_attention(x, lw.attention, cfg, self.rotary, meta, k_rows, v_rows, cfg.sliding_window,
                                   self._ring)
            else:
                assert lw.linear_attention is not None
                si = self._state_index[li]
                x = gated_deltanet(x, lw.linear_attention, cfg, meta, states.conv[si], states.ssm[si])
            h = feed_forward(h, x, lw, cfg, self.executor, meta.captured)
        return rms_norm(h, w.final_norm, eps, zc)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weights.lm_head).float()
