"""Claude Code: where it reads its settings, and the `env` block that points it at this server.

Contract: `default_path()` is `$CLAUDE_CONFIG_DIR/settings.json` or `~/.claude/settings.json`;
`fragment(target)` is the part of that JSON file this server owns (an `env` block: Anthropic
Messages API at the server root, no `/v1`, non-essential traffic off); `exports(target)` is the same
block as shell `export` lines. `FORMAT`, `HEADER`, `EXPORT_HEADER` and `NEXT_STEP` are what
`freetoken_agent.configure` prints around them. No I/O besides reading the environment.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from freetoken_agent.clients.files import ConfigFormat, env_dir, home
from freetoken_agent.clients.target import REQUEST_TIMEOUT_MS, ClientTarget

FORMAT: ConfigFormat = "json"
HEADER = "# Claude Code: merge this into {path} (or run again with --write)"
EXPORT_HEADER: str | None = "# Or, instead of the file, for one shell session:"
NEXT_STEP = "start `claude` as usual; it reads the env block at start"


def default_path() -> Path:
    return (env_dir("CLAUDE_CONFIG_DIR") or home() / ".claude") / "settings.json"


def claude_env(t: ClientTarget) -> dict[str, str]:
    return {
        "ANTHROPIC_BASE_URL": t.base_url,
        "ANTHROPIC_AUTH_TOKEN": t.key,
        "ANTHROPIC_MODEL": t.model,
        "ANTHROPIC_SMALL_FAST_MODEL": t.model,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": t.model,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": t.model,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": t.model,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
        "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
        "API_TIMEOUT_MS": str(REQUEST_TIMEOUT_MS),
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(t.max_output_tokens),
        "CLAUDE_CODE_AUTO_COMPACT_WINDOW": str(t.context_window),
    }


def fragment(t: ClientTarget) -> dict[str, Any]:
    return {"env": claude_env(t)}


def exports(t: ClientTarget) -> list[str]:
    return [f"export {k}={shlex.quote(v)}" for k, v in claude_env(t).items()]
