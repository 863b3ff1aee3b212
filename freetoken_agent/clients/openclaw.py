"""OpenClaw: where it reads its config, and the `freetoken` provider that points it at this server.

Contract: `default_path()` is `$OPENCLAW_CONFIG_PATH` or `~/.openclaw/openclaw.json` (JSON5 is
read, plain JSON written). `fragment(target)` is the part of that file this server owns: provider
`freetoken` with `api: "openai-completions"` at `/v1` (`models.mode` "merge", kept if the user set
one), one model entry (merged on `id`), and it as the agents' primary model; the update check
(which also carries any usage statistics) and telemetry off. `exports` is empty. `NEXT_STEP` says
that OpenClaw needs Node >= 24.16 and how to continue a conversation (`openclaw agent --local
--session-id ID -m ...`, run again with the same id; `agent exec` runs one turn and cannot
continue). `FORMAT`, `HEADER` and `EXPORT_HEADER` are what `freetoken_agent.configure` prints.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from freetoken_agent.clients.files import ConfigFormat, env_dir, home
from freetoken_agent.clients.target import PROVIDER_ID, ClientTarget

FORMAT: ConfigFormat = "json5"
HEADER = "# OpenClaw: merge this into {path} (JSON5; or run again with --write)"
EXPORTS_AFTER_WRITE = False  # print the export lines after --write too
EXPORT_HEADER: str | None = None
NODE_MIN = "24.16"
NEXT_STEP = (f"OpenClaw needs Node >= {NODE_MIN} (`node --version`). The default model is now "
             f"{PROVIDER_ID}/{{model}}. A conversation: `openclaw agent --local --session-id my-task -m \"TASK\"`, "
             "then the follow-up with the same id: `openclaw agent --local --session-id my-task -m \"NEXT\"` "
             "(`openclaw agent exec` runs one turn and cannot continue it)")


def default_path() -> Path:
    return env_dir("OPENCLAW_CONFIG_PATH") or home() / ".openclaw" / "openclaw.json"


def fragment(t: ClientTarget) -> dict[str, Any]:
    return {
        "models": {"mode": "merge", "providers": {PROVIDER_ID: {
            "baseUrl": t.openai_base_url,
            "apiKey": t.key,
            "api": "openai-completions",
            "models": [{"id": t.model, "name": t.model, "reasoning": True, "input": ["text"],
                        "contextWindow": t.context_window, "maxTokens": t.max_output_tokens}],
        }}},
        "agents": {"defaults": {"model": {"primary": f"{PROVIDER_ID}/{t.model}"}}},
        "update": {"checkOnStart": False},
        "telemetry": {"enabled": False},
    }


def exports(t: ClientTarget) -> list[str]:
    return []
