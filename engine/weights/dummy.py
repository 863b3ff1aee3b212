"""Random weights of a real model shape, built in memory without checkpoint files (a "dummy load").

Contract:
- `shape_config_dict(shape, layers=None)`: the Hugging Face `config.json` dict a checkpoint of
  `shape` (an engine/weights/shapes.py `MoeShape`) would carry, of its family (qwen3_moe,
  qwen3_5_moe_text or qwen3_next for the Gated DeltaNet hybrids, glm4_moe_lite or deepseek_v3 for
  MLA, or gpt_oss: alternating sliding (128) and full layers, YaRN as released); `layers` overrides
  the layer count. bf16, no EOS token (a generation always runs to its max_tokens).
- `dummy_config(shape, layers=None) -> ModelConfig`: that dict through `ModelConfig.from_dict`;
  `shape` may be a shape name. Unknown names, families the engine does not run and layers < 1
  raise `ConfigError`.
- `dummy_weights(cfg, device, dtype, seed, fill_threads=0) -> DecoderWeights` and
  `dummy_decoder(cfg, device, dtype, seed, executor="auto", threads=0) -> Decoder` (the executor
  made by `create_executor`, as `load_decoder` does). Dense weights are on `device`; the routed
  experts are one contiguous host tensor per bank (`ExpertBanks`: w13 [L*E, 2I, H], w2 [L*E, H, I]),
  like a loaded checkpoint's; gpt-oss's are MXFP4 as released, kept packed (`PackedExpertBanks`,
  one gate_up and one down tensor per layer, random valid blocks), with zero float32 biases (its
  sinks are zero too). Raises `ConfigError` when the banks do not fit in available memory.

Values depend only on (seed, cfg, dtype), not on the device or the thread count: every tensor is
filled on the host in chunks, each chunk from its own generator seeded by (seed, tensor ordinal,
chunk), by `fill_threads` workers (0: every CPU this process may use), then moved to `device`. A
value is a bf16 bit pattern (random sign, random mantissa, exponent one of two adjacent binades):
|w| is spread over [2^e, 2^(e+2)) with std about 2.42 * 2^e, and 64 random bits make four values
(0.4-1 GB/s per core, page faults included, on a loaded 2-core dev VM; 58 GB should take seconds
to tens of seconds on 16 cores, not yet timed there).

An MXFP4 block is 16 random bytes (uniform codes over e2m1's values, whose rms is 5.85 x 2^(e-128)
for e8m0 exponent e) after the exponent of the power of two that brings the rms nearest the std.

Scales: matrices std ~0.02 like a real init, except the embedding (std ~1) and the projections
that write into the residual stream (attention o_proj, Gated DeltaNet out_proj, expert and shared
expert down projections: 0.02 / sqrt(2 x layers), GPT-2 style). With 0.02 everywhere a random
model collapses every position onto one direction: greedy decoding repeats one token and every
layer routes it to the same experts (an expert cache would hit ~100%). With these scales each
token keeps its identity through the layers, greedy outputs rarely repeat (a random map over the
vocabulary), and the random routers route almost uniformly at every layer (the worst case for an expert cache, as BENCHMARKS.md
assumes); activations stay finite through 48 layers. Norms are neutral (1, or 0 for zero-centred
norms); Gated DeltaNet decays are drawn in a range that keeps a few tokens of memory; convolution
weights have std ~0.3.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from engine.config import LINEAR_ATTENTION, ModelConfig
from engine.errors import ConfigError
from engine.model.decoder import Decoder
from engine.model.load import parse_dtype
from engine.moe.executor import create_executor
from engine.weights.layout import (
    AttentionWeights,
    DecoderWeights,
    ExpertBanks,
    LayerWeights,
    LinearAttentionWeights,
    MlaWeights,
    MlpWeights,
    MoeWeights,
    PackedExpertBanks,
)
from engine.weights.shapes import ENGINE_FAMILIES, SHAPES, MoeShape

CHUNK = 1 << 24  # values per fill task (32 MB of bf16)
STD = 0.02
EMBED_STD = 1.0
_MASK64 = (1 << 64) - 1


# ---------------------------------------------------------------------------------------- config
def shape_config_dict(shape: MoeShape, layers: int | None = None) -> dict[str, Any]:
    n = shape.layers if layers is None else layers
    common: dict[str, Any] = {
        "vocab_size": shape.vocab, "hidden_size": shape.hidden, "num_hidden_layers": n,
        "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads, "head_dim": shape.head_dim,
        "rms_norm_eps": shape.rms_eps, "max_position_embeddings": shape.max_positions,
        "tie_word_embeddings": False, "attention_bias": False, "num_experts": shape.experts,
        "num_experts_per_tok": shape.top_k, "moe_intermediate_size": shape.inter, "hidden_act": "silu",
        "eos_token_id": None, "dtype": "bfloat16",
        "rope_parameters": {"rope_type": "default", "rope_theta": shape.rope_theta,
                            "partial_rotary_factor": shape.partial_rotary},
    }
    if shape.family == "gpt_oss":
        rest = {k: v for k, v in common.items() if k not in ("num_experts", "moe_intermediate_size")}
        return {**rest, "model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "attention_bias": True,
                "num_local_experts": shape.experts, "intermediate_size": shape.inter, "sliding_window": 128,
                "layer_types": ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)],
                "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                    "truncate": False, "original_max_position_embeddings": 4096,
                                    "rope_theta": shape.rope_theta}}
    if shape.family == "qwen3_moe":
        return {**common, "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
                "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
                "intermediate_size": 4 * shape.hidden}
    if shape.kv_lora:
        mla = {k: v for k, v in common.items() if k not in ("num_experts", "head_dim")}
        if shape.rope_scaling:
            mla["rope_parameters"] = {**dict(shape.rope_scaling), "rope_theta": shape.rope_theta}
        arch = "Glm4MoeLiteForCausalLM" if shape.family == "glm4_moe_lite" else "DeepseekV3ForCausalLM"
        return {**mla, "model_type": shape.family, "architectures": [arch], "n_routed_experts": shape.experts,
                "n_shared_experts": shape.shared_inter // shape.inter, "n_group": shape.n_group,
                "topk_group": shape.topk_group, "routed_scaling_factor": shape.routed_scale, "norm_topk_prob": True,
                "first_k_dense_replace": shape.first_dense, "intermediate_size": shape.dense_inter,
                "q_lora_rank": shape.q_lora or None, "kv_lora_rank": shape.kv_lora, "qk_nope_head_dim": shape.qk_nope,
                "qk_rope_head_dim": shape.qk_rope, "v_head_dim": shape.v_head, "rope_interleave": True}
    interval = shape.full_attention_interval
    if shape.family == "qwen3_next":
        common = {**common, "model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"],
                  "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}
    return {"model_type": "qwen3_5_moe_text", "architectures": ["Qwen3_5MoeForCausalLM"], **common,
            "layer_types": ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)],
            "linear_num_key_heads": shape.linear_key_heads, "linear_num_value_heads": shape.linear_value_heads,
            "linear_key_head_dim": shape.linear_head_dim, "linear_value_head_dim": shape.linear_head_dim,
            "linear_conv_kernel_dim": shape.conv_kernel, "shared_expert_intermediate_size": shape.shared_inter}


def dummy_config(shape: MoeShape | str, layers: int | None = None) -> ModelConfig:
    if isinstance(shape, str):
        if shape not in SHAPES:
            raise ConfigError(f"unknown shape {shape!r} (known: {', '.join(sorted(SHAPES))})")
        shape = SHAPES[shape]
    if shape.family not in ENGINE_FAMILIES:
        raise ConfigError(f"shape {shape.name}: family {shape.family} is not run by this engine "
                          f"(supported: {', '.join(ENGINE_FAMILIES)})")
    if layers is not None and layers < 1:
        raise ConfigError(f"shape {shape.name}: layers must be >= 1, got {layers}")
    return ModelConfig.from_dict(shape_config_dict(shape, layers), source=f"shape {shape.name}")


# ---------------------------------------------------------------------------------------- filling
def _mix(*parts: int) -> int:
    """A 63-bit seed from integers (splitmix64-style), so neighbouring chunks get unrelated streams."""
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h = ((h ^ (p & _MASK64)) * 0xBF58476D1CE4E5B9) & _MASK64
        h ^= h >> 31
        h = (h * 0x94D049BB133111EB) & _MASK64
        h ^= h >> 29
    return h >> 1


def _lanes(value: int) -> int:
    """`value` (16 bits) in each of the four int16 lanes of a signed int64."""
    v = (value & 0xFFFF) * 0x0001_0001_0001_0001
    return v - (1 << 64) if v >= 1 << 63 else v


_MASK_LANES = _lanes(0x80FF)  # per value: the sign bit, the lowest exponent bit, the 7 mantissa bits


def _fill_chunk(dst: torch.Tensor, seed: int, exponent: int) -> None:
    """Random bf16 values (cast to dst's dtype) into the 1-D `dst`: four per 64-bit random word,
    each with a random sign and mantissa and the biased exponent 127+exponent or one more, so
    |value| in [2^exponent, 2^(exponent+2)). Masking and adding the exponent work on whole words
    (the masked bits never carry into a neighbouring value)."""
    n = dst.numel()
    gen = torch.Generator().manual_seed(seed)
    in_place = dst.dtype == torch.bfloat16 and n % 4 == 0 and dst.data_ptr() % 8 == 0
    words = (dst.view(torch.int16).view(torch.int64) if in_place
             else torch.empty((n + 3) // 4, dtype=torch.int64))
    words.random_(-(2**63), None, generator=gen)
    words.bitwise_and_(_MASK_LANES).add_(_lanes((127 + exponent) << 7))
    if not in_place:
        dst.copy_(words.view(torch.bfloat16)[:n])  # bf16 values are exact in float32 (and float16 here)


MXFP4_RMS = 5.85  # rms of e2m1's 16 codes doubled (ggml's kvalues): sqrt(274 / 8)
MXFP4_TASK = 17 * 8 << 18  # bytes per fill task: whole blocks and whole 64-bit words (35.7 MB)


def _fill_mxfp4(dst: torch.Tensor, seed: int, exponent: int) -> None:
    """Random MXFP4 blocks into the 1-D uint8 `dst`, 8-byte aligned, of whole blocks and words (a bank
    of rows of 32-value multiples has 8 x 17 bytes per 8 blocks): random code bytes, the e8m0 byte
    `exponent`."""
    gen = torch.Generator().manual_seed(seed)
    dst.view(torch.int64).random_(-(2**63), None, generator=gen)
    dst.view(-1, 17)[:, 0] = exponent


class _Random:
    """Hands out the model's tensors in a fixed order; the ordinal seeds each one."""

    def __init__(self, seed: int, device: torch.device, dtype: torch.dtype, threads: int, layers: int) -> None:
        self.seed, self.device, self.dtype = seed, device, dtype
        self.out_std = STD / math.sqrt(2 * layers)  # projections that write into the residual stream
        self.ordinal = 0
        self.pool = ThreadPoolExecutor(max(threads, 1), thread_name_prefix="freetoken-dummy")

    def _next_seed(self) -> int:
        self.ordinal += 1
        return _mix(self.seed, self.ordinal)

    def host(self, *shape: int, std: float = STD) -> torch.Tensor:
        out = torch.empty(shape, dtype=self.dtype)
        flat, seed = out.view(-1), self._next_seed()
        exponent = round(math.log2(std / 2.42))
        jobs = [self.pool.submit(_fill_chunk, flat[start:start + CHUNK], _mix(seed, c), exponent)
                for c, start in enumerate(range(0, flat.numel(), CHUNK))]
        for job in jobs:
            job.result()
        return out

    def mxfp4(self, *shape: int, k: int, std: float = STD) -> torch.Tensor:
        """uint8 [*shape, k / 32 * 17]: rows of k values in random MXFP4 blocks of rms about `std`."""
        out = torch.empty(*shape, k // 32 * 17, dtype=torch.uint8)
        flat, seed = out.view(-1), self._next_seed()
        exponent = 128 + round(math.log2(std / MXFP4_RMS))
        jobs = [self.pool.submit(_fill_mxfp4, flat[start:start + MXFP4_TASK], _mix(seed, c), exponent)
                for c, start in enumerate(range(0, flat.numel(), MXFP4_TASK))]
        for job in jobs:
            job.result()
        return out

    def dense(self, *shape: int, std: float = STD) -> torch.Tensor:
        return self.host(*shape, std=std).to(self.device)

    def const(self, value: float, *shape: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        return torch.full(shape, value, dtype=dtype or self.dtype, device=self.device)

    def decay(self, n: int) -> torch.Tensor:
        """Gated DeltaNet A_log (float32): exp(A) in [0.5, 4)."""
        gen = torch.Generator().manual_seed(self._next_seed())
        return torch.empty(n).uniform_(0.5, 4.0, generator=gen).log().to(self.device)


def _available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


# ---------------------------------------------------------------------------------------- weights
def _attention(r: _Random, cfg: ModelConfig, neutral: float) -> AttentionWeights:
    h, hd = cfg.hidden_size, cfg.head_dim
    q_out = cfg.num_heads * hd * (2 if cfg.attn_output_gate else 1)
    w = AttentionWeights(q_proj=r.dense(q_out, h), k_proj=r.dense(cfg.num_kv_heads * hd, h),
                         v_proj=r.dense(cfg.num_kv_heads * hd, h), o_proj=r.dense(h, cfg.num_heads * hd, std=r.out_std),
                         q_norm=r.const(neutral, hd) if cfg.qk_norm else None,
                         k_norm=r.const(neutral, hd) if cfg.qk_norm else None,
                         sinks=r.const(0.0, cfg.num_heads, dtype=torch.float32) if cfg.attention_sinks else None)
    if cfg.attention_bias:
        w.q_bias, w.k_bias = r.const(0.0, q_out), r.const(0.0, cfg.num_kv_heads * hd)
        w.v_bias, w.o_bias = r.const(0.0, cfg.num_kv_heads * hd), r.const(0.0, h)
    return w


def _mla(r: _Random, cfg: ModelConfig) -> MlaWeights:
    h, heads, c, q_lora = cfg.hidden_size, cfg.num_heads, cfg.kv_lora_rank, cfg.q_lora_rank
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    w = MlaWeights(kv_a_proj=r.dense(c + cfg.qk_rope_head_dim, h), kv_a_norm=r.const(1.0, c),
                   kv_b_proj=r.dense(heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), c),
                   o_proj=r.dense(h, heads * cfg.v_head_dim, std=r.out_std))
    if q_lora:
        w.q_a_proj, w.q_a_norm, w.q_b_proj = r.dense(q_lora, h), r.const(1.0, q_lora), r.dense(heads * qk, q_lora)
    else:
        w.q_proj = r.dense(heads * qk, h)
    return w


def _linear_attention(r: _Random, cfg: ModelConfig) -> LinearAttentionWeights:
    h, hv = cfg.hidden_size, cfg.linear_num_value_heads
    return LinearAttentionWeights(
        in_proj_qkv=r.dense(cfg.linear_conv_dim, h), in_proj_z=r.dense(cfg.linear_value_dim, h),
        in_proj_a=r.dense(hv, h), in_proj_b=r.dense(hv, h),
        conv=r.dense(cfg.linear_conv_dim, cfg.linear_conv_kernel_dim, std=0.3),
        a_log=r.decay(hv), dt_bias=r.const(1.0, hv, dtype=torch.float32),
        norm=r.const(1.0, cfg.linear_value_head_dim),  # the gated output norm is not zero-centred
        out_proj=r.dense(h, cfg.linear_value_dim, std=r.out_std))


def _mlp(r: _Random, hidden: int, inter: int) -> MlpWeights:
    return MlpWeights(r.dense(inter, hidden), r.dense(inter, hidden), r.dense(hidden, inter, std=r.out_std))


def _layer(r: _Random, cfg: ModelConfig, li: int) -> LayerWeights:
    h = cfg.hidden_size
    neutral = 0.0 if cfg.norm_zero_centered else 1.0
    lw = LayerWeights(input_norm=r.const(neutral, h), post_norm=r.const(neutral, h))
    if cfg.layer_types[li] != LINEAR_ATTENTION and cfg.attention_kind == "mla":
        lw.mla = _mla(r, cfg)
    elif cfg.layer_types[li] != LINEAR_ATTENTION:
        lw.attention = _attention(r, cfg, neutral)
    else:
        lw.linear_attention = _linear_attention(r, cfg)
    if cfg.moe_layers[li]:
        lw.moe_index = cfg.moe_layer_ids.index(li)
        lw.moe = MoeWeights(router=r.dense(cfg.num_experts, h))
        if cfg.router_kind == "sigmoid_grouped":  # routers are random: the bias stays neutral
            lw.moe.score_bias = r.const(0.0, cfg.num_experts, dtype=torch.float32)
        if cfg.router_kind == "topk_softmax":
            lw.moe.router_bias = r.const(0.0, cfg.num_experts)
        if cfg.shared_expert_intermediate_size:
            lw.moe.shared = _mlp(r, h, cfg.shared_expert_intermediate_size)
            if cfg.shared_expert_gated:
                lw.moe.shared_gate = r.dense(1, h)
    else:
        lw.mlp = _mlp(r, h, cfg.dense_intermediate_size)
    return lw


def _mxfp4_banks(r: _Random, cfg: ModelConfig) -> PackedExpertBanks:
    h, e, i = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    banks = PackedExpertBanks.empty(e, h, i)
    banks.activation, banks.alpha, banks.limit = cfg.expert_activation, cfg.swiglu_alpha, cfg.swiglu_limit
    for _ in range(cfg.num_moe_layers):
        banks.gate_up.append(r.mxfp4(e, 2 * i, k=h))
        banks.down.append(r.mxfp4(e, h, k=i, std=r.out_std))
        banks.fmt_gu.append("mxfp4")
        banks.fmt_d.append("mxfp4")
        banks.gscale.append(torch.ones(e, 3))
    banks.b13, banks.b2 = torch.zeros(cfg.num_moe_layers * e, 2 * i), torch.zeros(cfg.num_moe_layers * e, h)
    return banks


def dummy_weights(cfg: ModelConfig, device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
                  seed: int = 0, fill_threads: int = 0) -> DecoderWeights:
    dtype = dtype or parse_dtype(cfg.torch_dtype)
    h, e, i = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    rows = cfg.num_moe_layers * e
    mxfp4 = cfg.expert_layout == "gpt_oss"
    if mxfp4 and (h % 32 or i % 32):
        raise ConfigError(f"gpt-oss's MXFP4 experts need hidden and intermediate sizes that are multiples of 32, "
                          f"got {h} and {i}")
    bank_bytes = rows * 3 * h * i * 17 // 32 if mxfp4 else rows * 3 * h * i * torch.empty(0, dtype=dtype).element_size()
    available = _available_bytes()
    if available is not None and bank_bytes > 0.9 * available:
        raise ConfigError(f"the expert banks need {bank_bytes / 1e9:.1f} GB of host memory but only "
                          f"{available / 1e9:.1f} GB are available: use fewer layers")
    workers = fill_threads or len(os.sched_getaffinity(0))
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers run in parallel; torch's own threads would oversubscribe
    r = _Random(seed, torch.device(device), dtype, workers, cfg.num_layers)
    try:
        if mxfp4:
            banks: ExpertBanks = _mxfp4_banks(r, cfg)
        else:
            banks = ExpertBanks(w13=r.host(rows, 2 * i, h), w2=r.host(rows, h, i, std=r.out_std), num_experts=e,
                                activation=cfg.expert_activation, alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit)
        if cfg.expert_bias and not mxfp4:
            banks.b13, banks.b2 = torch.zeros(rows, 2 * i, dtype=dtype), torch.zeros(rows, h, dtype=dtype)
        embed = r.dense(cfg.vocab_size, h, std=EMBED_STD)
        layers = [_layer(r, cfg, li) for li in range(cfg.num_layers)]
        final_norm = r.const(0.0 if cfg.norm_zero_centered else 1.0, h)
        lm_head = embed if cfg.tie_word_embeddings else r.dense(cfg.vocab_size, h)
    finally:
        r.pool.shutdown()
        torch.set_num_threads(torch_threads)
    return DecoderWeights(embed=embed, final_norm=final_norm, lm_head=lm_head, layers=layers, experts=banks)


def dummy_decoder(cfg: ModelConfig, device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
                  seed: int = 0, executor: str = "auto", threads: int = 0) -> Decoder:
    weights = dummy_weights(cfg, device, dtype, seed)
    return Decoder(cfg, weights, create_executor(executor, weights.experts, device, threads))
