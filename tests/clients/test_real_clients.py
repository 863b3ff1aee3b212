"""The real agent CLIs against our server, and a replay of the requests they sent.

* `test_real_client[...]` (marked `clients`): runs each installed CLI for one non-interactive turn
  and its follow-up through `evals/clients/run_clients.py`, against the demo and the gpt-oss demo,
  and asserts both passed. Skipped unless the CLIs are
  installed under `.clients/` or `$FREETOKEN_CLIENTS_DIR` (`evals/clients/install.sh`). Per-client
  timeout: `$FREETOKEN_CLIENTS_TIMEOUT` (default 240 s).
* `test_replay_recorded[...]` (always on): POSTs the first request(s) each client sent, as recorded
  in `tests/clients/recorded/{client}.json` by `run_clients.py --record`, to a server started here,
  and asserts a 200 with a well-formed SSE stream for the protocol.
"""

from __future__ import annotations

import http.client
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from evals.clients import run_clients as rc  # noqa: E402

RECORDED = Path(__file__).parent / "recorded"
RECORDINGS = sorted(RECORDED.glob("*.json"))
# Replayed requests may ask for 512 tokens; a small cap keeps the test cheap (shape is what matters).
REPLAY_MAX_TOKENS = 32


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    log = tmp_path_factory.mktemp("server") / "server.log"
    with rc.serve(log, max_output_tokens=REPLAY_MAX_TOKENS) as url:
        yield url, log


def _replay_cases() -> list[Any]:
    cases = []
    for path in RECORDINGS:
        data = json.loads(path.read_text())
        for i, req in enumerate(data["requests"]):
            cases.append(pytest.param(data["client"], req, id=f"{data['client']}-{i}"))
    return cases


def _cap_tokens(body: dict[str, Any]) -> dict[str, Any]:
    body = dict(body)
    for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        if isinstance(body.get(key), int):
            body[key] = min(body[key], REPLAY_MAX_TOKENS)
    return body


def test_recordings_exist() -> None:
    names = {p.stem for p in RECORDINGS}
    assert {"claude-code", "codex", "opencode", "openclaw"} <= names, names


@pytest.mark.parametrize(("client", "req"), _replay_cases())
def test_replay_recorded(server: tuple[str, Path], client: str, req: dict[str, Any]) -> None:
    url, log = server
    port = int(url.rsplit(":", 1)[1])
    body = _cap_tokens(req["body"])
    body["model"] = rc.MODEL
    headers = {k: v for k, v in req["headers"].items() if k not in ("content-length", "host")}
    headers["content-type"] = "application/json"
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    conn.request(req["method"], req["path"], body=json.dumps(body).encode(), headers=headers)
    resp = conn.getresponse()
    raw = resp.read()
    conn.close()
    assert resp.status == 200, f"{client} {req['path']}: {resp.status} {raw[:1000]!r}"
    ctype = resp.getheader("content-type") or ""
    if body.get("stream"):
        assert ctype.startswith("text/event-stream"), ctype
        problems = rc.check_sse(req["path"], raw)
        assert not problems, f"{client} {req['path']}: {problems}\n{raw[-2000:]!r}"
    else:
        assert ctype.startswith("application/json"), ctype
        json.loads(raw)
    tail = log.read_text(errors="replace")
    assert "Traceback" not in tail, tail[-3000:]


# ------------------------------------------------------------------------------------------------
# The real CLIs (slow; only where they are installed)
# ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=["demo", "demo:gpt_oss"])
def live(request: pytest.FixtureRequest,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[rc.RecordingProxy, Path]]:
    """The demo (Qwen3.5-MoE) and the gpt-oss demo (harmony), each behind a recording proxy."""
    log = tmp_path_factory.mktemp("live") / "server.log"
    with rc.serve(log, model=request.param) as url:
        proxy = rc.RecordingProxy(url).start()
        try:
            yield proxy, log
        finally:
            proxy.stop()


@pytest.mark.clients
@pytest.mark.slow
@pytest.mark.parametrize("name", list(rc.CLIENTS))
def test_real_client(name: str, live: tuple[rc.RecordingProxy, Path]) -> None:
    clients_dir = rc.clients_dir_default()
    if not rc.installed(name, clients_dir):
        pytest.skip(f"{name} not installed under {clients_dir} (run evals/clients/install.sh)")
    proxy, log = live
    timeout = float(os.environ.get("FREETOKEN_CLIENTS_TIMEOUT", "240"))
    result = rc.run_client(rc.CLIENTS[name], proxy.url, proxy, log, clients_dir, timeout)
    result.pop("_exchanges", None)
    report = json.dumps(result, indent=1, ensure_ascii=False)
    assert result["ok"], report
    assert result["n_model_requests"] >= 1, report


def test_clients_filter_rejects_unknown(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        rc.main(["--clients", "nope", "--out", str(Path(tempfile.gettempdir()) / "never.json")])
    assert "unknown client" in capsys.readouterr().err


def test_check_sse_catches_broken_streams() -> None:
    good = (b'event: message_start\ndata: {"type":"message_start"}\n\n'
            b'event: message_delta\ndata: {"type":"message_delta"}\n\n'
            b'event: message_stop\ndata: {"type":"message_stop"}\n\n')
    assert rc.check_sse("/v1/messages?beta=true", good) == []
    assert rc.check_sse("/v1/messages", good.replace(b'{"type":"message_delta"}', b"{oops")) != []
    assert rc.check_sse("/v1/chat/completions", b'data: {"object":"chat.completion.chunk","choices":[]}\n\n')
    assert rc.check_sse("/v1/responses", b'event: response.created\ndata: {"type":"response.created"}\n\n')


def test_server_banner_names_the_device_auto_chose(server: tuple[str, Path]) -> None:
    """`serve` without --device picks it (`auto`) and says which in its first line."""
    import torch

    _, log = server
    banner = next(line for line in log.read_text(errors="replace").splitlines() if "serving" in line)
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert f"{expected}, chosen by --device auto" in banner, banner
    assert "context 131072 tokens" in banner, banner
