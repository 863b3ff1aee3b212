"""Codex: where it reads its config, and the `freetoken` provider that points it at this server.

Contract: `default_path()` is `$CODEX_HOME/config.toml` or `~/.codex/config.toml`.
`fragment(target)` is the part of that TOML file this server owns: provider `freetoken` with
`wire_api = "responses"` at `/v1`, reading its key from `$FREETOKEN_API_KEY`, as the default model
and provider, with the context window. `exports(target)` is the `export` of that key, which Codex
reads from the environment. `FORMAT`, `HEADER`, `EXPORT_HEADER` and `NEXT_STEP` are what
`freetoken_agent.configure` prints around them.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from freetoken_agent.clients.files import ConfigFormat, env_dir, home
from freetoken_agent.clients.target import CODEX_API_KEY_ENV, PROVIDER_ID, PROVIDER_NAME, ClientTarget

FORMAT: ConfigFormat = "toml"
HEADER = "# Codex: merge this into {path} (or run again with --write)"
EXPORT_HEADER: str | None = f"# Codex reads the API key from ${CODEX_API_KEY_ENV}; set it where codex runs:"
NEXT_STEP = "set the key in the shell that runs codex:"


def default_path() -> Path:
    return (env_dir("CODEX_HOME") or home() / ".codex") / "config.toml"


def fragment(t: ClientTarget) -> dict[str, Any]:
    return {
        "model": t.model,
        "model_provider": PROVIDER_ID,
        "model_context_window": t.context_window,
        "model_providers": {PROVIDER_ID: {
            "name": PROVIDER_NAME,
            "base_url": t.openai_base_url,
            "env_key": CODEX_API_KEY_ENV,
            "wire_api": "responses",
        }},
    }


def exports(t: ClientTarget) -> list[str]:
    return [f"export {CODEX_API_KEY_ENV}={shlex.quote(t.key)}"]
