"""Decode-sized forward passes replayed from CUDA graphs, with only the Gated DeltaNet mixes eager.

Contract: `DecodeGraphs(decoder, tokens)` runs `forward(batch, kv, states)` for batches of exactly
`tokens` tokens (any mix of sequences), with the decoder's results. The pass is cut into runs at
the linear-attention (Gated DeltaNet) layers, whose mix runs eagerly; everything else is captured,
one CUDA graph per run (captured on the run's second call, replayed afterwards): the embedding,
and per layer the attention inputs (projections, norms, rotary), the attention core (KV write and
split-K attention over the device-side lengths of engine/model/decode_attention.py), the output
projection, the residual, the norms, the router, the routed experts (the expert cache's device step,
engine/gpu/device_step.py, enqueued inside the graph: cache plan, fetch, GPU experts, the CPU
branch's doorbell), the shared expert, and the final norm. A model with full attention only
(Qwen3-MoE) is one graph replay per step; before it, the step's token ids, positions, new KV slots,
KV slot table and lengths are copied into fixed buffers, and nothing in the pass reads the device
from the host.

The rotary tables and the KV pool are captured by reference: when the tables grow (a longer
sequence than any before) or another pool comes, the graphs are dropped and captured again.
`usable(decoder, tokens)` says whether the decoder can run this way: an expert executor whose
decode step can be enqueued inside a capture (`supports_graph_step(tokens)`, then `graph_step(x,
ids, weights, moe_index)`) or whose call is capture-safe as it is (`capture_safe`). Off CUDA the
same runs execute eagerly with the plain attention core, nothing is captured (how the CPU tests
check that the segmented pass computes what the plain one does).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from engine.cache.pools import KVPool, StatePool
from engine.config import FULL_ATTENTION
from engine.graphs import GraphCache
from engine.model.attention import attention_core, attention_inputs, attention_output
from engine.model.batch import ForwardBatch
from engine.model.linear_attention import gated_deltanet
from engine.model.moe import route
from engine.model.ops import rms_norm, swiglu_mlp

if TYPE_CHECKING:
    from engine.model.decode_attention import DecodeMeta
    from engine.model.decoder import Decoder


def usable(decoder: Decoder, tokens: int) -> bool:
    ex = decoder.executor
    supports = getattr(ex, "supports_graph_step", None)
    return (supports is not None and supports(tokens)) or getattr(ex, "capture_safe", False)


def runs_of(layer_types: list[str]) -> list[tuple[int | None, tuple[int, ...]]]:
    """The pass cut at linear-attention layers: (the layer whose mix runs eagerly before the run, or
    None for the first run, which starts with the embedding; the layers whose segments it holds)."""
    runs: list[tuple[int | None, tuple[int, ...]]] = []
    mix: int | None = None
    layers: list[int] = []
    for li, kind in enumerate(layer_types):
        if kind != FULL_ATTENTION:
            runs.append((mix, tuple(layers)))
            mix, layers = li, []
        layers.append(li)
    runs.append((mix, tuple(layers)))
    return runs


class DecodeGraphs:
    def __init__(self, decoder: Decoder, tokens: int) -> None:
        self.d = decoder
        cfg, w = decoder.cfg, decoder.weights
        self.tokens = n = tokens
        dev, dtype = w.embed.device, w.embed.dtype
        hd = cfg.head_dim
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.h = torch.zeros(n, cfg.hidden_size, dtype=dtype, device=dev)
        self.xn = torch.zeros(n, cfg.hidden_size, dtype=dtype, device=dev)  # input of a linear-attention layer
        self.mix = torch.zeros(n, cfg.hidden_size, dtype=dtype, device=dev)  # its output
        self.q = torch.zeros(n, cfg.num_heads, hd, dtype=dtype, device=dev)
        self.k = torch.zeros(n, cfg.num_kv_heads, hd, dtype=dtype, device=dev)
        self.v = torch.zeros(n, cfg.num_kv_heads, hd, dtype=dtype, device=dev)
        self.gate = torch.zeros(n, cfg.num_heads * hd, dtype=dtype, device=dev) if cfg.attn_output_gate else None
        self.o = torch.zeros(n, cfg.num_heads * hd, dtype=dtype, device=dev)
        self.final = torch.zeros(n, cfg.hidden_size, dtype=dtype, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.limit = 1  # rotary table size the captured runs were built with
        self.runs = runs_of(cfg.layer_types)
        self.capture = dev.type == "cuda"
        self._graphs = GraphCache(f"decode run ({tokens} tokens)", enabled=self.capture)
        self._rotary_version = -1
        self._kv: KVPool | None = None
        self._meta: DecodeMeta | None = None  # CUDA: the device-side lengths the captured attention reads
        self._batch: ForwardBatch | None = None  # off CUDA: the batch the eager attention core walks
    # ------------------------------------------------------------------ the per-token segments
    def _inputs_of(self, li: int, xn: torch.Tensor) -> None:
        """Writes what layer li's mix needs, from its normed input."""
        d = self.d
        lw = d.weights.layers[li]
        if d.cfg.layer_types[li] == FULL_ATTENTION:
            assert lw.attention is not None
            q, k, v, gate = attention_inputs(xn, lw.attention, d.cfg, d.rotary, self.positions, self.limit)
            self.q.copy_(q)
            self.k.copy_(k)
            self.v.copy_(v)
            if gate is not None:
                assert self.gate is not None
                self.gate.copy_(gate)
        else:
            self.xn.copy_(xn)

    def _segment(self, li: int) -> None:
        """From the end of layer li's mix to the start of layer li+1's (or the final norm)."""
        d = self.d
        cfg, w = d.cfg, d.weights
        lw = w.layers[li]
        eps, zc = cfg.rms_norm_eps, cfg.norm_zero_centered
        if cfg.layer_types[li] == FULL_ATTENTION:
            assert lw.attention is not None
            x = attention_output(self.o, self.gate, lw.attention)
        else:
            x = self.mix
        h = self.h + x
        x = rms_norm(h, lw.post_norm, eps, zc)
        if lw.moe is not None:
            ids, weights = route(x, lw.moe.router, cfg.top_k, cfg.norm_topk_prob)
            out = self._experts(x, ids, weights, lw.moe_index)
            if lw.moe.shared is not None:
                sh = lw.moe.shared
                assert lw.moe.shared_gate is not None
                out = out + torch.sigmoid(F.linear(x, lw.moe.shared_gate)) * swiglu_mlp(
                    x, sh.gate_proj, sh.up_proj, sh.down_proj)
            x = out
        else:
            assert lw.mlp is not None
            x = swiglu_mlp(x, lw.mlp.gate_proj, lw.mlp.up_proj, lw.mlp.down_proj)
        h = h + x
        self.h.copy_(h)
        if li + 1 < len(w.layers):
            self._inputs_of(li + 1, rms_norm(h, w.layers[li + 1].input_norm, eps, zc))
        else:
            self.final.copy_(rms_norm(h, w.final_norm, eps, zc))

    def _experts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, moe_index: int) -> torch.Tensor:
        ex = self.d.executor
        step = getattr(ex, "graph_step", None)
        if step is not None:
            return step(x, ids, weights, moe_index)
        return ex(x, ids, weights, moe_index)

    def _core(self, li: int) -> None:
        """Layer li's attention core: KV write and attention, into self.o."""
        d = self.d
        assert self._kv is not None
        ki = d._kv_index[li]
        k_cache, v_cache = self._kv.k[ki], self._kv.v[ki]
        if self._meta is not None:
            from engine.model.decode_attention import decode_attention  # triton: CUDA only

            o = decode_attention(self.q, self.k, self.v, k_cache, v_cache, self._meta, d.cfg.sliding_window,
                                 d.cfg.head_dim**-0.5)
        else:
            assert self._batch is not None
            o = attention_core(self.q, self.k, self.v, d.cfg, self._batch, k_cache, v_cache)
        self.o.copy_(o)

    def _run(self, r: int) -> None:
        """Run r: the embedding (first run), then per layer its attention core (full attention) and
        its segment."""
        d = self.d
        cfg, w = d.cfg, d.weights
        if r == 0:
            h = F.embedding(self.input_ids, w.embed)
            self.h.copy_(h)
            if w.layers:
                self._inputs_of(0, rms_norm(h, w.layers[0].input_norm, cfg.rms_norm_eps, cfg.norm_zero_centered))
        for li in self.runs[r][1]:
            if cfg.layer_types[li] == FULL_ATTENTION:
                self._core(li)
            self._segment(li)

    # ------------------------------------------------------------------ the pass
    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: KVPool, states: StatePool) -> torch.Tensor:
        d = self.d
        cfg, w = d.cfg, d.weights
        if batch.num_tokens != self.tokens:
            raise ValueError(f"these graphs serve {self.tokens} tokens, the batch has {batch.num_tokens}")
        # the rotary tables are sized ahead (doubling), and the runs are recaptured when they grow
        limit = max(batch.position_limit, self.limit)
        d.rotary.prepare(limit, self.h.device, self.h.dtype)
        if d.rotary.version != self._rotary_version or kv is not self._kv:
            self._graphs.clear()
            self._rotary_version = d.rotary.version
            self.limit = d.rotary.size
            self._kv = kv
            if self.capture:
                from engine.model.decode_attention import DecodeMeta  # triton: CUDA only

                self._meta = DecodeMeta.empty(self.tokens, kv.k.shape[1], self.h.device)
        streamer = getattr(d.executor, "streamer", None)
        if streamer is not None and streamer.active:  # a large forward stopped midway
            streamer.finish()
        self.input_ids.copy_(batch.input_ids)
        self.positions.copy_(batch.positions)
        if self._meta is not None:
            self._meta.fill(batch)
        self._batch = batch
        for r, (mix, _) in enumerate(self.runs):
            if mix is not None:
                lw = w.layers[mix]
                assert lw.linear_attention is not None
                si = d._state_index[mix]
                self.mix.copy_(gated_deltanet(self.xn, lw.linear_attention, cfg, batch, states.conv[si],
                                              states.ssm[si]))
            self._graphs.run(r, lambda r=r: self._run(r))  # type: ignore[misc]
        self._batch = None
        return self.final.clone()

    @property
    def captured(self) -> int:
        return self._graphs.captured
