"""Starting `freetoken-agent serve` for the real-client runner, and reading its log.

Contract: `serve(log_path, ...)` (the runner's settings) and `serve_with(args, log_path)` (any
serve arguments) are context managers that starts the server on a free port (or
`port`) with stdout/stderr in `log_path`, waits for `GET /health` to answer 200 (raising
`RuntimeError` if it exits or does not start in `startup_timeout` s), yields its base URL, and stops it
on exit. `server_log_window(log_path, start)` returns the log written since a byte offset and the new
end offset; `ACCESS` matches the access-log lines in it.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from evals.clients.constants import MODEL, REPO

# the demo holds 131072 positions; a KV pool that size serves the context window Claude Code needs
KV_TOKENS = 131072


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def serve(log_path: Path, max_output_tokens: int = 64, port: int | None = None, model: str = "demo",
          startup_timeout: float = 180) -> Iterator[str]:
    """Start `freetoken-agent serve` with an access log; yield its base URL.

    `model` is a model directory or `demo` (whose lm_head makes it end its turns, see
    `freetoken_agent.demo.STOP_GAIN`); the KV pool holds `KV_TOKENS`, the context window served.
    """
    with serve_with(["--model", model, "--served-model-name", MODEL, "--log-level", "info",
                     "--max-output-tokens", str(max_output_tokens), "--kv-tokens", str(KV_TOKENS)],
                    log_path, port, startup_timeout) as url:
        yield url


@contextlib.contextmanager
def serve_with(serve_args: list[str], log_path: Path, port: int | None = None,
               startup_timeout: float = 180) -> Iterator[str]:
    """`freetoken-agent serve --port P *serve_args` with its output in `log_path`, healthy; yields its URL."""
    port = port or free_port()
    env = dict(os.environ)
    env.setdefault("FREETOKEN_CACHE_DIR", str(Path(tempfile.gettempdir()) / "ftcache"))
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "freetoken_agent", "serve", "--port", str(port), *serve_args]
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
