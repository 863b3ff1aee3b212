"""OpenCode: where it reads its config, and the `freetoken` provider that points it at this server.

Contract: `default_path()` is `$XDG_CONFIG_HOME/opencode/opencode.json` (an absolute
`$XDG_CONFIG_HOME` only) or `~/.config/opencode/opencode.json`; an existing `opencode.jsonc` there
is used instead when there is no `opencode.json`. `fragment(target)` is the part of that file this
server owns: provider `freetoken` through `@ai-sdk/openai-compatible` (Chat Completions at `/v1`)
and it as the default and small model; auto-update and session sharing off. OpenCode's fetch of
its model list (models.dev) has no setting in the file, only the environment variable
`OPENCODE_DISABLE_MODELS_FETCH`: `exports(target)` is that `export` line (optional; without it
OpenCode logs the failed fetch and carries on). `FORMAT`, `HEADER`, `EXPORT_HEADER` and
`NEXT_STEP` are what `freetoken_agent.configure` prints around them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from freetoken_agent.clients.files import ConfigFormat, env_dir, home
from freetoken_agent.clients.target import (
    CHUNK_TIMEOUT_MS,
    PROVIDER_ID,
    PROVIDER_NAME,
    REQUEST_TIMEOUT_MS,
    ClientTarget,
)

FORMAT: ConfigFormat = "json"
HEADER = "# OpenCode: merge this into {path} (or run again with --write)"
EXPORTS_AFTER_WRITE = True  # print the export lines after --write too
EXPORT_HEADER: str | None = ("# OpenCode also fetches its model list from the network at start; only the environment "
                              "turns that off:")
NEXT_STEP = (f"start `opencode` in your project (model {PROVIDER_ID}/{{model}}). One turn: `opencode run \"TASK\"`; "
             "the follow-up: `opencode run --continue \"NEXT\"`")


def default_path() -> Path:
    xdg = env_dir("XDG_CONFIG_HOME")
    base = (xdg if xdg is not None and xdg.is_absolute() else home() / ".config") / "opencode"
    if not (base / "opencode.json").exists() and (base / "opencode.jsonc").is_file():
        return base / "opencode.jsonc"
    return base / "opencode.json"


def fragment(t: ClientTarget) -> dict[str, Any]:
    return {
        "provider": {PROVIDER_ID: {
            "npm": "@ai-sdk/openai-compatible",
            "name": PROVIDER_NAME,
            "options": {"baseURL": t.openai_base_url, "apiKey": t.key,
                        "timeout": REQUEST_TIMEOUT_MS, "chunkTimeout": CHUNK_TIMEOUT_MS},
            "models": {t.model: {
                "name": t.model,
                "limit": {"context": t.context_window, "output": t.max_output_tokens},
                "reasoning": True,
                "tool_call": True,
                "interleaved": {"field": "reasoning_content"},
            }},
        }},
        "model": f"{PROVIDER_ID}/{t.model}",
        "small_model": f"{PROVIDER_ID}/{t.model}",
        "autoupdate": False,
        "share": "disabled",
    }


def exports(t: ClientTarget) -> list[str]:
    return ["export OPENCODE_DISABLE_MODELS_FETCH=1"]
