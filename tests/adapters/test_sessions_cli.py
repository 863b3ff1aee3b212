"""`freetoken-agent sessions` against real servers: JSON, readable tables, auth, and a one-line
error when the server is unreachable."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
from server_fixture import API_KEY, MODEL_NAME, REPO, ServerProcess, child_env, free_port


def _cli(*args: str, cache: str = "") -> subprocess.CompletedProcess[str]:
    env = child_env(Path(cache or "/tmp"))
    env["COLUMNS"] = "200"
    return subprocess.run([sys.executable, "-m", "freetoken_agent", "sessions", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def _talk(server: ServerProcess, sid: str) -> None:
    r = httpx.post(server.url("/v1/chat/completions"), headers={**server.headers(), "x-session-id": sid}, timeout=120,
                   json={"model": MODEL_NAME, "max_tokens": 3,
                         "messages": [{"role": "system", "content": f"cli test {sid}"},
                                      {"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text


def test_json_list_and_one(q35: ServerProcess) -> None:
    sid = f"cli-{uuid.uuid4().hex[:8]}"
    _talk(q35, sid)
    p = _cli("--base-url", q35.base_url, "--json")
    assert p.returncode == 0, p.stderr
    listing = json.loads(p.stdout)
    assert any(s["id"] == sid and s["turns"] == 1 for s in listing["data"])
    p = _cli(sid, "--url", q35.v1, "--json")  # --url alias; a /v1 suffix is accepted
    assert p.returncode == 0, p.stderr
    one = json.loads(p.stdout)
    assert one["id"] == sid and one["client"] == "generic" and len(one["turns"]) == 1
    assert {"prompt_tokens", "reused_tokens", "recomputed_tokens", "divergence_position", "divergence_cause",
            "checkpoint_position"} <= set(one["turns"][0])


def test_tables(q35: ServerProcess) -> None:
    sid = f"cli-{uuid.uuid4().hex[:8]}"
    _talk(q35, sid)
    _talk(q35, sid)
    p = _cli("--base-url", q35.base_url)
    assert p.returncode == 0, p.stderr
    assert "sessions (anchor policy: semantic)" in p.stdout and sid in p.stdout
    p = _cli(sid, "--base-url", q35.base_url)
    assert p.returncode == 0, p.stderr
    assert f"session {sid}" in p.stdout and "client generic" in p.stdout and "turns 2" in p.stdout
    assert "diverged at" in p.stdout and "resend" in p.stdout  # the same request twice
    assert "anchor kinds for generic" in p.stdout


def test_errors_are_one_line(q35: ServerProcess, locked: ServerProcess) -> None:
    p = _cli("--base-url", f"http://127.0.0.1:{free_port()}")
    assert p.returncode == 1 and p.stdout == ""
    assert p.stderr.startswith("error: cannot reach the server at http://127.0.0.1:") and p.stderr.count("\n") == 1
    p = _cli("no-such-session", "--base-url", q35.base_url)
    assert p.returncode == 1 and "HTTP 404" in p.stderr and p.stderr.count("\n") == 1
    p = _cli("--base-url", locked.base_url)
    assert p.returncode == 1 and "HTTP 401" in p.stderr and "invalid API key" in p.stderr
    p = _cli("--base-url", locked.base_url, "--api-key", API_KEY, "--json")
    assert p.returncode == 0 and json.loads(p.stdout)["object"] == "list"
