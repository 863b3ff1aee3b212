"""A client's throw-away HOME, configured exactly as a user's would be, and the environment it runs in.

Contract: `configure_home(name, home, base_url, max_output_tokens, context_window=None)` runs the real
`freetoken-agent configure NAME --write --base-url BASE_URL ...` with `HOME=home` (so the model
name and, unless given, the context window come from the server at `base_url`, as for a user), and
returns the files it wrote under `home` ({relative path: text}); a failure raises `RuntimeError`
with the command's stderr. `client_env(client, home, tmp, clients_dir)` is the whole environment the
CLI then gets: `PATH` (with Node 24 first for OpenClaw), `HOME`, `USER`, `LANG`, `TERM=dumb` and
`TMPDIR`; no variable of the client's own, so the run depends on the written files alone.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from evals.clients.agents import NODE24, Client
from evals.clients.constants import REPO


def configure_home(name: str, home: Path, base_url: str, max_output_tokens: int,
                   context_window: int | None = None) -> dict[str, str]:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "LANG": "C.UTF-8",
           "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "freetoken_agent", "configure", name, "--write", "--base-url", base_url,
           "--max-output-tokens", str(max_output_tokens)]
    if context_window is not None:
        cmd += ["--context-window", str(context_window)]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"freetoken-agent configure {name} failed: {proc.stderr.strip()}")
    return {str(f.relative_to(home)): f.read_text() for f in sorted(home.rglob("*")) if f.is_file()}


def client_env(c: Client, home: Path, tmp: Path, clients_dir: Path) -> dict[str, str]:
    path = os.environ.get("PATH", "/usr/bin:/bin")
    if c.needs_node24:
        path = str(clients_dir / NODE24) + os.pathsep + path
    return {"PATH": path, "HOME": str(home), "USER": os.environ.get("USER", "user"), "LANG": "C.UTF-8",
            "TERM": "dumb", "TMPDIR": str(tmp)}
