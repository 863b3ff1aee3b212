"""Claude Code: where it reads its settings, and the `env` block that points it at this server.

Contract: `default_path()` is `$CLAUDE_CONFIG_DIR/settings.json` or `~/.claude/settings.json`;
`fragment(target)` is the part of that JSON file this server owns (an `env` block: Anthropic
Messages API at the server root, no `/v1`; update checks, telemetry, error reports and other
non-essential traffic off; the output limit; the auto-compact window set to the server's context
window); `exports(target)` is the same block as shell `export` lines. Claude Code takes no
auto-compact window below `MIN_CONTEXT_WINDOW` tokens (it reads a smaller one as that minimum and
would then send prompts the server refuses), so both raise `ValueError` saying so for a smaller
context window. `FORMAT`, `HEADER`, `EXPORT_HEADER` and `NEXT_STEP` are what
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
EXPORTS_AFTER_WRITE = False  # print the export lines after --write too
EXPORT_HEADER: str | None = "# Or, instead of the file, for one shell session:"
NEXT_STEP = ("start `claude` in your project; it reads the env block at start. One turn: `claude -p \"TASK\"`; "
             "the follow-up: `claude -p -c \"NEXT\"`")
# Claude Code 2.1.332 treats CLAUDE_CODE_AUTO_COMPACT_WINDOW below 100k as 100k (and assumes a 1M window
# for a model it does not know), so it compacts its history only against at least this many tokens.
MIN_CONTEXT_WINDOW = 100_000


def default_path() -> Path:
    return (env_dir("CLAUDE_CONFIG_DIR") or home() / ".claude") / "settings.json"


def claude_env(t: ClientTarget) -> dict[str, str]:
    if t.context_window < MIN_CONTEXT_WINDOW:
        raise ValueError(
            f"Claude Code needs a context window of at least {MIN_CONTEXT_WINDOW} tokens (it compacts its history "
            f"only against that much, so past {t.context_window} the server would refuse its prompts); serve "
            f"with --context-window 131072 --kv-tokens 131072 on a model that holds that many (the demo does) "
            f"and configure again, or pass --context-window")
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
        "DISABLE_ERROR_REPORTING": "1",
        "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
        "API_TIMEOUT_MS": str(REQUEST_TIMEOUT_MS),
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(t.max_output_tokens),
        "CLAUDE_CODE_AUTO_COMPACT_WINDOW": str(t.context_window),
    }


def fragment(t: ClientTarget) -> dict[str, Any]:
    return {"env": claude_env(t)}


def exports(t: ClientTarget) -> list[str]:
    return [f"export {k}={shlex.quote(v)}" for k, v in claude_env(t).items()]
