"""`freetoken-agent eval openclaw`: the paper's W4 (an email / calendar assistant in OpenClaw over
local CalDAV and mail services, 13 user turns, each turn's effect checked). Not built yet: the
design is in docs/evals.md; `run_openclaw` says so as a one-line error of the CLI."""

from __future__ import annotations

import argparse
from typing import Any


def run_openclaw(args: argparse.Namespace, base: str) -> dict[str, Any]:
    raise ValueError("eval openclaw is not built yet (design: docs/evals.md); "
                     "use `eval replay evals/traces/data/openclaw.json` for OpenClaw's request pattern")
