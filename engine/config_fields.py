"""The pieces of config parsing that family maps share: layer-kind names, field access that names
what is missing, and the rotary scaling (`RopeScaling`, `rope_fields`).

Contract: `field_of(d, key, source, default)` returns `d[key]` (None counts as absent) or `default`,
raising `ConfigError` naming the field when neither exists; `rope_fields(d, source, partial)` reads
`rope_parameters` (transformers 5) or the older `rope_scaling` plus top-level `rope_theta` /
`partial_rotary_factor` into (theta, partial rotary factor, `RopeScaling`). Nothing here imports
torch or engine/config.py, so engine/config.py and engine/families.py both build on it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from engine.errors import ConfigError

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"  # attends the last `sliding_window` keys only
LINEAR_ATTENTION = "linear_attention"

ROPE_TYPES = ("default", "linear", "dynamic", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    """The rotary scaling of `rope_scaling` / `rope_parameters` (engine/model/rope.py computes the
    frequencies). `factor` None means: derived (yarn: max_position_embeddings / original)."""

    rope_type: str = "default"
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    attention_factor: float | None = None

    @classmethod
    def from_dict(cls, rp: dict[str, Any], source: str) -> RopeScaling:
        kind = rp.get("rope_type", rp.get("type")) or "default"
        if kind not in ROPE_TYPES:
            raise ConfigError(f"{source}: rope_type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
        if kind == "default":
            return cls()

        def num(key: str) -> float | None:
            v = rp.get(key)
            if v is None:
                return None
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ConfigError(f"{source}: rope parameter {key!r} must be a number, got {v!r}")
            return float(v)

        factor = num("factor")
        if factor is None and kind != "yarn":
            raise ConfigError(f"{source}: rope_type {kind!r} needs a 'factor'")
        if factor is not None and factor <= 0:
            raise ConfigError(f"{source}: rope 'factor' must be positive, got {factor}")
        original = num("original_max_position_embeddings")
        return cls(
            rope_type=kind,
            factor=factor,
            original_max_position_embeddings=None if original is None else int(original),
            beta_fast=num("beta_fast") or 32.0,
            beta_slow=num("beta_slow") or 1.0,
            mscale=num("mscale"),
            mscale_all_dim=num("mscale_all_dim"),
            truncate=bool(rp.get("truncate", True)),
            attention_factor=num("attention_factor"),
        )



def field_of(d: dict[str, Any], key: str, source: str, default: Any = ...) -> Any:
    if key in d and d[key] is not None:
        return d[key]
    if default is ...:
        raise ConfigError(f"{source}: missing field {key!r}")
    return default


def rope_fields(d: dict[str, Any], source: str, default_partial: float) -> tuple[float, float, RopeScaling]:
    """(theta, partial rotary factor, scaling) from `rope_parameters` (transformers 5) or the older
    `rope_scaling` plus top-level `rope_theta` / `partial_rotary_factor`."""
    rp = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if not isinstance(rp, dict):
        raise ConfigError(f"{source}: rope_parameters must be an object")
    theta = float(rp.get("rope_theta", d.get("rope_theta", 10000.0)))
    partial = float(rp.get("partial_rotary_factor", d.get("partial_rotary_factor", default_partial)))
    scaling = RopeScaling.from_dict(rp, source)
    if scaling.rope_type == "yarn" and scaling.original_max_position_embeddings is None:
        # transformers fills it from the top level, else from max_position_embeddings
        original = d.get("original_max_position_embeddings") or d.get("max_position_embeddings")
        if original is not None:
            scaling = dataclasses.replace(scaling, original_max_position_embeddings=int(original))
    return theta, partial, scaling

