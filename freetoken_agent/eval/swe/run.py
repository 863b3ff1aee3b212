"""`freetoken-agent eval swe`: each task in a fresh checkout, the client driven through its user
turns, then the task's tests decide.

Contract: `run_swe(args, base)` loads the tasks (`--tasks`, `--only`), and for each one (up to
`--concurrency` at once, the paper's W3): checks the repository out fresh (tasks.checkout), starts
a recording proxy in front of `base` (with `--scripted` the `ScriptedProxy` of evals/traces,
which sets the benchmark-only forced-output field from the task's script on every model request),
drives the client through the first `--turns` user prompts (clients.drive), and judges the
checkout with the task's tests (tasks.judge). A client that sends no session header of its own
gets `x-session-id: eval-<task>-<salt>` from the proxy, so the task's server session is known;
its turns are then read from `GET /v1/sessions/{id}` (our server), each with the decode rate
from the proxy's timing ((completion - 1) / (request time - TTFT)), and, with a local tokenizer
(`renderer_for`: `--tokenizer`, or the model of a server the eval started), its truly new tokens:
the prompt after the longest prefix shared with an earlier request of its session plus that
request's forced reply (`truly_new`; scripted runs only). Returns the report dict
(report.py): per task `success`, the tests, the client's turn exits and the token / TTFT sums.
`progress` (progress.py's callback, optional) hears `(tasks done, tasks, running task ids)` when
the run begins and whenever a task starts or ends.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import tempfile
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

from evals.clients.proxy import Exchange, RecordingProxy
from evals.traces.replay import Renderer, common_prefix
from evals.traces.scripted import ScriptedProxy
from evals.traces.sse import usage_of
from freetoken_agent.eval.report import summarise
from freetoken_agent.eval.swe.clients import drive
from freetoken_agent.eval.swe.script import TaskScript, plans, prompts
from freetoken_agent.eval.swe.tasks import Instance, checkout, judge, load_tasks
from freetoken_agent.eval.wire import ServerSessions, served_model

SESSION_HEADERS = ("x-claude-code-session-id", "x-session-affinity", "x-session-id", "session_id", "session-id")
MODEL_SUFFIXES = ("/messages", "/chat/completions", "/responses")


class _Named:
    """Mixin: names the session of a client that sends no session header."""

    session_id: str

    def _forward(self, h: BaseHTTPRequestHandler, ex: Exchange) -> None:
        if not any(k in ex.req_headers for k in SESSION_HEADERS):
            h.headers["x-session-id"] = self.session_id
            ex.req_headers["x-session-id"] = self.session_id
        super()._forward(h, ex)  # type: ignore[misc]


class NamedProxy(_Named, RecordingProxy):
    pass


class NamedScriptedProxy(_Named, ScriptedProxy):
    pass


def _is_model(ex: Exchange) -> bool:
    return ex.method == "POST" and ex.path.split("?")[0].endswith(MODEL_SUFFIXES)


def _exchange_usage(ex: Exchange) -> dict[str, int]:
    usage: dict[str, int] = {}
    text = ex.resp_body.decode("utf-8", "replace")
    for chunk in ([text] if not text.lstrip().startswith(("data:", "event:")) else
                  [ln[5:] for ln in text.splitlines() if ln.startswith("data:")]):
        try:
            got = usage_of(json.loads(chunk))
        except ValueError:
            continue
        usage.update(got or {})
    return usage


def _session_of(ex: Exchange) -> str:
    return next((ex.req_headers[k] for k in SESSION_HEADERS if ex.req_headers.get(k)), "")


def truly_new(model: list[Exchange], renderer: Renderer | None) -> list[int | None]:
    """Per model request: its prompt tokens after the longest prefix shared with an earlier request
    of its session followed by that request's forced reply (None without a renderer, for a body the
    adapters refuse, or once a reply of the session was not forced: its text is unknown)."""
    out: list[int | None] = []
    seen: dict[str, list[list[int]] | None] = {}
    for ex in model:
        key = _session_of(ex)
        body = getattr(ex, "client_body", None) or ex.body_json()
        earlier = seen.setdefault(key, [])
        ids = None
        if renderer is not None and isinstance(body, dict):
            with contextlib.suppress(ValueError):
                ids = renderer.prompt_ids(ex.path, body)
        if ids is None or earlier is None:
            out.append(None)
            continue
        out.append(len(ids) - max((common_prefix(ids, e) for e in earlier), default=0))
        forced = getattr(ex, "forced", None)
        if forced is None:
            seen[key] = None
        else:
            earlier.append(ids + renderer.ids(forced))  # type: ignore[union-attr]
    return out


def model_turns(name: str, exchanges: list[Exchange], server: ServerSessions,
                renderer: Renderer | None = None) -> list[dict[str, Any]]:
    model = [e for e in exchanges if _is_model(e)]
    sids = list(dict.fromkeys(_session_of(e) for e in model))
    new = truly_new(model, renderer)
    server_turns: list[dict[str, Any]] = []
    if server.available:
        for sid in sids:
            server_turns += [{**t, "server_session": sid} for t in server.detail(sid).get("turns") or []]
    out = []
    for i, ex in enumerate(model):
        u = _exchange_usage(ex)
        st = server_turns[i] if len(server_turns) == len(model) else {}
        ttft = st.get("ttft_ms")
        n = st.get("completion_tokens", u.get("completion"))
        tps = None
        if n and n > 1 and ttft is not None and ex.duration > ttft / 1000:
            tps = round((n - 1) / (ex.duration - ttft / 1000), 2)
        prompt = st.get("prompt_tokens", u.get("prompt"))
        out.append({"run": name, "index": i, "status": ex.status, "path": ex.path.split("?")[0],
                    "prompt_tokens": prompt,
                    "reused_tokens": st.get("reused_tokens", u.get("cached")),
                    "recomputed_tokens": st.get("recomputed_tokens",
                                                None if prompt is None else prompt - u.get("cached", 0)),
                    "truly_new_tokens": new[i], "ttft_ms": ttft, "decode_tps": tps, "completion_tokens": n,
                    "divergence_cause": st.get("divergence_cause"),
                    "expert_cache_hit_rate": st.get("expert_cache_hit_rate"),
                    "server_session": st.get("server_session"), "request_s": round(ex.duration, 3)})
    return out


def renderer_for(args: argparse.Namespace) -> Renderer | None:
    """The local tokenizer that counts truly new tokens: `--tokenizer`, else `--model` when the
    eval started the server itself, else none."""
    spec = getattr(args, "tokenizer", None) or (None if getattr(args, "base_url", None) else getattr(args, "model", None))
    return Renderer(spec) if spec else None


def run_task(inst: Instance, args: argparse.Namespace, base: str, model: str, server: ServerSessions,
             family: str, renderer: Renderer | None = None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    tmp = Path(tempfile.mkdtemp(prefix=f"fteval-swe-{inst.instance_id}-"))
    work = checkout(inst, tmp / "work")
    sid = f"eval-{inst.instance_id}-{uuid.uuid4().hex[:8]}"
    proxy: RecordingProxy
    if args.scripted:
        proxy = NamedScriptedProxy(base, TaskScript(str(work), family, plans(inst, args.turns)), family)
    else:
        proxy = NamedProxy(base)
    proxy.session_id = sid  # type: ignore[attr-defined]
    proxy.start()
    clients_dir = Path(args.clients_dir) if args.clients_dir else None
    if clients_dir is None:
        from evals.clients.agents import clients_dir_default

        clients_dir = clients_dir_default()
    try:
        client_turns = drive(args.client, work, proxy.url, model, prompts(inst, args.turns), clients_dir)
        exchanges = proxy.since(0)
    finally:
        proxy.stop()
    verdict = judge(inst, work)
    turns = model_turns(inst.instance_id, exchanges, server, renderer)
    run = {"run": inst.instance_id, "success": verdict["success"], "tests": verdict["tests"],
           "client_turns": client_turns, **summarise(turns)}
    if not verdict["success"]:
        run["test_output"] = verdict["output"]
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"{inst.instance_id}: {'solved' if verdict['success'] else 'FAILED'} "
          f"({len(turns)} model requests)", file=sys.stderr, flush=True)
    return run, turns


class TaskProgress:
    """Tells a progress callback how many tasks are done and which are running."""

    def __init__(self, progress: Any, total: int) -> None:
        self.progress, self.total = progress, total
        self.done = 0
        self.running: list[str] = []
        self.lock = threading.Lock()

    def _tell(self, last: str | None = None) -> None:
        if self.progress is not None:
            self.progress(self.done, self.total, ", ".join(self.running) or last)

    def start(self, task: str | None = None) -> None:
        with self.lock:
            if task is not None:
                self.running.append(task)
            self._tell()

    def end(self, task: str) -> None:
        with self.lock:
            self.running.remove(task)
            self.done += 1
            self._tell(task)


def run_swe(args: argparse.Namespace, base: str, progress: Any = None) -> dict[str, Any]:
    tasks = load_tasks(args.tasks, args.only.split(",") if args.only else None)
    model = served_model(base) or "default"
    server = ServerSessions(base)
    family = getattr(args, "family", "qwen3_5")
    renderer = renderer_for(args)
    shown = TaskProgress(progress, len(tasks))
    shown.start()

    def one(t: Instance) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        shown.start(t.instance_id)
        try:
            return run_task(t, args, base, model, server, family, renderer)
        finally:
            shown.end(t.instance_id)

    with ThreadPoolExecutor(max_workers=args.concurrency) as pool:
        results = list(pool.map(one, tasks))
    runs = [r for r, _ in results]
    turns = [t for _, ts in results for t in ts]
    return {"eval": "swe", "base_url": base, "model": model, "client": args.client, "forced": bool(args.scripted),
            "tasks": args.tasks, "turns_per_task": args.turns, "concurrency": args.concurrency,
            "solved": sum(1 for r in runs if r["success"]), "runs": runs, "turns": turns}
