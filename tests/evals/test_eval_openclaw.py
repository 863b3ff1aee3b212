"""`freetoken-agent eval openclaw`: the assistant scenario over real local services (Radicale
CalDAV, an aiosmtpd SMTP sink) against a real demo server; each turn's effect is read back from
the services. CI runs the first turns through mini-swe-agent's shell (scripted); the whole
13-turn scenario through OpenClaw runs under `clients`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from evals.openclaw.scenario import TURNS
from freetoken_agent.cli import main


def test_scripted_first_turns_change_the_services(demo_server: str, tmp_path: Path) -> None:
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


def test_scenario_has_13_turns_with_distinct_prompts() -> None:
    prompts = [t.prompt for t in TURNS]
    assert len(prompts) == 13
    assert not any(a != b and a in b for a in prompts for b in prompts)  # each turn is found by its prompt


@pytest.mark.clients
@pytest.mark.slow
def test_scripted_openclaw_runs_the_whole_scenario(demo_server: str, tmp_path: Path) -> None:
    from evals.clients.agents import clients_dir_default, installed

    if not installed("openclaw", clients_dir_default()):
        pytest.skip(f"openclaw not installed under {clients_dir_default()} (run evals/clients/install.sh)")
    out = tmp_path / "out"
    rc = main(["eval", "openclaw", "--scripted", "--base-url", demo_server, "--out", str(out)])
    result = json.loads((out / "result.json").read_text())
    assert rc == 0, [c for c in result["checks"] if not c["ok"]]
    assert len(result["checks"]) == 13
