"""Rotary frequencies for each `rope_type`: the inverse frequencies and the attention scaling.

Contract: `rope_frequencies(scaling, dim, theta, max_position_embeddings, seq_len=None)` returns
(inv_freq [dim // 2] float32, attention_scaling), the pair `transformers`' ROPE_INIT_FUNCTIONS (and
each model's default initialiser) compute for the same parameters; the rotary tables multiply their
cos / sin by `attention_scaling` (YaRN's mscale ratio, 1.0 for the other types). Types:
- default: 1 / theta^(2i / dim).
- linear: the default frequencies divided by `factor`.
- dynamic (NTK): the base grows with the sequence length past `max_position_embeddings`; the engine
  builds its tables once, at `seq_len = max_position_embeddings`, where the frequencies are the
  default ones (cached keys keep the rotation they were written with).
- yarn: a ramp between interpolated (divided by `factor`) and extrapolated frequencies over the
  dims whose wavelength falls between `beta_fast` and `beta_slow` rotations of the original context,
  and attention scaling `0.1 * ln(factor) * mscale + 1` (or the ratio of two such terms with
  `mscale` / `mscale_all_dim`, or the given `attention_factor`).
`softmax_mscale(scaling)` is the extra factor on the softmax scale that DeepSeek-style MLA applies
(squared) when the rotary type is scaled and `mscale_all_dim` is set.
"""

from __future__ import annotations

import math

import torch

from engine.config import RopeScaling


def _default(dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim))


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched by `factor` (1.0 when not stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(s: RopeScaling, dim: int, theta: float, max_pos: int) -> tuple[torch.Tensor, float]:
    original = s.original_max_position_embeddings or max_pos
    factor = s.factor if s.factor is not None else max_pos / original
    attention = s.attention_factor
    if attention is None:
        if s.mscale and s.mscale_all_dim:
            attention = yarn_mscale(factor, s.mscale) / yarn_mscale(factor, s.mscale_all_dim)
        else:
            attention = yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast or 32.0), correction_dim(s.beta_slow or 1.0)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolated = 1 - ramp  # weight of the unscaled frequency per dim pair
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(torch.float) / dim)
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolated) + (1.0 / pos_freqs) * extrapolated
    return inv, float(attention)


def rope_frequencies(scaling: RopeScaling, dim: int, theta: float, max_position_embeddings: int,
                     seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq [dim // 2] float32, attention_scaling) for rotary over `dim` dims."""
    kind = scaling.rope_type
    if kind == "default":
        return _default(dim, theta), 1.0
    factor = 1.0 if scaling.factor is None else scaling.factor
    if kind == "linear":
        return _default(dim, theta) / factor, 1.0
    if kind == "dynamic":
        length = max(seq_len or max_position_embeddings, max_position_embeddings)
        base = theta * ((factor * length / max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))
        return _default(dim, base), 1.0
    if kind == "yarn":
        return _yarn(scaling, dim, theta, max_position_embeddings)
    raise ValueError(f"rope_type {kind!r} has no frequencies here")  # config.py admits only the types above


def softmax_mscale(scaling: RopeScaling) -> float:
    """The factor MLA's softmax scale takes twice: yarn_mscale(factor, mscale_all_dim) when the
    rotary type is scaled and `mscale_all_dim` is set, else 1.0."""
    if scaling.rope_type == "default" or not scaling.mscale_all_dim:
        return 1.0
    return yarn_mscale(1.0 if scaling.factor is None else scaling.factor, scaling.mscale_all_dim)
