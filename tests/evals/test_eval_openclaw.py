"""`freetoken-agent eval openclaw`: the assistant scenario over real local services (Radicale
CalDAV, an aiosmtpd SMTP sink) against a real demo server; each turn's effect is read back from
the services. CI runs the first turns through mini-swe-agent's shell (scripted); the whole
13-turn scenario through OpenClaw runs under `clients`."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from evals.openclaw.scenario import TURNS
from freetoken_agent.cli import main


def test_scripted_first_turns_change_the_services(demo_server: str, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    progress: list[tuple[Any, ...]] = []

    @contextlib.contextmanager
    def record(label: str) -> Iterator[Callable[..., None]]:
        yield lambda done, total, step=None: progress.append((label, done, total, step))

    monkeypatch.setattr("freetoken_agent.progress.load_progress", record)
    out = tmp_path / "out"
    rc = main(["eval", "openclaw", "--scripted", "--client", "mini-swe-agent", "--turns", "4",
               "--base-url", demo_server, "--out", str(out)])
    result = json.loads((out / "result.json").read_text())
    assert rc == 0, result["checks"]
    assert [c["ok"] for c in result["checks"]] == [True] * 4
    # the calendar and the SMTP sink, read back from the services, hold what turns 3 and 4 did
    assert result["checks"][2]["events"] == {"review": "20270112T100000"}
    assert result["checks"][3]["sent"] == [["alice@example.com", "Re: Project review"]]
    assert result["checks"][1]["events"] == {} and result["checks"][1]["sent"] == []
    run = result["runs"][0]
    assert run["success"] and run["turns_checked"] == 4 and run["requests"] == 8
    assert all(t["status"] == 200 for t in result["turns"])
    # the progress bar: user turns done / total, the next turn as the step
    assert progress == [("openclaw turns", i, 4, f"turn {i + 1}: {TURNS[i].prompt}") for i in range(4)] + \
        [("openclaw turns", 4, 4, None)]


def test_scenario_has_13_turns_with_distinct_prompts() -> None:
    prompts = [t.prompt for t in TURNS]
    assert len(prompts) == 13
    assert not any(a != b and a in b for a in prompts for b in prompts)  # each turn is found by its prompt


@pytest.mark.clients
@pytest.mark.slow
def test_scripted_openclaw_runs_the_whole_scenario(clients_server: str, tmp_path: Path) -> None:
    from evals.clients.agents import clients_dir_default, installed

    if not installed("openclaw", clients_dir_default()):
        pytest.skip(f"openclaw not installed under {clients_dir_default()} (run evals/clients/install.sh)")
    out = tmp_path / "out"
    rc = main(["eval", "openclaw", "--scripted", "--base-url", clients_server, "--tokenizer", "demo",
               "--out", str(out)])
    result = json.loads((out / "result.json").read_text())
    assert rc == 0, [c for c in result["checks"] if not c["ok"]]
    assert len(result["checks"]) == 13
    run = result["runs"][0]
    assert [t["exit"] for t in run["client_turns"]] == [0] * 13 and run["failed"] == 0, run
    assert result["turns"][0]["prompt_tokens"] > 22_000  # the paper's ~24k-token system context
    later = sum(t["recomputed_tokens"] for t in result["turns"][1:])
    assert later < 0.05 * run["reused_tokens"], (later, run["reused_tokens"])  # after the first prefill, reuse


def test_system_context_is_about_24k_tokens() -> None:
    """OpenClaw's own system prompt and tools (as recorded from 2026.9.6) plus the standing context the
    eval injects come to the paper's ~24k tokens, in the demo's tokenizer."""
    from evals.openclaw.context import BOOTSTRAP_LIMITS, bootstrap_files
    from evals.traces.replay import Renderer

    first = json.loads((Path(__file__).resolve().parents[2] / "evals/traces/data/openclaw.json").read_text())["requests"][0]
    body = dict(first["body"])
    body["messages"] = [m for m in body["messages"] if m["role"] == "system"] + [{"role": "user", "content": "hi"}]
    renderer = Renderer("demo")
    own = len(renderer.prompt_ids(first["path"], body))
    files = bootstrap_files()
    added = sum(len(renderer.ids(text)) for text in files.values())
    assert 22_000 <= own + added <= 26_000, (own, added)
    assert max(len(t) for t in files.values()) <= BOOTSTRAP_LIMITS["bootstrapMaxChars"]
    assert sum(len(t) for t in files.values()) <= BOOTSTRAP_LIMITS["bootstrapTotalMaxChars"]


@pytest.mark.clients
def test_inbox_is_served_over_imap_by_dovecot(tmp_path: Path) -> None:
    import imaplib
    import subprocess

    from evals.clients.agents import clients_dir_default
    from evals.openclaw.imap import dovecot_imap
    from evals.openclaw.services import INBOX, Services
    from evals.openclaw.workspace import write_workspace

    imap = dovecot_imap(clients_dir_default())
    if imap is None:
        pytest.skip("Dovecot is not unpacked (run evals/openclaw/install_imap.sh)")
    with Services(tmp_path, imap) as svc:
        assert svc.inbox == "imap"
        host, port = svc.env["EVAL_IMAP"].split(":")
        with imaplib.IMAP4(host, int(port)) as m:
            assert m.state == "AUTH"  # Dovecot's pre-authenticated greeting
            assert m.select("INBOX", readonly=True)[1] == [b"3"]
            got = m.fetch("1:3", "(BODY.PEEK[HEADER.FIELDS (SUBJECT)])")[1]
        subjects = [part[1].decode().strip() for part in got if isinstance(part, tuple)]
        assert subjects == [f"Subject: {s}" for _, s, _ in INBOX]
        write_workspace(tmp_path / "work", svc.env)
        listed = subprocess.run([sys.executable, "mail.py", "list"], cwd=tmp_path / "work", capture_output=True,
                                text=True, check=True).stdout
        assert listed.splitlines() == [f"{i}. {a}: {s}" for i, (a, s, _) in enumerate(INBOX, 1)]
