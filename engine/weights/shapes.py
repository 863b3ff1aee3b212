"""Real MoE shapes for benchmarks with random weights (no checkpoints can be downloaded here).

Contract: `SHAPES[name]` is a frozen `MoeShape`; names are those of docs/benchmarks.md, plus
tiny test shapes (`tiny-qwen3`, `tiny-hybrid`, `tiny-mla`, `tiny-gpt-oss`) small enough to run on a CPU in tests. A shape
carries every size a full model config needs (engine/weights/dummy.py turns it into one); defaults
are Qwen3-30B-A3B's. `MODEL_SHAPES` lists the shapes of families the engine runs (`runnable`).
`expert_bytes(itemsize)` is one routed expert's weight bytes (gate, up and down projections) and
`bank_bytes(layers, itemsize)` those of every routed expert of the model (or of `layers` layers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ENGINE_FAMILIES = ("qwen3_moe", "qwen3_5_moe", "qwen3_next", "glm4_moe_lite", "deepseek_v3", "gpt_oss")


@dataclass(frozen=True)
class MoeShape:
    name: str
    layers: int
    experts: int
    top_k: int
    hidden: int
    inter: int  # one routed expert's intermediate size
    expert_format: str = "bf16"  # the released checkpoint's expert format
    # qwen3_moe | qwen3_5_moe, qwen3_next (Gated DeltaNet hybrids) | glm4_moe_lite, deepseek_v3 (MLA,
    # sigmoid grouped router) | gpt_oss (sliding/full, sinks)
    family: str = "qwen3_moe"
    vocab: int = 151936
    heads: int = 32  # full-attention query heads
    kv_heads: int = 4
    head_dim: int = 128
    rope_theta: float = 1e6
    partial_rotary: float = 1.0  # share of each head's dims that is rotated
    rms_eps: float = 1e-6
    max_positions: int = 40960
    full_attention_interval: int = 1  # every n-th layer is full attention, the others Gated DeltaNet
    linear_key_heads: int = 0  # Gated DeltaNet
    linear_value_heads: int = 0
    linear_head_dim: int = 0  # key and value head dim (equal in every released config)
    conv_kernel: int = 4
    shared_inter: int = 0  # shared expert's intermediate size (0: none)
    # MLA and the sigmoid grouped router (glm4_moe_lite, deepseek_v3)
    q_lora: int = 0  # 0: q straight from the hidden state
    kv_lora: int = 0
    qk_nope: int = 0
    qk_rope: int = 0
    v_head: int = 0
    first_dense: int = 0  # leading layers with a dense MLP instead of experts
    dense_inter: int = 0
    n_group: int = 1
    topk_group: int = 1
    routed_scale: float = 1.0
    rope_scaling: tuple[tuple[str, Any], ...] = ()  # rope_parameters beyond type "default" and theta

    @property
    def runnable(self) -> bool:
        return self.family in ENGINE_FAMILIES

    def expert_bytes(self, itemsize: int = 2) -> int:
        return 3 * self.hidden * self.inter * itemsize

    def bank_bytes(self, layers: int | None = None, itemsize: int = 2) -> int:
        return (layers or self.layers) * self.experts * self.expert_bytes(itemsize)


_QWEN35: dict[str, Any] = dict(family="qwen3_5_moe", heads=16, kv_heads=2, head_dim=256, rope_theta=1e7,
                               partial_rotary=0.25, max_positions=262144, full_attention_interval=4,
                               linear_key_heads=16, linear_value_heads=32, linear_head_dim=128)


def _hybrid(name: str, **kw: Any) -> MoeShape:
    """A Qwen3.5-MoE (Gated DeltaNet 3:1 hybrid) shape: Qwen3.5-35B-A3B's sizes unless overridden."""
    return MoeShape(name, **{**_QWEN35, **kw})


_GLM_FLASH: dict[str, Any] = dict(
    family="glm4_moe_lite", vocab=154880, heads=20, kv_heads=20, head_dim=256, q_lora=768, kv_lora=512,
    qk_nope=192, qk_rope=64, v_head=256, first_dense=1, dense_inter=10240, shared_inter=1536, routed_scale=1.8,
    rms_eps=1e-5, max_positions=202752)


