"""Run the real coding-agent CLIs for one non-interactive turn against our server.

Usage (after `evals/clients/install.sh`):

    PYTHONPATH=. python -m evals.clients.run_clients \
        [--clients claude-code,codex,opencode,openclaw] [--timeout 240] [--base-url URL]

What it does, per client, one after the other:
  * starts `freetoken-agent serve --model demo` on a free port with an access log (unless `--base-url`),
    with the 131072-token context window Claude Code needs;
  * puts a small recording reverse proxy in front of it, so the exact requests each client sends
    (method, path, headers, body) and the raw responses are captured without touching the server;
  * configures a throw-away HOME with `freetoken-agent configure CLIENT --write` (what a user runs)
    and runs the CLI there, in a work directory with a README.md, with no environment variable of
    its own: one turn, then the follow-up turn that continues the conversation;
  * judges both turns: the client exits 0, every model request was answered 200, every SSE response
    is well formed for its protocol, nothing on the client's output looks like a protocol error, the
    server logged no traceback while the client ran, and the follow-up sent the first turn back.

Writes `evals/clients/results.json` (or `--out`), `docs/clients.md` (`--markdown`), and with
`--record` the sanitised first request(s) of each client to `tests/clients/recorded/{client}.json`.
Exit status 0 when every selected client passed.

This module is the command line only. The work is done by its neighbours: `server` (starting the
server), `proxy` (the recording proxy), `sse` (SSE checks), `agents` (each client's config and
command), `runner` (one client's turn and its verdict), `record` (request shapes for the replay
test) and `report` (results JSON, Markdown). The names tests/clients/test_real_clients.py uses are
re-exported here.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from evals.clients.agents import CLIENTS, NODE24, Client, client_version, clients_dir_default, installed
from evals.clients.constants import API_KEY, DEFAULT_CLIENTS_DIR, FOLLOW_UP, MODEL, README, REPO, TASK
from evals.clients.proxy import HOP_BY_HOP, Exchange, RecordingProxy
from evals.clients.record import KEEP_HEADERS, recorded_requests, write_recording
from evals.clients.report import EXTRA_NOTES, NOTES, write_markdown, write_results
from evals.clients.runner import (
    STDERR_BENIGN,
    STDERR_ERRORS,
    STDOUT_ERRORS,
    error_lines,
    run_client,
    summarize_exchange,
)
from evals.clients.server import ACCESS, KV_TOKENS, free_port, serve, server_log_window
from evals.clients.sse import check_sse, parse_sse

__all__ = [
    "ACCESS", "API_KEY", "CLIENTS", "DEFAULT_CLIENTS_DIR", "EXTRA_NOTES", "FOLLOW_UP", "HOP_BY_HOP",
    "KEEP_HEADERS", "MODEL", "NODE24", "NOTES", "README", "REPO", "STDERR_BENIGN", "STDERR_ERRORS",
    "STDOUT_ERRORS", "TASK", "Client", "Exchange", "RecordingProxy", "check_sse", "client_version", "clients_dir_default",
    "error_lines", "free_port", "installed", "main", "parse_sse", "recorded_requests", "run_client",
    "serve", "server_log_window", "summarize_exchange", "write_markdown", "write_recording",
    "write_results",
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", default=",".join(CLIENTS), help="comma-separated subset of " + ",".join(CLIENTS))
    ap.add_argument("--timeout", type=float, default=240, help="seconds per client (default 240)")
    ap.add_argument("--base-url", default=None, help="use this running server instead of starting one")
    ap.add_argument("--clients-dir", type=Path, default=None, help="where install.sh put the CLIs")
    ap.add_argument("--model", default="demo",
                    help="model for the server: demo (default; its lm_head makes it end its turns), "
                         "demo, or a model directory")
    ap.add_argument("--max-output-tokens", type=int, default=512,
                    help="the output limit configure writes for each client, and the server's default")
    ap.add_argument("--out", type=Path, default=REPO / "evals" / "clients" / "results.json")
    ap.add_argument("--markdown", type=Path, default=REPO / "docs" / "clients.md")
    ap.add_argument("--no-markdown", action="store_true")
    ap.add_argument("--record", action="store_true",
                    help="save each client's first request(s) to tests/clients/recorded/{client}.json")
    ap.add_argument("--keep", action="store_true", help="keep each client's temp HOME/work dir and traffic")
    ap.add_argument("--from-results", type=Path, default=None,
                    help="only rewrite the Markdown from an existing results JSON")
    args = ap.parse_args(argv)
    if args.from_results:
        data = json.loads(args.from_results.read_text())
        write_markdown(args.markdown, data["results"], data["meta"])
        return 0
    names = [n.strip() for n in args.clients.split(",") if n.strip()]
    unknown = [n for n in names if n not in CLIENTS]
    if unknown:
        ap.error(f"unknown client(s) {unknown}; known: {list(CLIENTS)}")
    clients_dir = (args.clients_dir or clients_dir_default()).resolve()
    run_dir = Path(tempfile.mkdtemp(prefix="ftclients-run-"))
    server_log = run_dir / "server.log" if not args.base_url else None
    results: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        if args.base_url:
            upstream = args.base_url.rstrip("/")
            server_desc = f"--base-url {upstream}"
        else:
            assert server_log is not None
            upstream = stack.enter_context(serve(server_log, args.max_output_tokens, model=args.model))
            server_desc = (f"freetoken-agent serve --model {args.model} --served-model-name {MODEL} --log-level info "
                           f"--max-output-tokens {args.max_output_tokens} --kv-tokens {KV_TOKENS}")
        proxy = RecordingProxy(upstream).start()
        stack.callback(proxy.stop)
        for name in names:
            c = CLIENTS[name]
            print(f"[clients] {name}: running ...", file=sys.stderr, flush=True)
            r = run_client(c, proxy.url, proxy, server_log, clients_dir, args.timeout, keep=args.keep,
                           max_output_tokens=args.max_output_tokens)
            verdict = "PASS" if r.get("ok") else "FAIL"
            print(f"[clients] {name}: {verdict} " + " ".join(f"{t['turn']}={'ok' if t['ok'] else 'FAIL'}"
                                                               for t in r.get("turns", [])) +
                  f" {r.get('duration_s')}s requests={r.get('n_requests')} {r.get('endpoints')}",
                  file=sys.stderr, flush=True)
            for p in r.get("problems", []):
                print(f"[clients]   {p}", file=sys.stderr)
            if args.record and r.get("n_model_requests"):
                rec = recorded_requests(r, c.api)
                if rec:
                    write_recording(name, r["version"], rec)
            r.pop("_exchanges", None)
            results.append(r)
    meta = {"date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"), "server": server_desc,
            "server_log": str(server_log) if server_log else None, "timeout_s": args.timeout}
    write_results(args.out, results, meta)
    if not args.no_markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        write_markdown(args.markdown, results, meta)
    print(f"[clients] results: {args.out}; server log: {server_log}", file=sys.stderr)
    return 0 if results and all(r.get("ok") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
