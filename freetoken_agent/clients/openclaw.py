"""OpenClaw: where it reads its config, and the `freetoken` provider that points it at this server.

Contract: `default_path()` is `$OPENCLAW_CONFIG_PATH` or `~/.openclaw/openclaw.json` (JSON5 is
read, plain JSON written). `fragment(target)` is the part of that file this server owns: provider
`freetoken` with `api: "openai-completions"` at `/v1` (`models.mode` "merge", kept if the user set
one), one model entry (merged on `id`), and it as the agents' primary model. `exports` is empty.
`FORMAT`, `HEADER`, `EXPORT_HEADER` and `NEXT_STEP` are what `freetoken_agent.configure` prints.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from freetoken_agent.clients.files import ConfigFormat, env_dir, home
from freetoken_agent.clients.target import PROVIDER_ID, ClientTarget

FORMAT: ConfigFormat = "json5"
HEADER = "# OpenClaw: merge this into {path} (JSON5; or run again with --write)"
EXPORT_HEADER: str | None = None
NEXT_STEP = f"start `openclaw`; the default model is {PROVIDER_ID}/{{model}}"


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
    }


def exports(t: ClientTarget) -> list[str]:
    return []
