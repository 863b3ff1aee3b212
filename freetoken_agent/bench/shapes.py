"""Real MoE shapes for benchmarks with random weights (no checkpoints can be downloaded here).

Contract: `SHAPES[name]` is a frozen `MoeShape`; names are those of ../shared/BENCHMARKS.md.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MoeShape:
    name: str
    layers: int
    experts: int
    top_k: int
    hidden: int
    inter: int  # one routed expert's intermediate size
    expert_format: str = "bf16"  # the released checkpoint's expert format


SHAPES = {s.name: s for s in (
    MoeShape("qwen3-30b-a3b", layers=48, experts=128, top_k=8, hidden=2048, inter=768),
    MoeShape("qwen3.6-35b-a3b", layers=40, experts=256, top_k=8, hidden=2048, inter=512),
    MoeShape("gpt-oss-120b", layers=36, experts=128, top_k=4, hidden=2880, inter=2880, expert_format="mxfp4"),
)}
