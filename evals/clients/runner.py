"""Running one real client for one turn through the recording proxy, and judging the turn.

Contract: `run_client(client, base, proxy, server_log, clients_dir, timeout, keep=False,
max_output_tokens=512)` configures a throw-away HOME with `freetoken-agent configure CLIENT --write`
against `base` (the proxy's URL; `evals.clients.home`), then runs the CLI there, in a work dir,
with no environment variable of its own: one turn of `TASK`, then the follow-up turn of
`FOLLOW_UP` that continues the same conversation. It returns a JSON-able result dict whose `turns`
judge each run: `ok` when the client exited 0 in time, every model request was answered 200 with a
well-formed SSE stream, it sent at least one request to its own API, neither its stderr nor stdout
shows a protocol error and the server logged no error meanwhile; the follow-up must also send the
first turn's task back (the conversation was continued, not restarted). The result's `ok` is both
turns' and `problems` lists what failed. The raw exchanges are under `_exchanges` (not JSON-able;
the caller pops it). With `keep` the temp dir and the raw traffic are kept, else removed. A client
that is not installed gives `ok=False` and a `reason`, without running anything.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from evals.clients.agents import Client, client_version, installed
from evals.clients.constants import FOLLOW_UP, README, TASK
from evals.clients.home import client_env, configure_home
from evals.clients.proxy import Exchange, RecordingProxy
from evals.clients.server import ACCESS, server_log_window
from evals.clients.sse import check_sse

# Client-side lines that mean the protocol broke (case-insensitive). Model noise goes to stdout, so
# stderr is checked with the full list and stdout only with the unambiguous client error banners.
STDERR_ERRORS = re.compile(
    r"invalid|unexpected|parse error|failed to parse|could not parse|stream error|stream disconnected"
    r"|error decoding|API Error|ECONNREFUSED|ECONNRESET|socket hang up|Traceback|panicked",
    re.IGNORECASE)
STDOUT_ERRORS = re.compile(
    r"API Error|stream error|stream disconnected|failed to parse|error decoding response|ECONNREFUSED"
    r"|AI_APICallError|AI_TypeValidationError|AI_JSONParseError|panicked at",
    re.IGNORECASE)
# Benign stderr lines that match STDERR_ERRORS but are not protocol errors (kept short and explicit).
STDERR_BENIGN = [
    re.compile(r"doesn't recognize the model", re.IGNORECASE),
]


def _benign(line: str) -> bool:
    return any(p.search(line) for p in STDERR_BENIGN)


def error_lines(text: str, pattern: re.Pattern[str]) -> list[str]:
    return [ln.strip()[:300] for ln in text.splitlines() if pattern.search(ln) and not _benign(ln)]


def summarize_exchange(ex: Exchange) -> dict[str, Any]:
    body = ex.body_json()
    d: dict[str, Any] = {"method": ex.method, "path": ex.path, "status": ex.status,
                         "content_type": ex.content_type.split(";")[0], "duration_s": round(ex.duration, 2)}
    if isinstance(body, dict):
        d["model"] = body.get("model")
        d["stream"] = body.get("stream")
        for k in ("messages", "input", "tools"):
            if isinstance(body.get(k), list):
                d[f"n_{k}"] = len(body[k])
    if ex.error:
        d["proxy_error"] = ex.error
    if ex.status >= 400:
        d["response"] = ex.resp_body[:1000].decode("utf-8", "replace")
    return d


def _judge(c: Client, exchanges: list[Exchange], server_text: str, rc: int | None, timed_out: bool,
           timeout: float, stdout: str, stderr: str) -> list[str]:
    """What went wrong in one turn (empty: it passed)."""
    model_reqs = [e for e in exchanges if e.method == "POST" and e.path.split("?")[0].endswith(MODEL_SUFFIXES)]
    problems: list[str] = []
    for e in exchanges:
        if e.error:
            problems.append(f"{e.method} {e.path}: proxy: {e.error}")
        if e in model_reqs and e.status != 200:
            problems.append(f"{e.method} {e.path} answered {e.status}: {e.resp_body[:300]!r}")
        if e.status == 200 and "text/event-stream" in e.content_type:
            problems += [f"{e.method} {e.path}: {p}" for p in check_sse(e.path, e.resp_body)]
    if re.search(r"Traceback|Exception in callback|ERROR:", server_text):
        problems.append("server logged an error: " + " | ".join(
            ln.strip() for ln in server_text.splitlines() if re.search(r"Error|Exception|Traceback", ln))[:600])
    if timed_out:
        problems.append(f"client timed out after {timeout:.0f}s")
    elif rc != 0:
        problems.append(f"client exited {rc}")
    if not [e for e in model_reqs if e.path.split("?")[0].endswith(c.api.rsplit("/", 1)[-1])]:
        problems.append(f"client sent no {c.api} request")
    problems += [f"stderr: {ln}" for ln in error_lines(stderr, STDERR_ERRORS)]
    problems += [f"stdout: {ln}" for ln in error_lines(stdout, STDOUT_ERRORS)]
    return problems


MODEL_SUFFIXES = ("/messages", "/chat/completions", "/responses", "/count_tokens")


def _scrub(text: str, tmp: Path, clients_dir: Path) -> str:
    return text.replace(str(tmp), "$TMP").replace(str(clients_dir), "$CLIENTS")


def _carries(exchanges: list[Exchange], text: str) -> bool:
    """Some model request of the turn holds `text` (the first turn's task) in its body."""
    return any(text in e.req_body.decode("utf-8", "replace") for e in exchanges
               if e.method == "POST" and e.path.split("?")[0].endswith(MODEL_SUFFIXES))


def run_client(c: Client, base: str, proxy: RecordingProxy, server_log: Path | None, clients_dir: Path,
               timeout: float, keep: bool = False, max_output_tokens: int = 512) -> dict[str, Any]:
    result: dict[str, Any] = {"client": c.name, "package": f"{c.package}@{c.version}",
                              "version": client_version(c, clients_dir), "api": c.api}
    if not installed(c.name, clients_dir):
        result.update(ok=False, reason=f"not installed under {clients_dir} (run evals/clients/install.sh)")
        return result
    tmp = Path(tempfile.mkdtemp(prefix=f"ftclient-{c.name}-"))
    home, work = tmp / "home", tmp / "work"
    home.mkdir()
    work.mkdir()
    (work / "README.md").write_text(README)
    configure = (f"freetoken-agent configure {c.name} --write --base-url $BASE "
                 f"--max-output-tokens {max_output_tokens}")
    try:
        written = configure_home(c.name, home, base, max_output_tokens)
    except RuntimeError as failed:
        result.update(ok=False, configure=configure, problems=[str(failed)])
        shutil.rmtree(tmp, ignore_errors=True)
        return result
    env = client_env(c, home, tmp, clients_dir)
    result["configure"] = configure
    result["env"] = sorted(k for k in env)
    result["config_files"] = {name: text.replace(str(tmp), "$TMP").replace(base, "$BASE")
                              for name, text in written.items()}
    turns: list[dict[str, Any]] = []
    all_exchanges: list[Exchange] = []
    for label, args in (("turn", c.turn(TASK)), ("follow-up", c.follow_up(FOLLOW_UP))):
        cmd = [str(c.bin_path(clients_dir)), *args]
        shown = " ".join(json.dumps(a) if " " in a else a for a in [c.binary.rsplit("/", 1)[-1], *args])
        mark = proxy.mark()
        log_start = server_log.stat().st_size if server_log and server_log.exists() else 0
        t0 = time.monotonic()
        timed_out = False
        try:
            proc = subprocess.run(cmd, cwd=work, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                                  timeout=timeout)
            rc: int | None = proc.returncode
            out, err = proc.stdout, proc.stderr
        except subprocess.TimeoutExpired as late:
            timed_out, rc = True, None
            out, err = late.stdout or b"", late.stderr or b""
        duration = time.monotonic() - t0
        time.sleep(0.5)  # let the proxy finish recording the last response
        stdout, stderr = out.decode("utf-8", "replace"), err.decode("utf-8", "replace")
        exchanges = proxy.since(mark)
        server_text = server_log_window(server_log, log_start)[0] if server_log else ""
        problems = _judge(c, exchanges, server_text, rc, timed_out, timeout, stdout, stderr)
        if label == "follow-up" and not _carries(exchanges, TASK):
            problems.append("the follow-up's requests do not carry the first turn (no continued conversation)")
        endpoints: dict[str, int] = {}
        for e in exchanges:
            key = f"{e.method} {e.path.split('?')[0]} {e.status}"
            endpoints[key] = endpoints.get(key, 0) + 1
        turns.append({
            "turn": label, "command": shown, "ok": not problems, "exit_code": rc, "timed_out": timed_out,
            "duration_s": round(duration, 1), "n_requests": len(exchanges),
            "n_model_requests": sum(1 for e in exchanges if e.method == "POST"
                                    and e.path.split("?")[0].endswith(MODEL_SUFFIXES)),
            "endpoints": endpoints, "server_access_log": [f"{m} {p} {s}" for m, p, s in ACCESS.findall(server_text)],
            "requests": [summarize_exchange(e) for e in exchanges], "problems": problems,
            "stderr_head": _scrub(stderr[:500], tmp, clients_dir), "stdout_head": _scrub(stdout[:500], tmp, clients_dir),
        })
        all_exchanges += exchanges
        if keep:  # the raw traffic, for debugging
            (tmp / f"{label}-stdout.txt").write_bytes(out)
            (tmp / f"{label}-stderr.txt").write_bytes(err)
    result.update(
        ok=all(t["ok"] for t in turns), turns=turns, problems=[f"{t['turn']}: {p}" for t in turns for p in t["problems"]],
        exit_code=turns[-1]["exit_code"], duration_s=round(sum(t["duration_s"] for t in turns), 1),
        n_requests=sum(t["n_requests"] for t in turns), n_model_requests=sum(t["n_model_requests"] for t in turns),
        endpoints={k: sum(t["endpoints"].get(k, 0) for t in turns) for t in turns for k in t["endpoints"]},
        workdir=str(tmp),
    )
    result["_exchanges"] = all_exchanges
    if keep:
        dump = tmp / "exchanges"
        dump.mkdir()
        for i, e in enumerate(all_exchanges):
            (dump / f"{i:03d}-request.json").write_bytes(e.req_body)
            (dump / f"{i:03d}-response.txt").write_bytes(
                f"{e.status} {e.method} {e.path}\n{json.dumps(e.resp_headers)}\n\n".encode() + e.resp_body)
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    return result
