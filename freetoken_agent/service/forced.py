"""Forced output (benchmark only): make a generation emit given token ids instead of sampled ones.

Contract: `submit_options(engine, forced, constraint, eos_ids)` returns the keyword arguments for
`Engine.submit` that force `forced`: `forced_output=forced` where the engine takes it (the forward
pass runs normally, so caches and checkpoints are those of a real generation), else a
`ForcedTokens` constraint that allows exactly the next forced id and then only an end-of-turn id,
which gives the same tokens through the sampler on an engine without the option. Without forced
ids the request's own constraint is passed through unchanged.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

from engine.engine import Engine
from engine.sampling import TokenConstraint


class ForcedTokens:
    """A constraint that admits only `ids[i]` at step i, then only an end-of-turn token."""

    def __init__(self, ids: list[int], eos_ids: Iterable[int]) -> None:
        self.ids, self.eos, self.pos = ids, set(eos_ids), 0

    def allowed(self, token_id: int) -> bool:
        if self.pos < len(self.ids):
            return token_id == self.ids[self.pos]
        return token_id in self.eos

    def advance(self, token_id: int) -> None:
        self.pos += 1


def engine_takes_forced(engine: Engine) -> bool:
    return "forced_output" in inspect.signature(engine.submit).parameters


def submit_options(engine: Engine, forced: list[int] | None, constraint: TokenConstraint | None,
                   eos_ids: Iterable[int]) -> dict[str, Any]:
    if forced is None:
        return {"constraint": constraint}
    if engine_takes_forced(engine):
        return {"forced_output": forced}
    return {"constraint": ForcedTokens(forced, eos_ids)}