def _mla(name: str, **kw: Any) -> MoeShape:
    """An MLA shape: GLM-4.7-Flash's sizes unless overridden."""
    return MoeShape(name, **{**_GLM_FLASH, **kw})


def _gpt_oss(name: str, **kw: Any) -> MoeShape:
    """A gpt-oss shape (both releases share all but layers and experts; experts ship as MXFP4)."""
    base: dict[str, Any] = dict(top_k=4, hidden=2880, inter=2880, expert_format="mxfp4", family="gpt_oss",
                                vocab=201088, heads=64, kv_heads=8, head_dim=64, rope_theta=150000.0, rms_eps=1e-5,
                                max_positions=131072)
    return MoeShape(name, **{**base, **kw})


SHAPES = {s.name: s for s in (
    MoeShape("qwen3-30b-a3b", layers=48, experts=128, top_k=8, hidden=2048, inter=768),
    # Qwen3.5-35B-A3B's published shape (Qwen3.6-35B-A3B keeps it): 248320-token vocabulary
    _hybrid("qwen3.6-35b-a3b", layers=40, experts=256, top_k=8, hidden=2048, inter=512, vocab=248320,
            shared_inter=512),
    # Qwen3-Next-80B-A3B: the Qwen3.5 hybrid's layout with 512 experts, 10 routed per token
    _hybrid("qwen3-next-80b-a3b", layers=48, experts=512, top_k=10, hidden=2048, inter=512, family="qwen3_next",
            shared_inter=512, vocab=151936),
    # GLM-4.7-Flash (30B-A3B, MLA)
    _mla("glm-4.7-flash", layers=47, experts=64, top_k=4, hidden=2048, inter=1536),
    # DeepSeek-V3 / V3.1 / Kimi-K2's layout (671B: served from host memory); released experts are fp8
    _mla("deepseek-v3", layers=61, experts=256, top_k=8, hidden=7168, inter=2048, family="deepseek_v3",
         expert_format="fp8", vocab=129280, heads=128, kv_heads=128, head_dim=192, q_lora=1536, qk_nope=128,
         v_head=128, first_dense=3, dense_inter=18432, shared_inter=2048, n_group=8, topk_group=4,
         routed_scale=2.5, rope_theta=10000.0, rms_eps=1e-6, max_positions=163840,
         rope_scaling=(("rope_type", "yarn"), ("factor", 40.0), ("original_max_position_embeddings", 4096),
                       ("beta_fast", 32), ("beta_slow", 1), ("mscale", 1.0), ("mscale_all_dim", 1.0))),
    _gpt_oss("gpt-oss-120b", layers=36, experts=128),
    _gpt_oss("gpt-oss-20b", layers=24, experts=32),
    # test shapes: a few layers of small dims, one per engine family
    MoeShape("tiny-qwen3", layers=3, experts=8, top_k=2, hidden=64, inter=32, vocab=512, heads=4, kv_heads=2,
             head_dim=16, max_positions=4096),
    _hybrid("tiny-hybrid", layers=4, experts=8, top_k=2, hidden=64, inter=32, vocab=512, shared_inter=32, heads=4,
            kv_heads=2, head_dim=16, max_positions=4096, linear_key_heads=2, linear_value_heads=4,
            linear_head_dim=16),
    _mla("tiny-mla", layers=3, experts=8, top_k=2, hidden=64, inter=32, vocab=512, heads=4, kv_heads=4,
         head_dim=24, q_lora=32, kv_lora=32, qk_nope=16, qk_rope=8, v_head=16, dense_inter=64, shared_inter=32,
         n_group=2, topk_group=1, max_positions=4096, family="deepseek_v3"),
    _gpt_oss("tiny-gpt-oss", layers=2, experts=8, hidden=64, inter=32, vocab=512, heads=4, kv_heads=2, head_dim=16,
             max_positions=4096),
)}

MODEL_SHAPES = tuple(sorted(name for name, s in SHAPES.items() if s.runnable))
