"""Replay captured agent traces against a server and measure prefix reuse and time to first token.

Usage:

    PYTHONPATH=. /work/venv/bin/python -m evals.traces.replay TRACE.json... \
        [--base-url URL | --serve-args "--model demo ..."] [--anchor-policy semantic|positional|user-only] [--json]

Contract:
- Each trace's requests are sent in order, as recorded (path, kept headers, body), with
  `freetoken_forced_output` set to the reply recorded for that turn, rendered for the trace's model
  family; so every later request's prefix is exactly what the engine computed before. Streaming
  requests stream; TTFT is the time from sending to the first SSE event that carries generated
  output (a reasoning, text or tool-call delta or block), measured by this client.
- Truly new tokens of a request: its prompt length minus the longest prefix it shares with any
  earlier request of the same session, where an earlier request counts as its prompt followed by
  its forced reply (the engine computed both). Prompts are rendered locally exactly as the server
  renders them (its protocol adapter, the session manager's normalisation, the model's chat
  template, the tokenizer). A session is the
  client's session header (`x-claude-code-session-id`, `x-session-affinity`, `session_id`, ...),
  else `prompt_cache_key`, else the trace. Session ids are salted per run, so traces replayed
  one after another on one server never share a session.
- Recomputed tokens of a request: `prompt - cached` from the usage the server reports in the
  response (every protocol reports both). Per session: sums, the ratio recomputed / truly new,
  mean and worst TTFT. After the run, `GET /v1/sessions` (and each `/v1/sessions/{id}`) is read
  when the server has it and attached as reported (`server_sessions`), with its per-session
  recomputed / reused sums.
- `--serve-args` starts `freetoken-agent serve` on a free port with those arguments (plus
  `--anchor-policy` when given) and stops it afterwards (`--isolate`: a fresh one per trace, so no
  trace reuses a prefix another left in the cache); `--base-url` uses a running server.
- `replay_traces(...)` is the Python entry point; `--json` prints its result, else a table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from adapters.common import FORCED_OUTPUT_FIELD
from evals.clients.server import serve_with
from evals.traces.script import Call, Reply, render
from evals.traces.scripted import normalise, thinking_on
from evals.traces.sse import carries_output, sse_events, usage_of
from freetoken_agent.sessions.echo import common_prefix
from freetoken_agent.sessions.normalise import normalise as session_normalise

REPO = Path(__file__).resolve().parents[2]
SESSION_HEADERS = ("x-claude-code-session-id", "x-session-affinity", "x-session-id", "session_id", "session-id")
DEMO_FOR_FAMILY = {"qwen3_5": "demo", "qwen3": "demo:qwen3_moe"}


# ---------------------------------------------------------------------------------------------- rendering
class Renderer:
    """Prompt token ids as the server renders them (adapter -> chat template -> tokenizer)."""

    def __init__(self, model: str) -> None:
        from freetoken_agent.models import load_tokenizer, resolve_model

        self.tok = load_tokenizer(resolve_model(model))  # a model folder or a GGUF file

    def prompt_ids(self, path: str, body: dict[str, Any]) -> list[int]:
        req = normalise(path, body)
        if req is None:
            raise ValueError(f"the server would refuse this {path} body")
        req = session_normalise(req)  # what the server's session manager drops before rendering
        tools = req.tools if req.tool_choice != "none" else []
        text = self.tok.apply_chat_template([m.to_template() for m in req.messages], tools=tools or None,
                                            add_generation_prompt=True, enable_thinking=thinking_on(req),
                                            tokenize=False)
        assert isinstance(text, str)
        return self.tok.encode(text)

    def ids(self, text: str) -> list[int]:
        return self.tok.encode(text)


def session_key(req: dict[str, Any], default: str) -> str:
    headers = {k.lower(): v for k, v in (req.get("headers") or {}).items()}
    for h in SESSION_HEADERS:
        if headers.get(h):
            return f"{h}:{headers[h]}"
    key = (req.get("body") or {}).get("prompt_cache_key")
    return f"prompt_cache_key:{key}" if key else default


def salted(trace: dict[str, Any]) -> dict[str, Any]:
    """The trace with its session identities (session headers, `prompt_cache_key`) made unique to
    this run, so traces replayed one after another on one server never share a session. Neither
    is rendered into the prompt, so token counts are unchanged."""
    salt = uuid.uuid4().hex[:8]
    out = json.loads(json.dumps(trace))
    for req in out["requests"]:
        headers = req.get("headers") or {}
        for k in list(headers):
            if k.lower() in SESSION_HEADERS and headers[k]:
                headers[k] = f"{headers[k]}-{salt}"
        body = req.get("body")
        if isinstance(body, dict) and isinstance(body.get("prompt_cache_key"), str):
            body["prompt_cache_key"] = f"{body['prompt_cache_key']}-{salt}"
    return out


def reply_of(req: dict[str, Any]) -> Reply | None:
    r = req.get("reply")
    if not r:
        return None
    return Reply(reasoning=r.get("reasoning", ""), content=r.get("content", ""), side=bool(r.get("side")),
                 calls=[Call(c["name"], c["arguments"]) for c in r.get("tool_calls", [])])


# ---------------------------------------------------------------------------------------------- the wire
def _usage(event: dict[str, Any]) -> tuple[int, int] | None:
    """(prompt tokens, cached tokens) when this payload reports the prompt's usage."""
    u = usage_of(event)
    return (u["prompt"], u["cached"]) if u and "prompt" in u else None


