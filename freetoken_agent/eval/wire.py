"""One model request on the wire, timed: TTFT, decode rate and usage from the streamed reply.

Contract: `send(client, base, path, body, headers)` posts `body` to `base + path` and returns a
`Sent`: HTTP status, TTFT (send -> first SSE event carrying generated output: a reasoning, text or
tool-call delta or block, any protocol), the time of the last such event, the total time, the
usage the server reports (prompt, cached and completion tokens; every protocol's shape) and the
reply text. Non-streaming bodies are timed as a whole (TTFT = total). `decode_tps` is
(completion - 1) / (last - first generated event) when both are known. `served_model(base)` is the
first id of `GET /v1/models`, or None. `baseline_decode(base, model, force)` is the decode rate of
one single-turn request (a short prompt, 64 output tokens: forced with the benchmark-only field
when `force`, else sampled), the reference for each run's decode drop. `ServerSessions(base)` reads `/v1/sessions` (our server
only): `latest_turn()` is the newest turn of the most recently active session; `placement()`
what the server says of where it put prefill state: its anchor `policy`, the checkpoints its
sessions hold now, and the anchor kinds of every session's last main plan, counted.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import httpx

from evals.traces.sse import carries_output, sse_events, usage_of


@dataclass
class Sent:
    status: int
    ttft_s: float | None = None
    last_s: float | None = None
    total_s: float = 0.0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    error: str | None = None

    @property
    def decode_tps(self) -> float | None:
        n = self.completion_tokens
        if n is None or n < 2 or self.ttft_s is None or self.last_s is None or self.last_s <= self.ttft_s:
            return None
        return (n - 1) / (self.last_s - self.ttft_s)


def _merge(usage: dict[str, int], got: dict[str, int] | None) -> None:
    if got:
        usage.update({k: v for k, v in got.items() if v or k not in usage})


def send(client: httpx.Client, base: str, path: str, body: dict[str, Any], headers: dict[str, str]) -> Sent:
    t0 = time.monotonic()
    first: float | None = None
    last: float | None = None
    usage: dict[str, int] = {}
    with client.stream("POST", base + path, json=body, headers=headers) as r:
        if r.status_code != 200:
            return Sent(r.status_code, total_s=time.monotonic() - t0,
                        error=r.read().decode("utf-8", "replace")[:500])
        if not body.get("stream"):
            data = json.loads(r.read())
            now = time.monotonic() - t0
            _merge(usage, usage_of(data))
            return Sent(200, now, now, now, usage.get("prompt"), usage.get("cached"), usage.get("completion"))
        for event in sse_events(r.iter_lines()):
            if carries_output(event):
                last = time.monotonic() - t0
                first = last if first is None else first
            # Anthropic reports input at message_start and output at message_delta: merge both
            _merge(usage, usage_of(event))
    return Sent(200, first, last, time.monotonic() - t0, usage.get("prompt"), usage.get("cached"),
                usage.get("completion"))


def served_model(base: str, headers: dict[str, str] | None = None) -> str | None:
    try:
        r = httpx.get(base + "/v1/models", headers=headers or {}, timeout=30)
        data = r.json().get("data") if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
    return str(data[0]["id"]) if data else None


class ServerSessions:
    """`/v1/sessions` of our server; `available` is False on any other server."""

    def __init__(self, base: str, headers: dict[str, str] | None = None) -> None:
        self.base, self.headers = base, headers or {}
        try:
            r = httpx.get(base + "/v1/sessions", headers=self.headers, timeout=30)
            self.available = r.status_code == 200 and isinstance(r.json(), dict | list)
        except (httpx.HTTPError, ValueError):
            self.available = False

    def list(self) -> list[dict[str, Any]]:
        data = httpx.get(self.base + "/v1/sessions", headers=self.headers, timeout=30).json()
        items = data.get("data", data.get("sessions", [])) if isinstance(data, dict) else data
        return [s for s in items or [] if isinstance(s, dict)]

    def detail(self, sid: str) -> dict[str, Any]:
        from urllib.parse import quote

        r = httpx.get(f"{self.base}/v1/sessions/{quote(sid, safe='')}", headers=self.headers, timeout=30)
        return r.json() if r.status_code == 200 else {}

    def latest_turn(self) -> tuple[str, dict[str, Any]] | None:
        """(session id, its newest turn) of the most recently active session."""
        items = self.list() if self.available else []
        if not items:
            return None
        s = max(items, key=lambda s: s.get("last_activity") or 0)
        turns = self.detail(str(s["id"])).get("turns") or []
        return (str(s["id"]), turns[-1]) if turns else None

    def placement(self) -> dict[str, Any]:
        """{policy, checkpoints, anchor_kinds} over every session (None / {} where not reported)."""
        if not self.available:
            return {"policy": None, "checkpoints": None, "anchor_kinds": {}}
        data = httpx.get(self.base + "/v1/sessions", headers=self.headers, timeout=30).json()
        policy = data.get("policy") if isinstance(data, dict) else None
        held: int | None = None
        kinds: dict[str, int] = {}
        for s in self.list():
            if isinstance(s.get("checkpoints"), int):
                held = (held or 0) + int(s["checkpoints"])
            for a in self.detail(str(s["id"])).get("anchors") or []:
                kinds[str(a.get("kind"))] = kinds.get(str(a.get("kind")), 0) + 1
        return {"policy": str(policy) if policy else None, "checkpoints": held, "anchor_kinds": dict(sorted(kinds.items()))}


# The forced baseline reply is the whole reply (the server sizes max_tokens to it), so its length is
# the baseline's: about 64 tokens (65 in the Qwen tokenizers, a token per digit and per space; 49 in
# o200k_harmony).
BASELINE_TEXT = " ".join(f"{i}" for i in range(1, 26))


def baseline_decode(base: str, model: str | None, force: bool = True, headers: dict[str, str] | None = None,
                    tokens: int = 64, text: str | None = None) -> float | None:
    """Decode tok/s of one single-turn request of `tokens` output tokens: forced to `text` (an
    eval's own words, e.g. a trace's replies) or to BASELINE_TEXT, or sampled with `force` off."""
    ask = "Say that again, word for word." if text else "Count upwards from 1, numbers only."
    body: dict[str, Any] = {"model": model or "default", "stream": True, "max_tokens": tokens,
                            "stream_options": {"include_usage": True},
                            "messages": [{"role": "user", "content": ask}]}
    if force:
        body["freetoken_forced_output"] = text or BASELINE_TEXT
    with httpx.Client(timeout=600) as client:
        s = send(client, base, "/v1/chat/completions", body, headers or {})
    return None if s.decode_tps is None else round(s.decode_tps, 2)
