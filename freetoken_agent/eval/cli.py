"""`freetoken-agent eval replay|swe|openclaw`: the argument parsers and the dispatch.

Contract: `add_eval_parser(sub)` defines the sub-commands without importing anything heavy (the
`--help` of the whole CLI stays fast); `run_eval(args)` imports the eval it runs. Every eval talks
to `--base-url` (any OpenAI / Anthropic-compatible server) or, without it, to a `freetoken-agent
serve` it starts on a free loopback port with `--model` and `--serve-args`, and writes its report
(JSON, Markdown, PNG) under `--out`; the Markdown is also printed. Exit 0 when every request
answered (replay) or every task succeeded (swe, openclaw), else 1.
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from freetoken_agent.argtypes import positive_int

CLIENTS = ("mini-swe-agent", "opencode", "claude-code", "codex", "openclaw")


def _server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default=None,
                   help="a running OpenAI / Anthropic-compatible server (default: start freetoken-agent serve)")
    p.add_argument("--model", default="demo", metavar="PATH|HF_ID|demo",
                   help="the model of the server this eval starts (without --base-url)")
    p.add_argument("--serve-args", default="", help='more `serve` flags for that server, e.g. "--kv-tokens 65536"')
    p.add_argument("--api-key", default=None, help="key sent to the server")
    p.add_argument("--out", default="eval-out", help="report directory (result.json, report.md, *.png)")


def add_eval_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    ev = sub.add_parser("eval", help="agent workloads against a server: trace replay, SWE tasks, OpenClaw",
                        description="Run an agent workload against our server or any compatible one and "
                                    "report prompt / reused / recomputed tokens, TTFT and decode rate per turn.")
    es = ev.add_subparsers(dest="eval_command", required=True, metavar="EVAL", parser_class=type(ev))
    rp = es.add_parser("replay", help="replay recorded request traces (evals/traces format or JSONL)")
    rp.add_argument("traces", nargs="+", help="trace files: evals/traces/data/*.json or JSONL (path, headers, body, "
                                              "response)")
    _server_args(rp)
    rp.add_argument("--no-force", dest="force", action="store_false",
                    help="do not send the benchmark-only forced-output field (servers without it): replies are "
                         "sampled, so later prefixes differ from the recording")
    rp.add_argument("--tokenizer", default=None, metavar="PATH|demo",
                    help="a local model whose tokenizer counts truly new tokens (default: --model when this eval "
                         "starts the server, else none)")
    rp.add_argument("--served-model", default=None, help="model name to put in each body (default: /v1/models)")
    rp.add_argument("--max-tokens", type=positive_int, default=None, help="cap each request's output budget")
    sw = es.add_parser("swe", help="SWE-bench-shaped tasks through a real agent client")
    sw.add_argument("--client", default="mini-swe-agent", choices=CLIENTS, help="the agent client driven")
    sw.add_argument("--tasks", default="builtin", help="builtin, a directory of tasks, or SWE-bench JSONL")
    sw.add_argument("--only", default=None, help="comma-separated instance ids to run (default: all)")
    sw.add_argument("--scripted", action="store_true",
                    help="force each reply from the task's script (the reference patch through the client's edit "
                         "tool): measures the system, not the model")
    sw.add_argument("--turns", type=positive_int, default=3, help="scripted user turns per task (1-3)")
    sw.add_argument("--concurrency", type=positive_int, default=1, help="tasks run at once")
    sw.add_argument("--family", default="qwen3_5", choices=["qwen3_5", "qwen3", "gpt_oss"],
                    help="the served model's tool-call format, for --scripted replies")
    sw.add_argument("--tokenizer", default=None, metavar="PATH|demo|demo:ARCH",
                    help="a local model whose tokenizer counts truly new tokens (default: --model when this eval "
                         "starts the server, else none)")
    sw.add_argument("--clients-dir", default=None, help="where the npm clients are installed (default .clients/)")
    _server_args(sw)
    oc = es.add_parser("openclaw", help="email / calendar assistant over local SMTP and CalDAV, 13 checked turns (W4)")
    oc.add_argument("--client", default="openclaw", choices=["openclaw", "mini-swe-agent"],
                    help="the agent client driven (mini-swe-agent where OpenClaw is not installed)")
    oc.add_argument("--scripted", action="store_true", help="force each reply from the scenario's script")
    oc.add_argument("--turns", type=positive_int, default=13, help="run the scenario's first N user turns")
    oc.add_argument("--family", default="qwen3_5", choices=["qwen3_5", "qwen3", "gpt_oss"],
                    help="the served model's tool-call format, for --scripted replies")
    oc.add_argument("--tokenizer", default=None, metavar="PATH|demo|demo:ARCH",
                    help="a local model whose tokenizer counts truly new tokens (default: --model when this eval "
                         "starts the server, else none)")
    oc.add_argument("--clients-dir", default=None, help="where the npm clients are installed (default .clients/)")
    _server_args(oc)


@contextlib.contextmanager
def server(args: argparse.Namespace) -> Iterator[str]:
    """`--base-url`, or a `freetoken-agent serve` started for this eval."""
    if args.base_url:
        yield args.base_url.rstrip("/").removesuffix("/v1")
        return
    from evals.clients.server import serve_with

    log = Path(tempfile.mkstemp(prefix="fteval-", suffix=".log")[1])
    print(f"starting freetoken-agent serve --model {args.model} (log: {log})", file=sys.stderr)
    with serve_with(["--model", args.model, *shlex.split(args.serve_args)], log, startup_timeout=600) as url:
        yield url


def _baseline(args: argparse.Namespace, url: str, model: object, force: bool, text: str | None = None) -> float | None:
    from freetoken_agent.eval.wire import baseline_decode

    auth = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    return baseline_decode(url, str(model) if model else None, force, auth, text=text)


def _finish(args: argparse.Namespace, result: dict[str, object], ok: bool) -> int:
    from freetoken_agent.eval.report import markdown, write

    paths = write(args.out, result)
    print(markdown(result))
    print("wrote " + ", ".join(str(p) for p in paths), file=sys.stderr)
    return 0 if ok else 1


def run_eval(args: argparse.Namespace) -> int:
    from freetoken_agent.eval.report import add_decode_drop
    from freetoken_agent.progress import load_progress

    if args.eval_command == "replay":
        from freetoken_agent.eval.replay import load, replay

        traces = [load(p) for p in args.traces]
        tokenizer = args.tokenizer or (None if args.base_url else args.model)
        with server(args) as url, load_progress("replaying") as progress:
            result = replay(traces, url, force=args.force, tokenizer=tokenizer, api_key=args.api_key,
                            model=args.served_model, max_tokens=args.max_tokens, progress=progress)
            add_decode_drop(result, _baseline(args, url, result["model"], args.force, result["baseline_text"]))
        return _finish(args, result, all(r["failed"] == 0 for r in result["runs"]))  # type: ignore[index]
    if args.eval_command == "swe":
        from freetoken_agent.eval.swe.run import run_swe

        with server(args) as url:
            result = run_swe(args, url)
            add_decode_drop(result, _baseline(args, url, result["model"], args.scripted))
        return _finish(args, result, all(r.get("success") for r in result["runs"]))  # type: ignore[union-attr]
    if args.eval_command == "openclaw":
        from freetoken_agent.eval.openclaw import run_openclaw

        with server(args) as url:
            result = run_openclaw(args, url)
            add_decode_drop(result, _baseline(args, url, result["model"], args.scripted))
        return _finish(args, result, all(r.get("success") for r in result["runs"]))  # type: ignore[union-attr]
    raise ValueError(f"unknown eval {args.eval_command!r}")