@dataclass
class Sent:
    status: int
    ttft_s: float | None
    total_s: float
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    error: str | None = None


def send(client: httpx.Client, base: str, req: dict[str, Any], body: dict[str, Any],
         api_key: str | None) -> Sent:
    headers = {k: v for k, v in (req.get("headers") or {}).items() if k.lower() != "content-length"}
    if api_key:
        headers["authorization"] = f"Bearer {api_key}"
        headers["x-api-key"] = api_key
    t0 = time.monotonic()
    ttft: float | None = None
    usage: tuple[int, int] | None = None
    with client.stream(req.get("method", "POST"), base + req["path"], json=body, headers=headers) as r:
        if r.status_code != 200:
            return Sent(r.status_code, None, time.monotonic() - t0, error=r.read().decode("utf-8", "replace")[:500])
        if not body.get("stream"):
            data = json.loads(r.read())
            return Sent(200, time.monotonic() - t0, time.monotonic() - t0, *(_usage(data) or (None, None)))
        for event in sse_events(r.iter_lines()):
            if ttft is None and carries_output(event):
                ttft = time.monotonic() - t0
            usage = _usage(event) or usage
    p, c = usage or (None, None)
    return Sent(200, ttft, time.monotonic() - t0, p, c)


# ---------------------------------------------------------------------------------------------- replay
@dataclass
class Turn:
    index: int
    path: str
    side: bool
    prompt_tokens: int
    truly_new: int
    status: int
    ttft_ms: float | None
    recomputed: int | None
    server_prompt_tokens: int | None
    error: str | None = None


@dataclass
class Session:
    key: str
    turns: list[Turn] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        ok = [t for t in self.turns if t.status == 200]
        new = sum(t.truly_new for t in ok)
        rec = sum(t.recomputed or 0 for t in ok)
        ttfts = [t.ttft_ms for t in ok if t.ttft_ms is not None]
        return {"session": self.key, "requests": len(self.turns), "failed": len(self.turns) - len(ok),
                "prompt_tokens": sum(t.prompt_tokens for t in ok), "truly_new_tokens": new,
                "recomputed_tokens": rec, "ratio": round(rec / new, 3) if new else None,
                "mean_ttft_ms": round(sum(ttfts) / len(ttfts), 1) if ttfts else None,
                "worst_ttft_ms": round(max(ttfts), 1) if ttfts else None}


def replay_trace(trace: dict[str, Any], base: str, renderer: Renderer, family: str | None = None,
                 api_key: str | None = None, timeout: float = 600) -> dict[str, Any]:
    family = family or trace.get("family", "qwen3_5")
    sent_trace = salted(trace)
    sessions: dict[str, Session] = {}
    seen: dict[str, list[list[int]]] = {}  # per session: every earlier request's prompt + forced reply
    name = trace.get("client", "trace") + (f"-{trace['variant']}" if trace.get("variant") else "")
    with httpx.Client(timeout=timeout) as client:
        for i, (original, req) in enumerate(zip(trace["requests"], sent_trace["requests"], strict=True)):
            reply = reply_of(req)
            body = req.get("body")
            if reply is None or not isinstance(body, dict):
                continue  # count_tokens and other non-generating requests
            nreq = normalise(req["path"], body)
            if nreq is None:
                continue
            forced = render(reply, family, thinking_on(nreq))
            ids = renderer.prompt_ids(req["path"], body)
            key = f"{name}/{session_key(original, 'main')}"  # as recorded: the salt is this run's only
            earlier = seen.setdefault(key, [])
            shared = max((common_prefix(ids, e) for e in earlier), default=0)
            sent = send(client, base, req, {**body, FORCED_OUTPUT_FIELD: forced}, api_key)
            earlier.append(ids + renderer.ids(forced))
            recomputed = (sent.prompt_tokens - (sent.cached_tokens or 0)) if sent.prompt_tokens is not None else None
            sessions.setdefault(key, Session(key)).turns.append(Turn(
                index=i, path=req["path"].split("?")[0], side=bool(reply.side), prompt_tokens=len(ids),
                truly_new=len(ids) - shared, status=sent.status,
                ttft_ms=round(sent.ttft_s * 1000, 1) if sent.ttft_s is not None else None,
                recomputed=recomputed, server_prompt_tokens=sent.prompt_tokens, error=sent.error))
    return {"trace": name, "family": family,
            "sessions": [{**s.summary(), "turns": [vars(t) for t in s.turns]} for s in sessions.values()]}


