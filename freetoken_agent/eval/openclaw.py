"""`freetoken-agent eval openclaw`: the paper's W4, an email / calendar assistant over real local
services, 13 user turns, each turn's effect checked.

Contract: `run_openclaw(args, base)` starts the scenario's services on loopback
(evals/openclaw/services.py: Radicale for CalDAV, an aiosmtpd SMTP sink, a seeded Maildir inbox
served over IMAP by Dovecot's `imap` when evals/openclaw/install_imap.sh unpacked it under the
clients dir, else read as files; `inbox` in the run says which),
writes the assistant's workspace (evals/openclaw/workspace.py: `mail.py`, `cal.py`), and drives the
client (`--client`, OpenClaw by default; mini-swe-agent runs the same scenario where OpenClaw is not
installed) through the 13 prompts of evals/openclaw/scenario.py (`--turns N`: the first N) behind a recording proxy (with
`--scripted`, the scenario's steps forced through the client's own shell tool, as `eval swe`
does). After each user turn the calendar (read back over CalDAV) and the mail the SMTP sink
received must equal the turn's expected state; `checks` lists each turn's verdict, and `success`
is every turn's; a line per turn on stderr shows the progress, and `progress` (progress.py's
callback, optional) hears `(turns done, turns, the next turn's prompt)` before the first turn and
after each. Per model request the report has swe's fields (`/v1/sessions` on our server).
OpenClaw runs with the paper's setup (`openclaw_settings`): its model idle watchdog off (a day) and
a ~24k-token system context (its own prompt and tools plus the injected standing context).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

from freetoken_agent.eval.report import summarise
from freetoken_agent.eval.wire import ServerSessions, served_model

IDLE_WATCHDOG_S = 86400


def run_openclaw(args: argparse.Namespace, base: str, progress: Any = None) -> dict[str, Any]:
    try:
        from evals.openclaw.services import Services
    except ImportError as e:
        raise ValueError(f"the scenario's services need radicale and aiosmtpd ({e}): "
                         "pip install radicale==3.9.0 aiosmtpd==1.4.6") from e
    from evals.clients.agents import clients_dir_default
    from evals.openclaw.imap import dovecot_imap
    from evals.openclaw.scenario import TURNS as ALL_TURNS
    from evals.openclaw.workspace import write_workspace
    from freetoken_agent.eval.swe.clients import drive
    from freetoken_agent.eval.swe.run import NamedProxy, NamedScriptedProxy, model_turns, renderer_for
    from freetoken_agent.eval.swe.script import TaskScript

    turns_run = ALL_TURNS[:getattr(args, "turns", len(ALL_TURNS))]
    clients_dir = Path(args.clients_dir) if args.clients_dir else clients_dir_default()
    model = served_model(base) or "default"
    server = ServerSessions(base)
    tmp = Path(tempfile.mkdtemp(prefix="fteval-openclaw-"))
    checks: list[dict[str, Any]] = []
    try:
        with Services(tmp, dovecot_imap(clients_dir)) as svc:
            inbox = svc.inbox
            work = tmp / "work"
            write_workspace(work, svc.env)
            plans = {t.prompt: list(t.steps) for t in turns_run}
            proxy = (NamedScriptedProxy(base, TaskScript(str(work), args.family, plans), args.family)
                     if args.scripted else NamedProxy(base))
            proxy.session_id = f"eval-openclaw-{uuid.uuid4().hex[:8]}"  # type: ignore[attr-defined]
            proxy.start()

            def check(i: int) -> None:
                events = {uid: _dtstart(ics) for uid, ics in svc.events().items()}
                sent = [(str(m["To"]), str(m["Subject"])) for m in svc.sent]
                want = turns_run[i]
                ok = events == want.events and sent == list(want.sent)
                print(f"openclaw turn {i + 1}/{len(turns_run)}: {'ok' if ok else 'FAILED'} ({want.prompt})",
                      file=sys.stderr, flush=True)
                checks.append({"turn": i + 1, "prompt": want.prompt, "ok": ok, "events": events,
                               "sent": sent, "expected_events": want.events, "expected_sent": list(want.sent)})
                tell(i + 1)

            def tell(done: int) -> None:
                if progress is not None:
                    nxt = f"turn {done + 1}: {turns_run[done].prompt}" if done < len(turns_run) else None
                    progress(done, len(turns_run), nxt)

            tell(0)

            try:
                client_turns = drive(args.client, work, proxy.url, model, [t.prompt for t in turns_run], clients_dir,
                                     after=check, adjust=openclaw_settings)
                exchanges = proxy.since(0)
            finally:
                proxy.stop()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    turns = model_turns("openclaw-w4", exchanges, server, renderer_for(args))
    success = len(checks) == len(turns_run) and all(c["ok"] for c in checks)
    run = {"run": "openclaw-w4", "success": success, "turns_checked": sum(c["ok"] for c in checks), "inbox": inbox,
           "client_turns": client_turns, **summarise(turns)}
    return {"eval": "openclaw", "base_url": base, "model": model, "client": args.client,
            "forced": bool(args.scripted), "runs": [run], "checks": checks, "turns": turns}


def openclaw_settings(home: Path) -> None:
    """The W4 setup on top of what `configure openclaw` wrote: the model idle watchdog (120 s for a
    cloud provider, 300 s for a self-hosted one) pushed to `IDLE_WATCHDOG_S` through the provider's
    `timeoutSeconds` (which also bounds each model request), the run budget unlimited (0), and the
    bootstrap-file limits raised so the whole standing context (evals/openclaw/context.py) is injected."""
    from evals.openclaw.context import BOOTSTRAP_LIMITS

    path = home / ".openclaw" / "openclaw.json"
    cfg = json.loads(path.read_text())
    cfg["models"]["providers"]["freetoken"]["timeoutSeconds"] = IDLE_WATCHDOG_S
    cfg["agents"]["defaults"].update(timeoutSeconds=0, **BOOTSTRAP_LIMITS)
    path.write_text(json.dumps(cfg, indent=2))


def _dtstart(ics: str) -> str:
    for line in ics.splitlines():
        if line.startswith("DTSTART"):
            return line.split(":", 1)[1].strip()
    return ""
