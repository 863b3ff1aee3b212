"""SSE validation of streamed responses (also used by tests/clients/test_real_clients.py).

Contract: `parse_sse(raw)` splits an SSE body into `(event, data)` pairs (comments dropped; raises
`UnicodeDecodeError` for non-UTF-8). `check_sse(path, raw)` returns the list of problems (empty when
well formed) of a stream from /v1/messages, /v1/chat/completions or /v1/responses, chosen by `path`.
"""

from __future__ import annotations

import json
import re
from typing import Any


def parse_sse(raw: bytes) -> list[tuple[str | None, str]]:
    """Split an SSE body into (event, data) pairs; comment lines are dropped."""
    events: list[tuple[str | None, str]] = []
    text = raw.decode("utf-8")
    for block in re.split(r"\r?\n\r?\n", text):
        name: str | None = None
        data: list[str] = []
        for line in block.splitlines():
            if not line or line.startswith(":"):
                continue
            key, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if key == "event":
                name = value
            elif key == "data":
                data.append(value)
        if name is not None or data:
            events.append((name, "\n".join(data)))
    return events


def check_sse(path: str, raw: bytes) -> list[str]:
    """Problems with a streamed response of /v1/messages, /v1/chat/completions or /v1/responses."""
    try:
        events = parse_sse(raw)
    except UnicodeDecodeError as e:
        return [f"SSE body is not UTF-8: {e}"]
    if not events:
        return ["empty SSE stream"]
    problems: list[str] = []
    payloads: list[dict[str, Any]] = []
    for name, data in events:
        if data == "[DONE]":
            payloads.append({"type": "[DONE]"})
            continue
        try:
            obj = json.loads(data)
        except ValueError:
            problems.append(f"event {name!r}: data is not JSON: {data[:120]!r}")
            continue
        if not isinstance(obj, dict):
            problems.append(f"event {name!r}: data is not an object")
            continue
        if name is not None and "type" in obj and obj["type"] != name:
            problems.append(f"event name {name!r} != data.type {obj['type']!r}")
        if obj.get("type") == "error" or (obj.get("error")):
            problems.append(f"error event: {data[:300]}")
        payloads.append(obj)
    types = [p.get("type") for p in payloads]
    route = path.split("?")[0]
    if route.endswith("/v1/messages"):
        real = [t for t in types if t != "ping"]
        if not real or real[0] != "message_start":
            problems.append(f"first event is {real[:1]}, not message_start")
        if not real or real[-1] != "message_stop":
            problems.append(f"last event is {real[-1:]}, not message_stop")
        open_blocks: set[int] = set()
        for p in payloads:
            t, i = p.get("type"), p.get("index")
            if t == "content_block_start" and isinstance(i, int):
                open_blocks.add(i)
            elif t == "content_block_delta" and i not in open_blocks:
                problems.append(f"delta for block {i} that is not open")
            elif t == "content_block_stop":
                if i not in open_blocks:
                    problems.append(f"stop for block {i} that is not open")
                open_blocks.discard(i)
        if open_blocks:
            problems.append(f"blocks never stopped: {sorted(open_blocks)}")
        if "message_delta" not in types:
            problems.append("no message_delta (stop_reason/usage)")
    elif route.endswith("/v1/chat/completions"):
        if types[-1] != "[DONE]":
            problems.append("stream does not end with data: [DONE]")
        chunks = [p for p in payloads if p.get("type") != "[DONE]"]
        if not any(c.get("choices") and c["choices"][0].get("finish_reason") for c in chunks):
            problems.append("no chunk carries a finish_reason")
        for c in chunks:
            if c.get("object") != "chat.completion.chunk":
                problems.append(f"chunk object is {c.get('object')!r}")
                break
    elif route.endswith("/v1/responses"):
        if not types or types[0] != "response.created":
            problems.append(f"first event is {types[:1]}, not response.created")
        terminal = {"response.completed", "response.incomplete", "response.failed"}
        if not types or types[-1] not in terminal:
            problems.append(f"last event is {types[-1:]}, not response.completed/incomplete")
        if "response.failed" in types:
            problems.append("response.failed")
        seqs = [int(p["sequence_number"]) for p in payloads if isinstance(p.get("sequence_number"), int)]
        if seqs and seqs != sorted(seqs):
            problems.append("sequence_number not increasing")
    return problems
