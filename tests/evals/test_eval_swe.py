"""`freetoken-agent eval swe`: the built-in tasks are real (each fail-to-pass test fails on the
buggy repository and passes with the reference fix), patches round-trip through the edit form,
and `--scripted --client mini-swe-agent` solves built-in tasks through mini-swe-agent's own bash
tool against a real demo server, with the report's tokens equal to the server's `/v1/sessions` and
the progress callback told of each task; a task whose reference patch is wrong is reported failed. The npm clients run under `clients`."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from freetoken_agent.cli import main
from freetoken_agent.eval.swe.tasks import BUILTIN, checkout, diff_of, edits_of, judge, load_tasks


def _apply(work: Path, edits: tuple[tuple[str, str, str], ...]) -> None:
    for path, old, new in edits:
        f = work / path
        text = f.read_text() if f.exists() else ""
        assert not old or text.count(old) == 1, (path, old)
        f.write_text(text.replace(old, new, 1) if old else new)


def _outcomes(root: Path) -> dict[str, bool]:
    """Every test under `root` in one pytest run: {"<task>/<file>::<name>": passed}."""
    r = subprocess.run([sys.executable, "-m", "pytest", "-rA", "-q", "-p", "no:cacheprovider", "."], cwd=root,
                       capture_output=True, text=True)
    return {m.group(2): m.group(1) == "PASSED" for m in re.finditer(r"^(PASSED|FAILED) (\S+)", r.stdout, re.M)}


def test_builtin_tasks_are_real_bugs(tmp_path: Path) -> None:
    tasks = load_tasks("builtin")
    assert len(tasks) >= 12
    assert sum(f.stat().st_size for f in BUILTIN.rglob("*") if f.is_file()) < 200_000
    for t in tasks:
        checkout(t, tmp_path / t.instance_id)
    before = _outcomes(tmp_path)
    for t in tasks:
        assert not any(before[f"{t.instance_id}/{i}"] for i in t.fail_to_pass), t.instance_id
        assert all(before[f"{t.instance_id}/{i}"] for i in t.pass_to_pass), t.instance_id
        _apply(tmp_path / t.instance_id, edits_of(t.patch))  # the derived unified diff, not the task's own edits
    after = _outcomes(tmp_path)
    assert all(after[f"{t.instance_id}/{i}"] for t in tasks for i in (*t.fail_to_pass, *t.pass_to_pass))
    # judge() on one checkout agrees
    assert judge(tasks[0], tmp_path / tasks[0].instance_id)["success"]


def test_patch_edit_round_trip(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text("a = 1\nb = 2\nc = 3\nd = 4\n")
    patch = diff_of(tmp_path, [("m.py", "b = 2\n", "b = 20\nb2 = 21\n"), ("n.py", "", "x = 1\n")])
    assert "+++ b/n.py" in patch and "-b = 2" in patch
    _apply(tmp_path, edits_of(patch))
    assert (tmp_path / "m.py").read_text() == "a = 1\nb = 20\nb2 = 21\nc = 3\nd = 4\n"
    assert (tmp_path / "n.py").read_text() == "x = 1\n"
    with pytest.raises(ValueError, match="no hunks"):
        edits_of("not a patch")


def _recording_progress(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """progress.load_progress replaced by a recorder: the (label, done, total, step) of every call."""
    calls: list[tuple[Any, ...]] = []

    @contextlib.contextmanager
    def record(label: str) -> Iterator[Callable[..., None]]:
        yield lambda done, total, step=None: calls.append((label, done, total, step))

    monkeypatch.setattr("freetoken_agent.progress.load_progress", record)
    return calls


def test_scripted_mini_swe_agent_solves_tasks(demo_server: str, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    progress = _recording_progress(monkeypatch)
    out = tmp_path / "out"
    rc = main(["eval", "swe", "--scripted", "--client", "mini-swe-agent", "--only", "calc-divide,stack-peek",
               "--turns", "1", "--concurrency", "2", "--base-url", demo_server, "--out", str(out)])
    result = json.loads((out / "result.json").read_text())
    assert rc == 0, result["runs"]
    assert result["solved"] == 2
    for run in result["runs"]:
        assert run["success"] and all(run["tests"].values())
        assert [t["exit"] for t in run["client_turns"]] == ["Submitted"]
        turns = [t for t in result["turns"] if t["run"] == run["run"]]
        assert len(turns) == 4  # read, edit (mini's bash), run the tests, submit
        assert all(t["status"] == 200 and t["ttft_ms"] for t in turns)
        sid = turns[0]["server_session"]
        assert sid.startswith(f"eval-{run['run']}-") and {t["server_session"] for t in turns} == {sid}
        server_turns = httpx.get(f"{demo_server}/v1/sessions/{sid}").json()["turns"]
        for key in ("prompt_tokens", "reused_tokens", "recomputed_tokens"):
            assert run[key] == sum(s[key] for s in server_turns), key
        assert run["reused_tokens"] > run["recomputed_tokens"]  # the agent's loop is append-only
    assert (out / "report.md").read_text().count("| True |") == 2
    # the progress bar: tasks done / total, the running tasks' ids as the step, both tasks finished
    assert progress[0] == ("swe tasks", 0, 2, None) and progress[-1][:3] == ("swe tasks", 2, 2)
    assert [c[1] for c in progress] == sorted(c[1] for c in progress) and len(progress) == 5
    steps = {str(c[3]) for c in progress[1:]}
    assert {"calc-divide", "stack-peek"} <= {i for s in steps for i in s.split(", ")}


def test_a_wrong_patch_is_reported_failed(demo_server: str, tmp_path: Path) -> None:
    repo = BUILTIN / "fizzbuzz-order" / "repo"
    wrong = diff_of(repo, [("fizz.py", '        return "FizzBuzz"\n', '        return "Fizz Buzz"\n')])
    inst = {"instance_id": "fizz-wrong", "repo": str(repo), "problem_statement": "fizzbuzz(15) must be FizzBuzz.",
            "patch": wrong, "FAIL_TO_PASS": json.dumps(["test_fizz.py::test_both"]),
            "PASS_TO_PASS": ["test_fizz.py::test_single"]}
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps(inst) + "\n")
    out = tmp_path / "out"
    assert main(["eval", "swe", "--scripted", "--tasks", str(tasks), "--turns", "1", "--base-url", demo_server,
                 "--out", str(out)]) == 1
    run = json.loads((out / "result.json").read_text())["runs"][0]
    assert run["success"] is False
    assert run["tests"] == {"test_fizz.py::test_both": False, "test_fizz.py::test_single": True}
    assert [t["exit"] for t in run["client_turns"]] == ["Submitted"]  # the client finished; the tests decided


@pytest.mark.clients
@pytest.mark.slow
@pytest.mark.parametrize("client", ["opencode", "claude-code"])
def test_scripted_npm_clients_solve_every_builtin_task(client: str, clients_server: str, tmp_path: Path) -> None:
    from evals.clients.agents import clients_dir_default, installed

    if not installed(client, clients_dir_default()):
        pytest.skip(f"{client} not installed under {clients_dir_default()} (run evals/clients/install.sh)")
    out = tmp_path / "out"
    rc = main(["eval", "swe", "--scripted", "--client", client, "--base-url", clients_server, "--tokenizer", "demo",
               "--out", str(out)])
    result = json.loads((out / "result.json").read_text())
    assert rc == 0, [(r["run"], r["client_turns"]) for r in result["runs"] if not r["success"]]
    assert result["solved"] == len(load_tasks("builtin"))
    for run in result["runs"]:
        assert [t["exit"] for t in run["client_turns"]] == [0, 0, 0], run["client_turns"]
        assert run["failed"] == 0 and run["truly_new_tokens"], run
        assert run["reused_tokens"] > run["recomputed_tokens"]  # the cache serves most of every prompt


@pytest.mark.clients
@pytest.mark.slow
@pytest.mark.parametrize("client", ["opencode", "claude-code", "codex", "openclaw"])
def test_scripted_clients_use_tools_on_gpt_oss(client: str, oss_server: str, tmp_path: Path) -> None:
    """Issue 27: each real CLI runs a tool-using turn (read, edit, shell) and a follow-up against the
    gpt-oss demo, every reply forced in harmony and parsed back by the server."""
    from evals.clients.agents import clients_dir_default, installed

    if not installed(client, clients_dir_default()):
        pytest.skip(f"{client} not installed under {clients_dir_default()} (run evals/clients/install.sh)")
    out = tmp_path / "out"
    rc = main(["eval", "swe", "--scripted", "--family", "gpt_oss", "--client", client, "--only", "calc-divide",
               "--turns", "2", "--base-url", oss_server, "--tokenizer", "demo:gpt_oss", "--out", str(out)])
    result = json.loads((out / "result.json").read_text())
    run = result["runs"][0]
    assert rc == 0 and run["success"], run
    assert [t["exit"] for t in run["client_turns"]] == [0, 0], run["client_turns"]
    assert run["failed"] == 0 and run["requests"] >= 5, run  # read, edit, run, answer; then run, answer
    assert run["reused_tokens"] > run["recomputed_tokens"], run
