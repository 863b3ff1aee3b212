"""Stop strings: bounded, and matched on streamed text in time linear in what streams.

Contract: `check_stops(stops)` refuses (`RequestError`) more than `MAX_STOPS` strings or one longer
than `MAX_STOP_CHARS` characters. `StopMatcher(stops).feed(text)` takes the next piece of decoded
text and returns `(emit, hit)`: `emit` is text that can no longer be part of a stop string (safe
to send), `hit` the stop string found (the earliest; the longest of those starting there), after
which `emit` holds the text before it and the matcher is done. Text that may still begin a stop
string is held back; `flush()` returns it at the end. Each stop string keeps a Knuth-Morris-Pratt
state, so a piece of n characters costs O(n * number of stops) whatever the stop lengths, and
the held-back text is never longer than the longest stop.
"""

from __future__ import annotations

from engine.errors import RequestError

MAX_STOPS = 16
MAX_STOP_CHARS = 512


def check_stops(stops: list[str]) -> None:
    if len(stops) > MAX_STOPS:
        raise RequestError(f"at most {MAX_STOPS} stop strings, got {len(stops)}")
    for s in stops:
        if len(s) > MAX_STOP_CHARS:
            raise RequestError(f"a stop string may have at most {MAX_STOP_CHARS} characters, got {len(s)}")


def _failure(s: str) -> list[int]:
    fail = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = fail[k - 1]
        if s[i] == s[k]:
            k += 1
        fail[i] = k
    return fail


class StopMatcher:
    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in dict.fromkeys(stops) if s]
        self._fail = [_failure(s) for s in self.stops]
        self._state = [0] * len(self.stops)  # chars of each stop matched at the end of the text seen
        self._held = ""  # text not yet emitted: it may begin a stop string

    def feed(self, text: str) -> tuple[str, str | None]:
        if not self.stops:
            return text, None
        held = self._held + text
        base = len(self._held)  # held[:base] was fed already
        best: tuple[int, int, str] | None = None  # (start in held, -length, stop)
        for j, s in enumerate(self.stops):
            k, fail, n = self._state[j], self._fail[j], len(s)
            for i in range(len(text)):
                c = text[i]
                while k and c != s[k]:
                    k = fail[k - 1]
                if c == s[k]:
                    k += 1
                if k == n:
                    cand = (base + i + 1 - n, -n, s)
                    if best is None or cand < best:
                        best = cand
                    break
            self._state[j] = k
        if best is not None:
            self._held = ""
            self.stops = []
            return held[:best[0]], best[2]
        keep = max(self._state)
        cut = len(held) - keep
        self._held = held[cut:]
        return held[:cut], None

    def flush(self) -> str:
        out, self._held = self._held, ""
        return out
