"""Capture a multi-turn agent trace from a real coding-agent CLI against the scripted backend.

Usage:

    PYTHONPATH=. /work/venv/bin/python -m evals.traces.capture --client claude-code|opencode|openclaw|codex \
        [--variant prune] [--model demo] [--timeout 300] [--keep]

Contract: starts `freetoken-agent serve` (the hybrid Qwen3.5 demo unless `--model`), puts a
`ScriptedProxy` in front of it, writes the task repository (`script.TASK_FILES`, plus the big data
files for a variant) into a throw-away work dir, configures the client in a throw-away HOME (the
config of `evals.clients.agents`, with longer output limits and the variant's history-edit
setting), and runs the real CLI once per user prompt (`script.prompts(variant)`), each later turn
continuing the same session the client's own way. The client runs its real tools on the work dir
and edits its history as it does between turns. Every model request is stored, sanitised, in
`evals/traces/data/{client}[-{variant}].json`: `requests` in order, each with method, path, kept
headers, the client's body (without the injected field), the scripted `reply` and its rendered
`forced_output`, the response status, and `side` (a side request such as title generation).
Exit status 0 when every turn exited 0 and at least one model request was answered 200.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from evals.clients.agents import CLIENTS, NODE24, Client, client_version, clients_dir_default, installed
from evals.clients.constants import API_KEY, MODEL, REPO
from evals.clients.home import configure_home
from evals.clients.server import serve
from evals.traces.sanitise import Sanitiser
from evals.traces.script import BIG_FILES, TASK_FILES, Script, big_file, prompts
from evals.traces.scripted import ScriptedProxy

DATA = Path(__file__).resolve().parent / "data"
MODEL_SUFFIXES = ("/messages", "/chat/completions", "/responses", "/count_tokens")
FAMILY = {"demo": "qwen3_5", "demo:qwen3_5_moe": "qwen3_5", "demo:qwen3_moe": "qwen3"}


def trace_path(client: str, variant: str | None) -> Path:
    return DATA / (f"{client}-{variant}.json" if variant else f"{client}.json")


def configure(c: Client, home: Path, work: Path, base: str, env: dict[str, str], variant: str | None) -> None:
    """The client's config as `freetoken-agent configure --write` writes it, adjusted for a multi-turn
    scripted task (a 131072-token window, 4096 output tokens, the variant's pruning)."""
    configure_home(c.name, home, base, 4096, context_window=131072)
    if c.name == "opencode":
        path = home / ".config" / "opencode" / "opencode.json"
        cfg = json.loads(path.read_text())
        if variant:  # opt-in pruning of old tool outputs (1.18.33 default: off)
            cfg["compaction"] = {"prune": True, "auto": False}
        path.write_text(json.dumps(cfg, indent=2))
    elif c.name == "openclaw":
        path = home / ".openclaw" / "openclaw.json"
        cfg = json.loads(path.read_text())
        cfg["agents"]["defaults"].update(workspace=str(work), skipBootstrap=True)
        model = cfg["models"]["providers"]["freetoken"]["models"][0]
        if variant:
            # cache-ttl pruning runs only on cache-TTL-eligible routes (isCacheTtlEligibleProvider:
            # Anthropic-family, i.e. api "anthropic-messages" for a custom provider), so this
            # variant talks Anthropic Messages to the same server. 350k characters of logs against
            # a 200k-token window (x4 characters) is 44%: over the 30% at which soft-trim rounds run.
            provider = cfg["models"]["providers"]["freetoken"]
            provider["api"] = "anthropic-messages"
            provider["baseUrl"] = base  # the Anthropic SDK appends /v1/messages
            model["contextWindow"] = 200000
            cfg["agents"]["defaults"]["contextPruning"] = {"mode": "cache-ttl", "ttl": "1s"}
        path.write_text(json.dumps(cfg, indent=2))


def turn_args(c: Client, turn: int, prompt: str, work: Path, home: Path) -> list[str]:
    """The CLI arguments of user turn `turn` (0 starts the session, later ones continue it)."""
    if c.name == "claude-code":
        cont = ["-c"] if turn else []
        return ["-p", *cont, prompt, "--allowedTools", "Read Edit Bash", "--max-turns", "12"]
    if c.name == "opencode":
        return ["run", *(["--continue"] if turn else []), prompt]
    if c.name == "openclaw":
        return ["agent", "--local", "--session-id", "trace-session", "--thinking", "low", "--message", prompt]
    if c.name == "codex":
        flags = ["--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox"]
        return ["exec", "resume", "--last", *flags, prompt] if turn else ["exec", *flags, prompt]
    raise ValueError(c.name)


def base_env(c: Client, tmp: Path, home: Path, clients_dir: Path) -> dict[str, str]:
    path = os.environ.get("PATH", "/usr/bin:/bin")
    if c.needs_node24:
        path = str(clients_dir / NODE24) + os.pathsep + path
    return {"PATH": path, "HOME": str(home), "USER": "user", "LANG": "C.UTF-8", "TERM": "dumb", "NO_COLOR": "1",
            "CI": "1", "TMPDIR": str(tmp), "XDG_CONFIG_HOME": str(home / ".config"),
            "XDG_DATA_HOME": str(home / ".local/share"), "XDG_CACHE_HOME": str(home / ".cache"),
            "XDG_STATE_HOME": str(home / ".local/state"), "NO_PROXY": "127.0.0.1,localhost",
            "no_proxy": "127.0.0.1,localhost"}


def is_model_request(method: str, path: str) -> bool:
    return method == "POST" and path.split("?")[0].endswith(MODEL_SUFFIXES)


def build_trace(c: Client, variant: str | None, family: str, exchanges: list[Any], san: Sanitiser,
                turns: list[dict[str, Any]], version: str) -> dict[str, Any]:
    requests = []
    for ex in exchanges:
        if not is_model_request(ex.method, ex.path):
            continue
        body = getattr(ex, "client_body", None) or ex.body_json()
        reply = getattr(ex, "reply", None)
        requests.append({
            "method": ex.method, "path": ex.path, "headers": san.headers(ex.req_headers),
            "body": san.value(body), "status": ex.status,
            "reply": san.value(reply) if reply is not None else None,
            "forced_output": san.text(ex.forced) if hasattr(ex, "forced") else None,
            "side": bool(reply and reply["side"]),
        })
    return {"client": c.name, "package": f"{c.package}@{c.version}", "version": version, "variant": variant,
            "family": family, "model": MODEL, "prompts": prompts(variant), "turns": turns,
            "n_requests": len(requests), "requests": requests}


def capture(name: str, variant: str | None, model: str, timeout: float, keep: bool,
            clients_dir: Path) -> tuple[dict[str, Any], bool]:
    c = CLIENTS[name]
    if not installed(name, clients_dir):
        raise SystemExit(f"{name} is not installed under {clients_dir} (run evals/clients/install.sh)")
    family = FAMILY.get(model, "qwen3_5")
    tmp = Path(tempfile.mkdtemp(prefix=f"fttrace-{name}-"))
    home, work = tmp / "home", tmp / "work"
    home.mkdir()
    work.mkdir()
    for fname, text in TASK_FILES.items():
        (work / fname).write_text(text)
    if variant:
        for i, fname in enumerate(BIG_FILES, 1):
            (work / fname).parent.mkdir(parents=True, exist_ok=True)
            (work / fname).write_text(big_file(i))
    subprocess.run(["git", "init", "-q"], cwd=work, check=False)
    env = base_env(c, tmp, home, clients_dir)
    turns: list[dict[str, Any]] = []
    ok = True
    with serve(tmp / "server.log", max_output_tokens=512, model=model) as base:
        proxy = ScriptedProxy(base, Script(str(work), family, variant), family).start()
        try:
            configure(c, home, work, proxy.url, env, variant)
            binary = str(c.bin_path(clients_dir))
            for turn, prompt in enumerate(prompts(variant)):
                mark = proxy.mark()
                t0 = time.monotonic()
                cmd = [binary, *turn_args(c, turn, prompt, work, home)]
                try:
                    proc = subprocess.run(cmd, cwd=work, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                                          timeout=timeout)
                    rc: int | None = proc.returncode
                    out, err = proc.stdout.decode("utf-8", "replace"), proc.stderr.decode("utf-8", "replace")
                except subprocess.TimeoutExpired as e:
                    rc, out, err = None, (e.stdout or b"").decode("utf-8", "replace"), (e.stderr or b"").decode(
                        "utf-8", "replace")
                time.sleep(0.5)  # let the proxy finish recording the last response
                n = sum(1 for e in proxy.since(mark) if is_model_request(e.method, e.path))
                turns.append({"prompt": turn, "exit_code": rc, "duration_s": round(time.monotonic() - t0, 1),
                              "model_requests": n, "stdout_tail": out, "stderr_tail": err})
                print(f"{name} turn {turn}: exit {rc}, {n} model requests, {turns[-1]['duration_s']}s",
                      file=sys.stderr, flush=True)
                ok = ok and rc == 0
            exchanges = proxy.since(0)
        finally:
            proxy.stop()
    roots = {str(work): "/tmp/ftwork", os.path.realpath(work): "/tmp/ftwork", str(home): "/tmp/fthome",
             os.path.realpath(home): "/tmp/fthome", str(tmp): "/tmp/fttmp", os.path.realpath(tmp): "/tmp/fttmp",
             str(REPO): "/repo", str(Path.home()): "/home/user"}
    san = Sanitiser(roots, secrets=[API_KEY])
    for t in turns:
        # sanitised whole, then cut: a cut first could split a path the sanitiser must see entire
        t["stdout_tail"], t["stderr_tail"] = san.text(t["stdout_tail"])[-400:], san.text(t["stderr_tail"])[-400:]
    trace = build_trace(c, variant, family, exchanges, san, turns, client_version(c, clients_dir))
    ok = ok and any(r["status"] == 200 for r in trace["requests"])
    if keep:
        print(f"kept {tmp}", file=sys.stderr)
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    return trace, ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--client", required=True, choices=sorted(CLIENTS))
    ap.add_argument("--variant", choices=["prune"], default=None)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per CLI turn")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    trace, ok = capture(args.client, args.variant, args.model, args.timeout, args.keep, clients_dir_default())
    out = args.out or trace_path(args.client, args.variant)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(trace, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {out}: {trace['n_requests']} model requests", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
