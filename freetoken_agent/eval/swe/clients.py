"""Driving an agent client non-interactively through a task's user turns, in a work dir.

Contract: `drive(client, work, base, model, prompts, clients_dir, timeout)` runs the client against
`base` (the scripted proxy or the server) in `work`, one user turn per prompt (the first starts the
conversation, later ones continue it the client's way) and returns one dict per turn: `exit`
(the client's exit status or end reason), `duration_s`, and `error` when it failed to run;
`after(i)`, when given, is called once user turn `i` has ended (the eval checks its effect);
`adjust(home)`, when given, edits an npm client's configuration after `configure` wrote it.
- mini-swe-agent (PyPI, not a dependency of the product: evals/swe/mini.py): its `DefaultAgent` with `LitellmModel` (OpenAI chat completions with its
  `bash` tool, `api_base` = base) and `LocalEnvironment(cwd=work)`, its own default config; a turn
  ends when the agent submits (`echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`) or hits its step limit;
  a follow-up turn answers the submit command's tool call and appends the next user message.
- opencode, claude-code, codex, openclaw (npm, installed under `clients_dir` by
  evals/clients/install.sh): a throw-away HOME configured by `freetoken-agent configure CLIENT
  --write` against `base`, then the CLI's non-interactive turn / continue-turn arguments
  (evals/traces/capture.py, as the trace capture runs them).
"""

from __future__ import annotations

import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

AfterTurn = Callable[[int], None]
Adjust = Callable[[Path], None]


def _drive_mini(work: Path, base: str, model: str, prompts: list[str], after: AfterTurn | None,
                step_limit: int = 25) -> list[dict[str, Any]]:
    try:
        from evals.swe.mini import agent_for
    except ImportError as e:
        raise ValueError(f"the mini-swe-agent client is not installed ({e}): pip install mini-swe-agent==2.4.6") from e
    agent = agent_for(work, base, model, step_limit)
    out = []
    for i, prompt in enumerate(prompts):
        t0 = time.monotonic()
        try:
            res = agent.run(task=prompt) if i == 0 else agent.follow_up(prompt)
            out.append({"exit": res.get("exit_status"), "duration_s": round(time.monotonic() - t0, 1)})
            if after is not None:
                after(i)
        except Exception as e:  # the client's own failure ends the task, reported
            out.append({"exit": "error", "duration_s": round(time.monotonic() - t0, 1), "error": repr(e)[:500]})
            break
    return out


def _drive_npm(name: str, work: Path, base: str, prompts: list[str], clients_dir: Path,
               timeout: float, after: AfterTurn | None, adjust: Adjust | None) -> list[dict[str, Any]]:
    from evals.clients.agents import CLIENTS, installed
    from evals.traces.capture import base_env, configure, turn_args

    c = CLIENTS[name]
    if not installed(name, clients_dir):
        return [{"exit": "not installed", "duration_s": 0.0,
                 "error": f"{name} is not installed under {clients_dir} (run evals/clients/install.sh)"}]
    tmp = Path(tempfile.mkdtemp(prefix=f"fteval-{name}-"))
    home = tmp / "home"
    home.mkdir()
    env = base_env(c, tmp, home, clients_dir)
    configure(c, home, work, base, env, None)
    if adjust is not None:
        adjust(home)
    out: list[dict[str, Any]] = []
    for i, prompt in enumerate(prompts):
        t0 = time.monotonic()
        cmd = [str(c.bin_path(clients_dir)), *turn_args(c, i, prompt, work, home)]
        try:
            proc = subprocess.run(cmd, cwd=work, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                                  timeout=timeout)
            out.append({"exit": proc.returncode, "duration_s": round(time.monotonic() - t0, 1),
                        "stderr_tail": proc.stderr.decode("utf-8", "replace")[-1000:]})
            if after is not None:
                after(i)
        except subprocess.TimeoutExpired:
            out.append({"exit": "timeout", "duration_s": round(time.monotonic() - t0, 1)})
            break
    return out


def drive(client: str, work: Path, base: str, model: str, prompts: list[str], clients_dir: Path,
          timeout: float = 900, after: AfterTurn | None = None, adjust: Adjust | None = None) -> list[dict[str, Any]]:
    if client == "mini-swe-agent":
        return _drive_mini(work, base, model, prompts, after)
    return _drive_npm(client, work, base, prompts, clients_dir, timeout, after, adjust)
