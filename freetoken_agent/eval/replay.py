"""`freetoken-agent eval replay`: recorded model requests re-sent, in order, to any server.

Contract:
- `load(path)` reads a trace: the project's capture format (`evals/traces/data/*.json`: an object
  with `requests`, each `path`, `headers`, `body`, `reply`), or JSONL, one request per line:
  `path`, `headers` (optional), `body`, and optionally `response`, the recorded reply to force
  (the model's text as a string, or `{reasoning, content, tool_calls}`). Returns a `Trace`.
- `replay(traces, base, ...)` sends every request of every trace in order. Session identities
  (session headers, `prompt_cache_key`) are salted per run so replays never share a session; the
  body's `model` becomes the served one. Unless `force` is off, each request with a recorded reply
  carries the benchmark-only `freetoken_forced_output` field (the reply rendered in the model
  family's format), so every later prefix is exactly what the server computed before; requests
  without a reply are sent as they are (force off: all of them, for servers without the field).
  `max_tokens` caps the body's output budget; streamed chat completions ask for usage
  (`stream_options.include_usage`), which no server renders into the prompt.
- Per request it reports (report.py's turn fields): the prompt tokens and cached tokens from the
  response's usage; on our server (`/v1/sessions` answers) the session's newest turn gives
  reused / recomputed tokens, divergence cause and expert-cache hit rate, elsewhere recomputed is
  `prompt - cached` from usage; TTFT and decode tok/s as measured by this client (wire.py); with a
  `tokenizer` (a local model), truly new tokens: the prompt minus the longest prefix it shares with
  an earlier request of its session followed by that request's forced reply. The result's
  `baseline_text` (`baseline_text(traces)`) is what the single-turn decode baseline forces.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from freetoken_agent.eval.report import summarise
from freetoken_agent.eval.wire import ServerSessions, send, served_model

FORCED_OUTPUT_FIELD = "freetoken_forced_output"
OUTPUT_BUDGET_KEYS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


@dataclass
class Trace:
    name: str
    family: str
    requests: list[dict[str, Any]]  # path, headers, body, reply (dict) | response (str) | neither


def load(path: str | Path) -> Trace:
    p = Path(path)
    text = p.read_text()
    try:
        whole = json.loads(text)
    except ValueError:
        whole = None
    if isinstance(whole, dict) and isinstance(whole.get("requests"), list):
        name = whole.get("client") or p.stem
        if whole.get("variant"):
            name = f"{name}-{whole['variant']}"
        return Trace(str(name), str(whole.get("family") or "qwen3_5"), list(whole["requests"]))
    reqs: list[dict[str, Any]] = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{p}:{n}: not JSON ({e})") from e
        if not isinstance(obj, dict) or not isinstance(obj.get("path"), str) or not isinstance(obj.get("body"), dict):
            raise ValueError(f"{p}:{n}: each line needs a `path` string and a `body` object")
        resp = obj.get("response")
        req = {"path": obj["path"], "headers": obj.get("headers") or {}, "body": obj["body"]}
        if isinstance(resp, dict):
            req["reply"] = resp
        elif isinstance(resp, str):
            req["response"] = resp
        reqs.append(req)
    if not reqs:
        raise ValueError(f"{p}: no requests")
    return Trace(p.stem.removesuffix(".jsonl"), "qwen3_5", reqs)


def baseline_text(traces: list[Trace], least: int = 200, most: int = 320) -> str | None:
    """Plain text in the traces' own words for the single-turn decode baseline: their recorded
    replies' reasoning and content (and string responses) joined and cut at a space before `most`
    characters (about 64-80 tokens: the server decodes a forced reply whole), when they add up to
    `least`; else None (the eval's default baseline text). A baseline of other text would measure
    other routing, and with it another expert-cache hit rate, not the session's cost."""
    parts: list[str] = []
    for trace in traces:
        for req in trace.requests:
            if isinstance(req.get("response"), str):
                parts.append(str(req["response"]))
            reply = req.get("reply")
            if isinstance(reply, dict):
                parts += [str(reply[k]) for k in ("reasoning", "content") if isinstance(reply.get(k), str)]
    text = " ".join(" ".join(p.split()) for p in parts if p.strip())
    if len(text) > most:
        text = text[:most].rsplit(" ", 1)[0]
    return text if len(text) >= least else None


def _forced_text(req: dict[str, Any], family: str) -> str | None:
    if isinstance(req.get("response"), str):
        return str(req["response"])
    from evals.traces.replay import reply_of
    from evals.traces.script import render
    from evals.traces.scripted import normalise, thinking_on

    reply = reply_of(req)
    nreq = normalise(req["path"], req["body"])
    if reply is None or nreq is None:
        return None
    return render(reply, family, thinking_on(nreq))


def _headers(req: dict[str, Any], api_key: str | None) -> dict[str, str]:
    out = {k: str(v) for k, v in (req.get("headers") or {}).items()
           if k.lower() not in ("content-length", "authorization", "x-api-key", "host")}
    if api_key:
        out["authorization"] = f"Bearer {api_key}"
        out["x-api-key"] = api_key
    return out


def replay(traces: list[Trace], base: str, force: bool = True, tokenizer: str | None = None,
           api_key: str | None = None, model: str | None = None, max_tokens: int | None = None,
           timeout: float = 900, progress: Any = None) -> dict[str, Any]:
    from evals.traces.replay import Renderer, salted, session_key
    from freetoken_agent.sessions.echo import common_prefix

    base = base.rstrip("/").removesuffix("/v1")
    auth = {"authorization": f"Bearer {api_key}"} if api_key else {}
    model = model or served_model(base, auth)
    server = ServerSessions(base, auth)
    renderer = Renderer(tokenizer) if tokenizer else None
    turns: list[dict[str, Any]] = []
    runs: list[dict[str, Any]] = []
    total = sum(len(t.requests) for t in traces)
    done = 0
    with httpx.Client(timeout=timeout) as client:
        for trace in traces:
            sent_reqs = salted({"requests": trace.requests})["requests"]
            seen: dict[str, list[list[int]]] = {}
            mine: list[dict[str, Any]] = []
            for i, (orig, req) in enumerate(zip(trace.requests, sent_reqs, strict=True)):
                done += 1
                body = req.get("body")
                if not isinstance(body, dict) or req["path"].split("?")[0].endswith("count_tokens"):
                    continue
                body = dict(body)
                forced = _forced_text(req, trace.family) if force else None
                if force and forced is None and "reply" in req:
                    continue  # a recorded reply this server's adapters refuse to render
                if forced is not None:
                    body[FORCED_OUTPUT_FIELD] = forced
                if model:
                    body["model"] = model
                if max_tokens is not None:
                    for k in OUTPUT_BUDGET_KEYS:
                        if k in body:
                            body[k] = min(int(body[k]), max_tokens)
                    if not any(k in body for k in OUTPUT_BUDGET_KEYS):
                        body["max_tokens"] = max_tokens
                if body.get("stream") and req["path"].split("?")[0].endswith("/chat/completions"):
                    body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
                key = session_key(orig, "main")
                truly_new = None
                ids: list[int] | None = None
                if renderer is not None:
                    try:
                        ids = renderer.prompt_ids(req["path"], req["body"])
                    except ValueError:
                        ids = None
                if ids is not None:
                    earlier = seen.setdefault(key, [])
                    truly_new = len(ids) - max((common_prefix(ids, e) for e in earlier), default=0)
                s = send(client, base, req["path"], body, _headers(req, api_key))
                if ids is not None and renderer is not None:
                    seen[key].append(ids + (renderer.ids(forced) if forced else []))
                turn: dict[str, Any] = {
                    "run": trace.name, "index": i, "session": key, "path": req["path"].split("?")[0],
                    "status": s.status, "error": s.error, "prompt_tokens": s.prompt_tokens,
                    "cached_tokens": s.cached_tokens, "completion_tokens": s.completion_tokens,
                    "reused_tokens": s.cached_tokens,
                    "recomputed_tokens": None if s.prompt_tokens is None else s.prompt_tokens - (s.cached_tokens or 0),
                    "truly_new_tokens": truly_new,
                    "ttft_ms": None if s.ttft_s is None else round(s.ttft_s * 1000, 1),
                    "decode_tps": None if s.decode_tps is None else round(s.decode_tps, 2),
                    "divergence_cause": None, "expert_cache_hit_rate": None, "server_session": None,
                    "server_ttft_ms": None}
                if server.available and s.status == 200:
                    latest = server.latest_turn()
                    if latest is not None:
                        sid, st = latest
                        turn.update(server_session=sid, prompt_tokens=st.get("prompt_tokens"),
                                    reused_tokens=st.get("reused_tokens"),
                                    recomputed_tokens=st.get("recomputed_tokens"),
                                    divergence_cause=st.get("divergence_cause"),
                                    expert_cache_hit_rate=st.get("expert_cache_hit_rate"),
                                    server_ttft_ms=st.get("ttft_ms"))
                mine.append(turn)
                if progress is not None:
                    progress(done, total, trace.name)
            turns += mine
            runs.append({"run": trace.name, **summarise(mine)})
    return {"eval": "replay", "base_url": base, "model": model, "forced": force,
            "server_sessions": server.available, "runs": runs, "turns": turns,
            "baseline_text": baseline_text(traces)}
