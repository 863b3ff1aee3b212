"""Shared constants of the real-client runner: paths, the served model name, the key, the task.

Contract: plain values only, no side effects. `REPO` is the repository root; `MODEL` is the name the
server serves and every client asks for; `API_KEY` is the (fake) key the clients send and that
recordings redact; `TASK` is the first prompt each client runs and `FOLLOW_UP` the prompt of the turn
that continues it; `README` is the work dir's README.md.
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_CLIENTS_DIR = REPO / ".clients"
MODEL = "freetoken-demo"
API_KEY = "sk-freetoken-local"
TASK = "Read README.md and say hello in one short sentence."
FOLLOW_UP = "Now say goodbye in one short sentence."
README = "# hello-project\n\nA tiny project used to smoke-test coding agents.\n"
