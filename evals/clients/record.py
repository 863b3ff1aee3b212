"""Recording the request shapes each client sent, for the replay test.

Contract: `recorded_requests(result, api)` takes a `run_client` result (with its `_exchanges`) and
returns the first POST to `api`, plus the first one with tools if that is another one, as JSON-able
dicts (method, path, kept headers, body, status, response content type), with the temp dir replaced
by `/tmp/ftclient` and the API key by `sk-redacted`. `write_recording(name, version, requests)`
saves them to `tests/clients/recorded/{name}.json`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from evals.clients.constants import API_KEY, REPO
from evals.clients.proxy import Exchange

KEEP_HEADERS = {"content-type", "accept", "anthropic-version", "anthropic-beta", "x-app", "openai-beta",
                "x-stainless-helper-method", "x-session-affinity", "x-session-id", "x-claude-code-session-id",
                "session_id", "session-id", "originator", "version", "user-agent"}


def _sanitise(obj: Any, tmp_roots: list[str]) -> Any:
    if isinstance(obj, str):
        for root in tmp_roots:
            obj = obj.replace(root, "/tmp/ftclient")
        return obj.replace(API_KEY, "sk-redacted")
    if isinstance(obj, list):
        return [_sanitise(x, tmp_roots) for x in obj]
    if isinstance(obj, dict):
        return {k: _sanitise(v, tmp_roots) for k, v in obj.items()}
    return obj


def recorded_requests(result: dict[str, Any], api: str) -> list[dict[str, Any]]:
    """The first model request, and the first one with tools if that is another one, sanitised."""
    exchanges: list[Exchange] = [e for e in result.get("_exchanges", [])
                                 if e.method == "POST" and e.path.split("?")[0].endswith(api)]
    picked: list[Exchange] = exchanges[:1]
    with_tools = next((e for e in exchanges if isinstance(e.body_json(), dict) and e.body_json().get("tools")),
                      None)
    if with_tools is not None and with_tools not in picked:
        picked.append(with_tools)
    roots = [result.get("workdir", "")]
    roots += [os.path.realpath(r) for r in roots if r]
    out = []
    for e in picked:
        body = e.body_json()
        if body is None:
            continue
        headers = {k: ("sk-redacted" if "key" in k else v) for k, v in e.req_headers.items() if k in KEEP_HEADERS}
        out.append({"method": e.method, "path": e.path, "headers": _sanitise(headers, roots),
                    "body": _sanitise(body, roots), "status": e.status,
                    "response_content_type": e.content_type.split(";")[0]})
    return out


def write_recording(name: str, version: str, requests: list[dict[str, Any]]) -> Path:
    """Save `requests` of client `name` to `tests/clients/recorded/{name}.json`; return that path."""
    out = REPO / "tests" / "clients" / "recorded" / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"client": name, "version": version, "requests": requests},
                              indent=1, ensure_ascii=False) + "\n")
    return out
