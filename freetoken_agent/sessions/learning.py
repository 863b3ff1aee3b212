"""Per-client re-ranking of anchor kinds from what actually served (or would have served) a turn.

Policy. Each client profile starts from its base priorities (`profiles.py`). Every main-session
turn that diverged inside what the session had cached is a lesson: the anchor of the previous
request deepest at or before the divergence position is the checkpoint that could serve it (the
engine's `ReuseInfo.checkpoint_kind` names the one that did, when it did). For each lesson, every
kind's score decays by `DECAY` and the serving kind gains 1 - DECAY, so a score is the recent
share of divergences that kind served; a kind that served twice counts twice when the engine and
the plan agree. The priority handed to the engine is `base + round(BONUS * score)`: kinds that
keep serving this client outrank kinds that never do, while base priorities still order kinds
with no record. Side requests teach nothing (they have no cache of their own to serve from).
Appended turns (no divergence) credit the deepest anchor at or before the end of what was
cached, which is how an append-only client teaches that `message_end` matters.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from freetoken_agent.sessions.profiles import ClientProfile

DECAY = 0.9
BONUS = 40


def serving_anchor(anchors: Sequence[tuple[int, str]], position: int) -> tuple[int, str] | None:
    """The deepest (position, kind) at or before `position`."""
    best: tuple[int, str] | None = None
    for pos, kind in anchors:
        if pos <= position and (best is None or pos >= best[0]):
            best = (pos, kind)
    return best


class KindScores:
    def __init__(self) -> None:
        self._scores: dict[str, dict[str, float]] = {}
        self._lessons: dict[str, int] = {}
        self._lock = threading.Lock()

    def learn(self, client: str, kinds: Sequence[str]) -> None:
        if not kinds:
            return
        with self._lock:
            scores = self._scores.setdefault(client, {})
            for k in scores:
                scores[k] *= DECAY
            for k in kinds:
                scores[k] = scores.get(k, 0.0) + (1 - DECAY)
            self._lessons[client] = self._lessons.get(client, 0) + 1

    def bonus(self, client: str, kind: str) -> int:
        return round(BONUS * min(1.0, self._scores.get(client, {}).get(kind, 0.0)))

    def priority(self, profile: ClientProfile, kind: str) -> int:
        return profile.priority(kind) + self.bonus(profile.name, kind)

    def ranking(self, profile: ClientProfile) -> list[dict[str, object]]:
        kinds = sorted(set(profile.priorities) | set(self._scores.get(profile.name, {})),
                       key=lambda k: -self.priority(profile, k))
        return [{"kind": k, "priority": self.priority(profile, k), "base": profile.priority(k),
                 "score": round(self._scores.get(profile.name, {}).get(k, 0.0), 4)} for k in kinds]

    def lessons(self, client: str) -> int:
        return self._lessons.get(client, 0)
