"""The engine's anchor API as the session manager uses it.

Contract: re-exports `Anchor`, `DecodeAnchor`, `ReuseInfo` and `decode_anchor_at` from `engine.anchors`.
`reuse_of(handle)` is the handle's `ReuseInfo` or None (not admitted yet, or an engine that does
not report it); `engine_checkpoints(engine, session)` is the engine's checkpoint listing
(`Engine.checkpoints(session=...)`) or None when the engine cannot list them; inspection never
raises.
"""

from __future__ import annotations

from typing import Any

from engine.anchors import Anchor, DecodeAnchor, ReuseInfo, decode_anchor_at

__all__ = ["Anchor", "DecodeAnchor", "ReuseInfo", "decode_anchor_at", "engine_checkpoints", "reuse_of"]


def reuse_of(handle: Any) -> ReuseInfo | None:
    info = getattr(handle, "reuse", None)
    return info if info is not None and hasattr(info, "kv_tokens") else None


def engine_checkpoints(engine: Any, session: str | None = None) -> list[dict[str, Any]] | None:
    fn = getattr(engine, "checkpoints", None)
    if not callable(fn):
        return None
    try:
        return list(fn(session=session))
    except Exception:  # inspection must never break serving
        return None
