"""`freetoken-agent eval replay|swe|openclaw`: the argument parsers and the dispatch.

Contract: `add_eval_parser(sub)` defines the sub-commands without importing anything heavy (the
`--help` of the whole CLI stays fast); `run_eval(args)` imports the eval it runs. Every eval talks
to `--base-url` (any OpenAI / Anthropic-compatible server) or, without it, to a `freetoken-agent
serve` it starts on a free loopback port with `--model` and `--serve-args`, and writes its report
(JSON, Markdown, PNG) under `--out`; the Markdown is also printed. Exit 0 when every request
answered (replay) or every task succeeded (swe, openclaw), else 1.
`--anchor-policy P[,P...]` (only with a server the eval starts: with `--base-url`, or next to an
`--anchor-policy` inside `--serve-args`, it is an argument error; an unknown name too) runs the
whole workload once per policy, in order, each on a fresh `serve --anchor-policy P`, and records
each run under its policy (`anchor_policy`, and `server_anchor_policy`, what the server's
`/v1/sessions` says it runs); several policies make one report comparing them (report.compare).
While a workload runs, progress.load_progress shows its bar (replay: requests, swe: tasks with the
running ones as the step, openclaw: user turns), the step naming the policy when there are several.
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from freetoken_agent.argtypes import positive_int
from freetoken_agent.progress import ProgressFn
from freetoken_agent.serve import ANCHOR_POLICIES

CLIENTS = ("mini-swe-agent", "opencode", "claude-code", "codex", "openclaw")
LABELS = {"replay": "replaying", "swe": "swe tasks", "openclaw": "openclaw turns"}


def anchor_policies(text: str) -> list[str]:
    """`--anchor-policy`: one or more of ANCHOR_POLICIES, comma-separated, each once."""
    names = [n.strip() for n in text.split(",")]
    for n in names:
        if n not in ANCHOR_POLICIES:
            raise argparse.ArgumentTypeError(f"unknown anchor policy {n!r} (known: {', '.join(ANCHOR_POLICIES)})")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise argparse.ArgumentTypeError(f"anchor policy named twice: {', '.join(twice)}")
    return names


def _serve_args_policy(serve_args: str) -> bool:
    try:
        words = shlex.split(serve_args)
    except ValueError:
        words = serve_args.split()
    return any(w == "--anchor-policy" or w.startswith("--anchor-policy=") for w in words)


def conflict(ns: argparse.Namespace) -> str | None:
    """Why the server options given so far cannot go together, or None."""
    if not getattr(ns, "anchor_policies", None):
        return None
    if getattr(ns, "base_url", None):
        return ("--anchor-policy needs a server this eval starts (one per policy); it cannot go with --base-url "
                "(start that server with `serve --anchor-policy P` instead)")
    if _serve_args_policy(getattr(ns, "serve_args", "") or ""):
        return "--anchor-policy is given twice: as the eval's flag and inside --serve-args (keep one)"
    return None


class _Checked(argparse.Action):
    """Stores the value, then refuses a combination `conflict` names, whichever option came last."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        why = conflict(namespace)
        if why:
            parser.error(why)


def _server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default=None, action=_Checked,
                   help="a running OpenAI / Anthropic-compatible server (default: start freetoken-agent serve)")
    p.add_argument("--model", default="demo", metavar="PATH|HF_ID|demo",
                   help="the model of the server this eval starts (without --base-url)")
    p.add_argument("--serve-args", default="", action=_Checked,
                   help='more `serve` flags for that server, e.g. "--kv-tokens 65536"')
    p.add_argument("--anchor-policy", dest="anchor_policies", type=anchor_policies, default=None, action=_Checked,
                   metavar="P[,P...]",
                   help=f"run the whole workload once per anchor policy ({', '.join(ANCHOR_POLICIES)}), each on a "
                        "fresh server started with `serve --anchor-policy P`, and compare them in one report "
                        "(default: the server's own, no comparison; not with --base-url)")
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
def server(args: argparse.Namespace, policy: str | None = None, info: dict[str, Any] | None = None) -> Iterator[str]:
    """`--base-url`, or a `freetoken-agent serve` started for this eval (with `--anchor-policy
    policy` when one is given; `info["log"]` is then its log file)."""
    if args.base_url:
        yield args.base_url.rstrip("/").removesuffix("/v1")
        return
    from evals.clients.server import serve_with

    log = Path(tempfile.mkstemp(prefix="fteval-", suffix=".log")[1])
    extra = ["--anchor-policy", policy] if policy else []
    shown = f" --anchor-policy {policy}" if policy else ""
    print(f"starting freetoken-agent serve --model {args.model}{shown} (log: {log})", file=sys.stderr)
    if info is not None:
        info["log"] = str(log)
    with serve_with(["--model", args.model, *shlex.split(args.serve_args), *extra], log, startup_timeout=600) as url:
        yield url


