"""Codex: where it reads its config, and the `freetoken` provider that points it at this server.

Contract: `default_path()` is `$CODEX_HOME/config.toml` or `~/.codex/config.toml`.
`fragment(target)` is the part of that TOML file this server owns: provider `freetoken` with
`wire_api = "responses"` at `/v1` as the default model and provider, with the context window; the
update check at start and analytics off. It names no environment variable, so Codex runs with
the file alone: without an API key it sends none (the server has none), with one the key is the
provider's `experimental_bearer_token` (the file is private, mode 0600, as the other clients'
files holding a key are). `exports` is empty. `FORMAT`, `HEADER`, `EXPORT_HEADER` and `NEXT_STEP`
are what `freetoken_agent.configure` prints around them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from freetoken_agent.clients.files import ConfigFormat, env_dir, home
from freetoken_agent.clients.target import PROVIDER_ID, PROVIDER_NAME, ClientTarget

FORMAT: ConfigFormat = "toml"
HEADER = "# Codex: merge this into {path} (or run again with --write)"
EXPORTS_AFTER_WRITE = False  # print the export lines after --write too
EXPORT_HEADER: str | None = None
NEXT_STEP = ("start `codex` in your project (model {model}, provider freetoken). One turn: `codex exec \"TASK\"`; "
             "the follow-up: `codex exec resume --last \"NEXT\"`")


def default_path() -> Path:
    return (env_dir("CODEX_HOME") or home() / ".codex") / "config.toml"


def fragment(t: ClientTarget) -> dict[str, Any]:
    provider: dict[str, Any] = {"name": PROVIDER_NAME, "base_url": t.openai_base_url, "wire_api": "responses"}
    if t.api_key is not None:
        provider["experimental_bearer_token"] = t.api_key
    return {
        "model": t.model,
        "model_provider": PROVIDER_ID,
        "model_context_window": t.context_window,
        "check_for_update_on_startup": False,
        "analytics": {"enabled": False},
        "model_providers": {PROVIDER_ID: provider},
    }


def exports(t: ClientTarget) -> list[str]:
    return []