def server_sessions(base: str, api_key: str | None = None) -> list[dict[str, Any]] | None:
    """GET /v1/sessions and each session's detail, when the server has them."""
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(f"{base}/v1/sessions", headers=headers, timeout=30)
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    data = r.json()
    items = data.get("data", data.get("sessions", [])) if isinstance(data, dict) else data
    out = []
    for s in items if isinstance(items, list) else []:
        sid = s.get("id") or s.get("session_id") if isinstance(s, dict) else s
        detail = s if isinstance(s, dict) else {}
        if sid is not None:
            d = httpx.get(f"{base}/v1/sessions/{sid}", headers=headers, timeout=30)
            if d.status_code == 200:
                detail = d.json()
        raw_turns = detail.get("turns")
        turns: list[dict[str, Any]] = raw_turns if isinstance(raw_turns, list) else []
        out.append({"id": sid, "client": detail.get("client") or detail.get("profile"), "turns": len(turns),
                    "prompt_tokens": sum(t.get("prompt_tokens") or 0 for t in turns),
                    "reused_tokens": sum(t.get("reused_tokens") or 0 for t in turns),
                    "recomputed_tokens": sum(t.get("recomputed_tokens") or 0 for t in turns),
                    "divergence_causes": [t.get("divergence_cause") for t in turns],
                    "ttft_ms": [t.get("ttft_ms") for t in turns]})
    return out


# ---------------------------------------------------------------------------------------------- server
def serve_supports(flag: str) -> bool:
    out = subprocess.run([sys.executable, "-m", "freetoken_agent", "serve", "--help"], capture_output=True, text=True,
                         cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    return flag in out.stdout


@contextlib.contextmanager
def started_server(serve_args: list[str], log: Path | None = None, timeout: float = 300) -> Iterator[str]:
    log = log or Path(tempfile.mkstemp(prefix="ftreplay-", suffix=".log")[1])
    with serve_with(serve_args, log, startup_timeout=timeout) as url:
        yield url


def replay_traces(traces: list[dict[str, Any]], base_url: str | None = None, serve_args: list[str] | None = None,
                  anchor_policy: str | None = None, model: str | None = None,
                  api_key: str | None = None, isolate: bool = False) -> dict[str, Any]:
    """Replays every trace on one server (started here unless `base_url`), or with `isolate` each
    on a fresh one (no prefix left by another trace); returns the results."""
    family = traces[0].get("family", "qwen3_5") if traces else "qwen3_5"
    args = list(serve_args or ["--model", DEMO_FOR_FAMILY[family]])
    if model is None:
        model = args[args.index("--model") + 1] if "--model" in args else DEMO_FOR_FAMILY[family]
    note = None
    if anchor_policy and base_url is None:
        if serve_supports("--anchor-policy"):
            args += ["--anchor-policy", anchor_policy]
        else:
            note = "this server has no --anchor-policy (sessions branch not merged): default behaviour"
    renderer = Renderer(model)
    groups = [[t] for t in traces] if isolate and base_url is None else [traces]
    results: list[dict[str, Any]] = []
    reported: list[dict[str, Any]] | None = None
    for group in groups:
        with contextlib.ExitStack() as stack:
            base = base_url or stack.enter_context(started_server(args))
            results += [replay_trace(t, base, renderer, api_key=api_key) for t in group]
            seen = server_sessions(base, api_key)
        if seen is not None:
            reported = (reported or []) + seen
    return {"anchor_policy": anchor_policy, "serve_args": None if base_url else args, "note": note,
            "isolated": len(groups) > 1, "traces": results, "server_sessions": reported}


def table(result: dict[str, Any]) -> str:
    rows = ["| trace | session | requests | truly new | recomputed | ratio | mean TTFT ms | worst TTFT ms |",
            "|---|---|---:|---:|---:|---:|---:|---:|"]
    for t in result["traces"]:
        for s in t["sessions"]:
            rows.append(f"| {t['trace']} | {s['session'][:40]} | {s['requests']} | {s['truly_new_tokens']} | "
                        f"{s['recomputed_tokens']} | {s['ratio']} | {s['mean_ttft_ms']} | {s['worst_ttft_ms']} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="+", type=Path)
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--base-url", default=None)
    where.add_argument("--serve-args", default=None, help='e.g. "--model demo --kv-tokens 65536"')
    ap.add_argument("--anchor-policy", choices=["semantic", "positional", "user-only"], default=None)
    ap.add_argument("--model", default=None, help="model whose tokenizer renders prompts (default: from the trace)")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--isolate", action="store_true", help="a fresh server per trace (with --serve-args)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    traces = [json.loads(p.read_text()) for p in args.traces]
    result = replay_traces(traces, args.base_url, shlex.split(args.serve_args) if args.serve_args else None,
                           args.anchor_policy, args.model, args.api_key, args.isolate)
    print(json.dumps(result, indent=1) if args.json else table(result))
    failed = sum(s["failed"] for t in result["traces"] for s in t["sessions"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