def _baseline(args: argparse.Namespace, url: str, model: object, force: bool, text: str | None = None) -> float | None:
    from freetoken_agent.eval.wire import baseline_decode

    auth = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    return baseline_decode(url, str(model) if model else None, force, auth, text=text)


def _placement(args: argparse.Namespace, url: str) -> dict[str, Any]:
    """What the server says of its anchor policy and placement (wire.ServerSessions.placement)."""
    import httpx

    from freetoken_agent.eval.wire import ServerSessions

    auth = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        return ServerSessions(url, auth).placement()
    except (httpx.HTTPError, ValueError) as e:  # keep the run's numbers
        print(f"could not read the server's sessions: {e}", file=sys.stderr)
        return {"policy": None, "checkpoints": None, "anchor_kinds": {}}


def _finish(args: argparse.Namespace, result: dict[str, object], ok: bool) -> int:
    from freetoken_agent.eval.report import markdown, write

    paths = write(args.out, result)
    print(markdown(result))
    print("wrote " + ", ".join(str(p) for p in paths), file=sys.stderr)
    return 0 if ok else 1


def _ok(result: dict[str, Any]) -> bool:
    if result["eval"] == "replay":
        return all(r["failed"] == 0 for r in result["runs"])
    return all(r.get("success") for r in result["runs"])


def _named(progress: ProgressFn, policy: str | None, k: int, n: int) -> ProgressFn:
    """The progress callback of policy `k` of `n`: its step names the policy when there are several."""
    if n < 2:
        return progress

    def update(done: int, total: int, step: str | None = None) -> None:
        head = f"{policy} ({k + 1}/{n})"
        progress(done, total, f"{head}: {step}" if step else head)

    return update


def _run_one(args: argparse.Namespace, policy: str | None, k: int, n: int, traces: list[Any]) -> dict[str, Any]:
    """The eval's whole workload against one server (a fresh one per policy); with a policy, what
    the server says of its placement is read before the single-turn decode baseline is sent."""
    from freetoken_agent.eval.report import add_decode_drop
    from freetoken_agent.progress import load_progress

    info: dict[str, Any] = {}
    with server(args, policy, info) as url, load_progress(LABELS[args.eval_command]) as bar:
        progress = _named(bar, policy, k, n)
        text: str | None = None
        if args.eval_command == "replay":
            from freetoken_agent.eval.replay import replay

            tokenizer = args.tokenizer or (None if args.base_url else args.model)
            result = replay(traces, url, force=args.force, tokenizer=tokenizer, api_key=args.api_key,
                            model=args.served_model, max_tokens=args.max_tokens, progress=progress)
            force, text = args.force, result["baseline_text"]
        elif args.eval_command == "swe":
            from freetoken_agent.eval.swe.run import run_swe

            result, force = run_swe(args, url, progress=progress), args.scripted
        elif args.eval_command == "openclaw":
            from freetoken_agent.eval.openclaw import run_openclaw

            result, force = run_openclaw(args, url, progress=progress), args.scripted
        else:
            raise ValueError(f"unknown eval {args.eval_command!r}")
        if policy is not None:
            placed = _placement(args, url)
            result.update(anchor_policy=policy, server_anchor_policy=placed["policy"],
                          server_checkpoints=placed["checkpoints"], server_anchor_kinds=placed["anchor_kinds"],
                          server_log=info.get("log"))
        add_decode_drop(result, _baseline(args, url, result["model"], force, text))
    return result


def run_eval(args: argparse.Namespace) -> int:
    from freetoken_agent.eval.report import compare

    traces: list[Any] = []
    if args.eval_command == "replay":  # read before any server starts: a bad trace fails at once
        from freetoken_agent.eval.replay import load

        traces = [load(p) for p in args.traces]
    policies: list[str | None] = list(getattr(args, "anchor_policies", None) or [None])
    results = [_run_one(args, p, k, len(policies), traces) for k, p in enumerate(policies)]
    ok = all(_ok(r) for r in results)
    return _finish(args, results[0] if len(results) == 1 else compare(results), ok)
