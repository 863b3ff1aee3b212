"""mini-swe-agent (PyPI `mini-swe-agent`) as a multi-turn client of `freetoken-agent eval swe`.

Contract: `agent_for(work, base, model, step_limit)` is mini-swe-agent's own `DefaultAgent` with
its default config (system and instance templates, observation template), `LitellmModel` talking
OpenAI chat completions with its `bash` tool to `base + "/v1"` as `openai/<model>`, and
`LocalEnvironment(cwd=work)`. `run(task=...)` is the first user turn; `follow_up(text)` continues
the same conversation: it answers the submit command's pending tool call with the command's
output, appends the user message, and steps until the agent submits again (or its step limit).
Importing it sets litellm's local price list (no download at run time). It needs mini-swe-agent installed (a test extra, not a product dependency).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")  # no banner on stdout at import
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm: no download of its price list

import yaml
from minisweagent.agents.default import DefaultAgent
from minisweagent.config import builtin_config_dir
from minisweagent.environments.local import LocalEnvironment
from minisweagent.exceptions import FormatError, InterruptAgentFlow
from minisweagent.models.litellm_model import LitellmModel

SUBMIT = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


class MultiTurnAgent(DefaultAgent):
    """`run` for the first user turn; `follow_up` continues the same conversation."""

    def follow_up(self, text: str) -> dict[str, Any]:
        if self.messages and self.messages[-1].get("role") == "exit":
            self.messages.pop()
        last = self.messages[-1]
        if last.get("role") == "assistant" and (last.get("extra") or {}).get("actions"):
            self.add_messages(*self.model.format_observation_messages(
                last, [{"output": SUBMIT + "\n", "returncode": 0, "exception_info": ""}], self.get_template_vars()))
        self.add_messages(self.model.format_message(role="user", content=text))
        self.n_calls = 0
        while self.messages[-1].get("role") != "exit":
            try:
                self.step()
            except (FormatError, InterruptAgentFlow) as e:
                self.add_messages(*e.messages)
        return dict(self.messages[-1].get("extra", {}))


def agent_for(work: Path, base: str, model: str, step_limit: int) -> MultiTurnAgent:
    cfg = yaml.safe_load((builtin_config_dir / "default.yaml").read_text())
    mcfg = dict(cfg["model"])
    kwargs = {**mcfg.pop("model_kwargs", {}), "api_base": base + "/v1", "api_key": "sk-freetoken-local",
              "max_tokens": 1024}
    lm = LitellmModel(model_name=f"openai/{model}", model_kwargs=kwargs, cost_tracking="ignore_errors", **mcfg)
    env = LocalEnvironment(cwd=str(work), timeout=120, **cfg.get("environment", {}))
    return MultiTurnAgent(lm, env, **{**cfg["agent"], "step_limit": step_limit})
