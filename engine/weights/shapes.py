"""Real MoE shapes for benchmarks with random weights (no checkpoints can be downloaded here).

Contract: `SHAPES[name]` is a frozen `MoeShape`; names are those of docs/benchmarks.md, plus
tiny test shapes (`tiny-qwen3`, `tiny-hybrid`, `tiny-gpt-oss`) small enough to run on a CPU in tests. A shape
carries every size a full model config needs (engine/weights/dummy.py turns it into one); defaults
are Qwen3-30B-A3B's. `MODEL_SHAPES` lists the shapes of families the engine runs (`runnable`).
`expert_bytes(itemsize)` is one routed expert's weight bytes (gate, up and down projections) and
`bank_bytes(layers, itemsize)` those of every routed expert of the model (or of `layers` layers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ENGINE_FAMILIES = ("qwen3_moe", "qwen3_5_moe", "gpt_oss")


@dataclass(frozen=True)
class MoeShape:
    name: str
    layers: int
    experts: int
    top_k: int
    hidden: int
    inter: int  # one routed expert's intermediate size
    expert_format: str = "bf16"  # the released checkpoint's expert format
    family: str = "qwen3_moe"  # qwen3_moe | qwen3_5_moe (Gated DeltaNet hybrid) | gpt_oss (sliding/full, sinks)
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
    _gpt_oss("gpt-oss-120b", layers=36, experts=128),
    _gpt_oss("gpt-oss-20b", layers=24, experts=32),
    # test shapes: a few layers of small dims, one per engine family
    MoeShape("tiny-qwen3", layers=3, experts=8, top_k=2, hidden=64, inter=32, vocab=512, heads=4, kv_heads=2,
             head_dim=16, max_positions=4096),
    _hybrid("tiny-hybrid", layers=4, experts=8, top_k=2, hidden=64, inter=32, vocab=512, shared_inter=32, heads=4,
            kv_heads=2, head_dim=16, max_positions=4096, linear_key_heads=2, linear_value_heads=4,
            linear_head_dim=16),
    _gpt_oss("tiny-gpt-oss", layers=2, experts=8, hidden=64, inter=32, vocab=512, heads=4, kv_heads=2, head_dim=16,
             max_positions=4096),
)}

MODEL_SHAPES = tuple(sorted(name for name, s in SHAPES.items() if s.runnable))
