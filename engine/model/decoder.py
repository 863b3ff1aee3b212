"""The one generic MoE decoder, configured per family by `ModelConfig`.

Contract: `Decoder(cfg, weights, executor)`; `forward(batch, kv, states)` runs the embedding, every
layer (mixer by `layer_types`, MLP by `moe_layers`), and the final norm, returning hidden states
[N, H] while updating the KV and state pools for the batch's sequences; `logits(hidden)` applies
the LM head in float32. No family-specific code paths beyond the traits in the config. With
`cuda_graphs` set (by the engine) and an executor that supports it, batches of up to GRAPH_TOKENS
tokens (for hybrid models, one new token per sequence) run through `decode_graph.DecodeGraphs`:
the same computation, each step replayed from one CUDA graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.cache.pools import KVPool, StatePool
from engine.config import FULL_ATTENTION, ModelConfig
from engine.model import decode_graph
from engine.model.attention import DECODE_ATTENTION_TOKENS, full_attention
from engine.model.batch import ForwardBatch
from engine.model.linear_attention import gated_deltanet
from engine.model.moe import feed_forward
from engine.model.ops import Rotary, check_switches, embed_tokens, rms_norm
from engine.moe.executor import ExpertExecutor
from engine.weights.layout import DecoderWeights

GRAPH_TOKENS = DECODE_ATTENTION_TOKENS  # batches of up to this many tokens may run through decode graphs


class Decoder:
    def __init__(self, cfg: ModelConfig, weights: DecoderWeights, executor: ExpertExecutor) -> None:
        check_switches()  # a bad FREETOKEN_FUSED_* value fails here, not in a forward pass
        self.cfg = cfg
        self.weights = weights
        self._graphs: dict[int, decode_graph.DecodeGraphs] = {}
        self._executor = executor
        self.rotary = Rotary(cfg.rotary_dim, cfg.rope_theta)
        # Position of each layer within its pool (KV pools hold only full-attention layers, etc.).
        self._kv_index = {li: i for i, li in enumerate(cfg.full_attention_layer_ids)}
        self._state_index = {li: i for i, li in enumerate(cfg.linear_attention_layer_ids)}
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

    def drop_graphs(self) -> None:
        """Forgets every captured decode pass (they hold the executor's and the pools' tensors): the
        next decode steps capture anew."""
        self._graphs.clear()

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: KVPool, states: StatePool) -> torch.Tensor:
        n = batch.num_tokens
        if self.cuda_graphs and 0 < n <= GRAPH_TOKENS:
            graphs = self._graphs.get(n)
            if graphs is None and decode_graph.usable(self, n):
                graphs = self._graphs[n] = decode_graph.DecodeGraphs(self, n)
            if graphs is not None and graphs.accepts(batch):
                return graphs.forward(batch, kv, states)
        cfg, w = self.cfg, self.weights
        begin = getattr(self.executor, "begin_forward", None)
        if begin is not None:  # e.g. start streaming the first MoE layer's experts during the embedding
            begin(n * cfg.top_k)
        h = embed_tokens(batch.input_ids, w.embed)
        eps, zc = cfg.rms_norm_eps, cfg.norm_zero_centered
        for li, lw in enumerate(w.layers):
            x = rms_norm(h, lw.input_norm, eps, zc)
            if cfg.layer_types[li] == FULL_ATTENTION:
                assert lw.attention is not None
                ki = self._kv_index[li]
                x = full_attention(x, lw.attention, cfg, self.rotary, batch, kv.k[ki], kv.v[ki])
            else:
                assert lw.linear_attention is not None
                si = self._state_index[li]
                x = gated_deltanet(x, lw.linear_attention, cfg, batch, states.conv[si], states.ssm[si])
            h = feed_forward(h, x, lw, cfg, self.executor)
        return rms_norm(h, w.final_norm, eps, zc)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weights.lm_head).float()
