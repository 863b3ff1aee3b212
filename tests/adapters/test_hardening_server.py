"""The hardened server (issue 24) as a real `freetoken-agent serve` process on loopback: a 1 MB
header is a 431, a trickling head is cut, `/health` answers within 1 s while a multi-megabyte
prompt is tokenised and while a long stop string is matched, a client that leaves mid-body costs
one log line and a 499 in the metrics, a hypothesis fuzz over every route and field never gets a
5xx, and SIGTERM lets a running stream end with its protocol's error event (last: it stops the
server)."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_fixture import MODEL_NAME, ServerProcess, build_endless_model, parse_prometheus, parse_sse

from adapters.transport import HEADER_TIMEOUT_S

ADMIN = "admin-key-for-tests"


@pytest.fixture(scope="module")
def hard(demo_cache: Path, demo_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[ServerProcess]:
    endless = build_endless_model(demo_dirs["qwen3_5_moe"], demo_cache)
    server = ServerProcess.launch("hard", ["--model", str(endless), "--served-model-name", MODEL_NAME,
                                           "--admin-key", ADMIN, "--shutdown-grace", "1", "--max-output-tokens", "8",
                                           "--context-window", "65536", "--log-level", "warning"],
                                  demo_cache, tmp_path_factory.mktemp("hard-log"))
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def raw_exchange(port: int, data: bytes, timeout: float = 20.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def test_a_huge_header_is_a_431(hard: ServerProcess) -> None:
    head = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n"
    reply = raw_exchange(hard.port, head)
    assert reply.startswith(b"HTTP/1.1 431 "), reply[:200]
    assert hard.health()["status"] == "ok"


def test_a_trickling_head_is_cut(hard: ServerProcess) -> None:
    crowd = [socket.create_connection(("127.0.0.1", hard.port), timeout=5) for _ in range(100)]
    for c in crowd:  # heads that never end
        c.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
    t0 = time.monotonic()
    assert hard.health()["status"] == "ok"
    assert time.monotonic() - t0 < 1.0
    with socket.create_connection(("127.0.0.1", hard.port), timeout=HEADER_TIMEOUT_S + 10) as s:
        start = time.monotonic()
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        closed = False
        while time.monotonic() - start < HEADER_TIMEOUT_S + 8:
            try:
                s.sendall(b"X-Slow: 1\r\n")
                s.settimeout(1.0)
                if s.recv(1024) == b"":
                    closed = True
                    break
            except TimeoutError:
                continue
            except OSError:
                closed = True
                break
        assert closed, "the server held a connection whose head never ended"
        assert time.monotonic() - start < HEADER_TIMEOUT_S + 5
    for c in crowd:
        c.settimeout(5)
        assert c.recv(1024) == b""  # closed by the server too
        c.close()


def health_latency_during(hard: ServerProcess, work: Any) -> tuple[float, Any]:
    """The worst `/health` round trip while `work()` runs in another thread, and its result."""
    result: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: result.update(out=work()))
    thread.start()
    worst = 0.0
    with httpx.Client(timeout=30) as client:
        while thread.is_alive():
            t0 = time.monotonic()
            assert client.get(hard.url("/health")).status_code == 200
            worst = max(worst, time.monotonic() - t0)
            time.sleep(0.05)
    thread.join()
    return worst, result["out"]


def rss(server: ServerProcess) -> int:
    for line in Path(f"/proc/{server.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_health_answers_while_a_huge_prompt_is_tokenised(hard: ServerProcess) -> None:
    words = " ".join(f"word{i % 997}" for i in range(260_000))  # ~2.5 MB: far past the context window
    body = {"messages": [{"role": "user", "content": words}], "max_tokens": 1}
    post = lambda: httpx.post(hard.url("/v1/chat/completions"), json=body, timeout=300)  # noqa: E731
    post()  # the first one warms the allocator's arenas up
    before = rss(hard)
    worst, r = health_latency_during(hard, post)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text[:300]
    assert worst < 1.0, worst
    assert rss(hard) < 1.1 * before, (rss(hard), before)


def test_health_answers_while_a_long_stop_is_matched(hard: ServerProcess) -> None:
    body = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 100, "stop": ["q" * 512] * 16,
            "chat_template_kwargs": {"enable_thinking": False}}
    worst, r = health_latency_during(hard, lambda: httpx.post(hard.url("/v1/chat/completions"), json=body,
                                                               timeout=300))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 100, r.text[:300]
    assert worst < 1.0, worst


def test_a_client_gone_mid_body_is_one_line_and_a_499(hard: ServerProcess) -> None:
    key = 'freetoken_requests_total{route="/v1/chat/completions",status="499"}'
    before = parse_prometheus(httpx.get(hard.url("/metrics"), timeout=10).text).get(key, 0.0)
    lines_before = hard.log().count("mid-body")
    with socket.create_connection(("127.0.0.1", hard.port), timeout=10) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100000\r\n\r\n{\"messages\": [")
        time.sleep(0.3)
    deadline = time.monotonic() + 10
    after = before
    while after == before and time.monotonic() < deadline:
        after = parse_prometheus(httpx.get(hard.url("/metrics"), timeout=10).text).get(key, 0.0)
        time.sleep(0.1)
    assert after == before + 1
    log = hard.log()
    assert log.count("mid-body") == lines_before + 1 and "Traceback" not in log


def test_request_kv_returns_to_zero_after_a_disconnect(hard: ServerProcess) -> None:
    key = "freetoken_request_kv_tokens"
    body = {"messages": [{"role": "user", "content": "go on"}], "max_tokens": 3000, "stream": True}
    with httpx.Client(timeout=60) as client, client.stream("POST", hard.url("/v1/chat/completions"), json=body) as s:
        lines = s.iter_lines()
        for _ in range(3):
            next(lines)
        assert parse_prometheus(httpx.get(hard.url("/metrics"), timeout=10).text)[key] > 0
    deadline = time.monotonic() + 10
    while parse_prometheus(httpx.get(hard.url("/metrics"), timeout=10).text)[key] != 0:
        assert time.monotonic() < deadline, "the KV of a request whose client left was not freed"
        time.sleep(0.1)


# ---------------------------------------------------------------- fuzz

TEXT = st.text(max_size=40)
SCALAR = st.none() | st.booleans() | st.integers(-5, 16) | st.integers(10**6, 10**30) | st.floats(
    allow_nan=False, allow_infinity=False) | TEXT
JSONISH = st.recursive(SCALAR, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
                       max_leaves=8)
ROLE = st.sampled_from(["user", "assistant", "system", "tool", "developer", "x"])
PART = st.fixed_dictionaries({"type": st.sampled_from(["text", "image", "tool_result", "tool_use", "thinking",
                                                       "input_text", "reasoning", "function_call_output"])},
                             optional={"text": JSONISH, "content": JSONISH, "input": JSONISH, "name": JSONISH,
                                       "id": JSONISH, "tool_use_id": JSONISH, "output": JSONISH, "call_id": JSONISH})
MESSAGE = st.fixed_dictionaries({"role": ROLE}, optional={"content": TEXT | st.lists(PART, max_size=3) | JSONISH,
                                                          "tool_calls": JSONISH, "tool_call_id": JSONISH,
                                                          "reasoning_content": JSONISH, "type": JSONISH})
FIELDS = {k: JSONISH for k in ("model", "stream", "temperature", "top_p", "top_k", "max_tokens",
                               "max_completion_tokens", "max_output_tokens", "stop", "stop_sequences", "tools",
                               "tool_choice", "system", "instructions", "reasoning", "thinking", "seed", "n",
                               "stream_options", "parallel_tool_calls", "chat_template_kwargs", "metadata",
                               "previous_response_id", "kv_tokens", "gpu_memory", "checkpoint_slots",
                               "freetoken_forced_output")}
BODY = st.fixed_dictionaries({}, optional={"messages": st.lists(MESSAGE, max_size=3) | JSONISH,
                                           "input": TEXT | st.lists(PART | MESSAGE, max_size=3) | JSONISH, **FIELDS})
ROUTES = ["/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens", "/v1/memory",
          "/v1/models", "/v1/models/x", "/v1/sessions", "/v1/sessions/x", "/metrics", "/health", "/nowhere"]


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(route=st.sampled_from(ROUTES), body=BODY | JSONISH, method=st.sampled_from(["POST", "GET"]),
       as_json=st.booleans() | st.just(True))
def test_fuzz_never_a_5xx(hard: ServerProcess, route: str, body: Any, method: str, as_json: bool) -> None:
    if isinstance(body, dict) and body.get("stream") and isinstance(body.get("max_tokens"), int):
        body["max_tokens"] = min(body["max_tokens"], 16)
    if route == "/v1/memory" and isinstance(body, dict):  # a valid huge pool would really be allocated
        for pool in ("kv_tokens", "checkpoint_slots"):
            if isinstance(body.get(pool), int) and body[pool] > 16:
                body[pool] = -1
    headers = {"content-type": "application/json" if as_json else "text/plain"}
    if route == "/v1/memory":
        headers["authorization"] = f"Bearer {ADMIN}"
    content = json.dumps(body).encode()
    t0 = time.monotonic()
    with httpx.stream(method, hard.url(route), content=content if method == "POST" else None, headers=headers,
                      timeout=60) as r:
        text = r.read().decode(errors="replace")
    assert time.monotonic() - t0 < 60
    assert r.status_code < 500, (route, body, r.status_code, text[:500])
    if r.status_code >= 400 and r.headers.get("content-type", "").startswith("application/json"):
        assert "error" in r.json(), text[:300]  # OpenAI's {"error": ...} or Anthropic's {"type": "error", ...}
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        events = list(parse_sse(text.splitlines()))
        assert events, text[:300]
    assert hard.alive()


# ---------------------------------------------------------------- shutdown (last: it stops the server)


def test_sigterm_ends_a_running_stream_with_an_error_event(hard: ServerProcess) -> None:
    body = {"messages": [{"role": "user", "content": "go on"}], "max_tokens": 5000, "stream": True,
            "chat_template_kwargs": {"enable_thinking": False}}
    with httpx.Client(timeout=60) as client, client.stream("POST", hard.url("/v1/chat/completions"), json=body) as s:
        lines = s.iter_lines()
        next(lines)
        os.killpg(hard.proc.pid, signal.SIGTERM)
        sent = time.monotonic()
        events = [e for e in parse_sse(lines) if not e.comment]
    assert events[-1].data == "[DONE]"
    assert events[-2].json()["error"]["message"] == "the server is shutting down", events[-3:]
    assert time.monotonic() - sent < 10
    hard.proc.wait(timeout=15)
    assert hard.proc.returncode in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once drained
