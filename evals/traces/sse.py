"""What a model server's reply says, read the same way for every protocol (OpenAI chat and
responses, Anthropic messages): the JSON events of an SSE stream, whether an event carries
generated output, and the token usage it reports.

Contract:
- `sse_events(lines)` yields the JSON payload of each `data:` line, in order, skipping other lines,
  `[DONE]` and payloads that are not JSON.
- `carries_output(event)`: the event holds a reasoning, text or tool-call delta or block.
- `usage_of(event)`: {prompt, cached, completion} as far as the event (or its `response` /
  `message`) reports them, else None. prompt counts cached tokens in every protocol (Anthropic's
  `input_tokens` excludes the cache read, which is added back).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any


def sse_events(lines: Iterable[str]) -> Iterator[Any]:
    for line in lines:
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            continue
        try:
            yield json.loads(payload)
        except ValueError:
            continue


def carries_output(event: dict[str, Any]) -> bool:
    """Does this SSE payload carry generated output (any protocol)?"""
    kind = event.get("type", "")
    if kind in ("content_block_start", "content_block_delta"):
        return True
    if kind.startswith("response.") and (kind.endswith(".delta") or kind == "response.output_item.added"):
        return True
    for choice in event.get("choices") or []:
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"):
            return True
    return False


def usage_of(event: dict[str, Any]) -> dict[str, int] | None:
    """{prompt, cached, completion} when this payload reports usage (any protocol)."""
    u = event.get("usage") or (event.get("response") or {}).get("usage") or (event.get("message") or {}).get("usage")
    if not isinstance(u, dict):
        return None
    out: dict[str, int] = {}
    if "prompt_tokens" in u:
        out["prompt"] = int(u["prompt_tokens"])
        out["cached"] = int((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    elif "input_tokens" in u and "cache_read_input_tokens" in u:  # Anthropic: input excludes the cache read
        out["prompt"] = int(u["input_tokens"]) + int(u["cache_read_input_tokens"] or 0)
        out["cached"] = int(u["cache_read_input_tokens"] or 0)
    elif "input_tokens" in u:
        out["prompt"] = int(u["input_tokens"])
        out["cached"] = int((u.get("input_tokens_details") or {}).get("cached_tokens") or 0)
    for k in ("completion_tokens", "output_tokens"):
        if u.get(k) is not None:
            out["completion"] = int(u[k])
    return out or None
