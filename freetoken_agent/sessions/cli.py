"""`freetoken-agent sessions [ID] [--base-url URL] [--api-key KEY] [--json]`: inspect a running server.

Contract: queries `GET /v1/sessions` (or `/v1/sessions/ID`) of the server at `--base-url` (default
http://127.0.0.1:8000; `--url` is an alias; the key defaults to `$FREETOKEN_API_KEY`). With
`--json` it prints the server's JSON as is; otherwise readable tables (rich; plain text when
stdout is not a terminal). Exit 0 on success; an unreachable server, a refused key or an unknown
session is one line on stderr, `error: ...`, exit 1.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
from typing import Any

DEFAULT_URL = "http://127.0.0.1:8000"


def add_sessions_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("sessions", help="per-session cache inspection of a running server")
    p.add_argument("id", nargs="?", default=None, help="one session's id (default: list them all)")
    p.add_argument("--base-url", "--url", dest="base_url", default=DEFAULT_URL,
                   help=f"the server (default {DEFAULT_URL})")
    p.add_argument("--api-key", default=None, help="the server's key (default: $FREETOKEN_API_KEY)")
    p.add_argument("--json", action="store_true", help="print the server's JSON")


class SessionsError(Exception):
    pass


def fetch(base_url: str, session_id: str | None, api_key: str | None, timeout: float = 10.0) -> dict[str, Any]:
    from urllib.parse import quote

    import httpx

    base = base_url.rstrip("/").removesuffix("/v1")
    url = f"{base}/v1/sessions" + (f"/{quote(session_id, safe='/')}" if session_id else "")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(url, headers=headers, timeout=timeout)
    except httpx.HTTPError as e:
        raise SessionsError(f"cannot reach the server at {base} ({type(e).__name__}: {e})") from None
    try:
        body = r.json()
    except ValueError:
        body = None
    if r.status_code != 200:
        err = body.get("error") if isinstance(body, dict) else None
        msg = err.get("message") if isinstance(err, dict) else r.text[:200]
        raise SessionsError(f"{url}: HTTP {r.status_code}: {msg}")
    if not isinstance(body, dict):
        raise SessionsError(f"{url}: the answer is not a JSON object")
    return body


def _when(ts: Any) -> str:
    if not isinstance(ts, int | float):
        return "-"
    return dt.datetime.fromtimestamp(ts, tz=dt.UTC).strftime("%Y-%m-%d %H:%M:%S")


def _v(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.1f}"
    return str(x)


def _bytes(n: Any) -> str:
    if not isinstance(n, int):
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)  # pragma: no cover


def render(body: dict[str, Any], session_id: str | None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(soft_wrap=False, width=None if sys.stdout.isatty() else 200)
    if session_id is None:
        t = Table(title=f"sessions (anchor policy: {body.get('policy', '-')})")
        for col in ("id", "client", "turns", "side", "last activity (UTC)", "checkpoints", "bytes"):
            t.add_column(col)
        for s in body.get("data", []):
            t.add_row(str(s["id"]), str(s["client"]), _v(s.get("turns")), _v(s.get("side_requests")),
                      _when(s.get("last_activity")), _v(s.get("checkpoints")), _bytes(s.get("checkpoint_bytes")))
        console.print(t)
        if not body.get("data"):
            console.print("no sessions yet")
        return
    console.print(f"session {body['id']}  client {body['client']}  policy {body.get('policy', '-')}  "
                  f"turns {body.get('turns_count')}  side requests {body.get('side_requests')}  "
                  f"checkpoints {_v(len(body['checkpoints']) if body.get('checkpoints') is not None else None)} "
                  f"({_bytes(body.get('checkpoint_bytes'))})")
    t = Table(title="turns")
    cols = ("#", "side", "prompt", "reused", "recomputed", "diverged at", "cause", "checkpoint", "kind",
            "host", "ttft ms")
    for col in cols:
        t.add_column(col)
    for turn in body.get("turns", []):
        t.add_row(_v(turn.get("index")), _v(turn.get("side")), _v(turn.get("prompt_tokens")),
                  _v(turn.get("reused_tokens")), _v(turn.get("recomputed_tokens")),
                  _v(turn.get("divergence_position")), _v(turn.get("divergence_cause")),
                  _v(turn.get("checkpoint_position")), _v(turn.get("checkpoint_kind")), _v(turn.get("from_host")),
                  _v(turn.get("ttft_ms")))
    console.print(t)
    ranking = body.get("kind_ranking") or []
    if ranking:
        r = Table(title=f"anchor kinds for {body['client']} (base + learned)")
        for col in ("kind", "priority", "base", "score"):
            r.add_column(col)
        for k in ranking:
            r.add_row(str(k["kind"]), _v(k["priority"]), _v(k["base"]), _v(k["score"]))
        console.print(r)


def run_sessions(args: argparse.Namespace) -> int:
    key = args.api_key or os.environ.get("FREETOKEN_API_KEY") or None
    try:
        body = fetch(args.base_url, args.id, key)
    except SessionsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(body, indent=2))
    else:
        render(body, args.id)
    return 0
