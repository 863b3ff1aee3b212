"""Real `freetoken-agent serve` processes for the end-to-end server tests, and small wire helpers.

Contract: `ServerProcess.launch(name, args, cache_dir, log_dir)` starts `python -m freetoken_agent
serve --model demo ...` on a free loopback port in its own process group (stdout and stderr go to
a log file) and returns at once; `wait_ready()` blocks until `GET /health` answers 200 (failing
with the log tail if the process dies or takes too long); `stop()` terminates it (SIGTERM, then
SIGKILL) and only it. `build_demo_models(cache_dir)` creates the demo model copies once, in
parallel child processes, so servers of the same family do not build them twice.

The helpers parse Server-Sent Events from raw bytes (`parse_sse`) so the tests can check event
order and framing without any SDK in the way.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai

REPO = Path(__file__).resolve().parents[2]
MODEL_NAME = "freetoken-demo"
API_KEY = "sk-test-secret-key"
SMALL_CONTEXT = 256
START_TIMEOUT_S = 180.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def child_env(cache_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["FREETOKEN_CACHE_DIR"] = str(cache_dir)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def build_demo_models(cache_dir: Path, arches: Iterable[str] = ("qwen3_5_moe", "qwen3_moe")) -> dict[str, Path]:
    """Create the cached demo models (no-op when they exist), in parallel; returns their directories."""
    code = "import sys; from freetoken_agent.demo import demo_model_dir; print(demo_model_dir(sys.argv[1]))"
    procs = {arch: subprocess.Popen([sys.executable, "-c", code, arch], env=child_env(cache_dir), cwd=REPO,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for arch in arches}
    out: dict[str, Path] = {}
    for arch, p in procs.items():
        stdout, stderr = p.communicate(timeout=600)
        if p.returncode != 0:
            raise RuntimeError(f"building the {arch} demo model failed:\n{stdout}\n{stderr}")
        out[arch] = Path(stdout.strip().splitlines()[-1])
    return out


def build_endless_model(src: Path, root: Path) -> Path:
    """A copy of a demo model whose lm_head rows for `</think>` and the EOS ids are random like the
    others, so it neither closes its reasoning nor ends its turn by itself: replies run to max_tokens
    (the reasoning / disconnect / stop-string tests need long, predictable outputs). Written once,
    atomically, next to the demo models."""
    import shutil
    import tempfile

    import torch
    from safetensors.torch import load_file, save_file

    from freetoken_agent.tokenizer import ChatTokenizer

    dst = root / f"endless-{src.name}"
    if (dst / "model.safetensors").exists():
        return dst
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".endless-"))
    try:
        for f in src.iterdir():
            if f.is_file() and f.name != "model.safetensors":
                shutil.copy2(f, tmp / f.name)
        tok = ChatTokenizer.from_dir(src)
        gen_cfg = json.loads((src / "generation_config.json").read_text())
        eos = gen_cfg.get("eos_token_id", [])
        stop_ids = {tok.token_to_id("</think>"), *(eos if isinstance(eos, list) else [eos]), tok.eos_token_id}
        tensors = load_file(str(src / "model.safetensors"))
        head = tensors["lm_head.weight"]
        g = torch.Generator().manual_seed(7)
        for i in sorted(t for t in stop_ids if t is not None):
            head[i] = torch.randn(head.shape[1], generator=g) * 0.5
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        try:
            tmp.rename(dst)
        except OSError:  # another session won the race
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


def stop_all(servers: Iterable[ServerProcess], grace: float = 3.0) -> None:
    """SIGTERM every server at once, then SIGKILL whatever is still running after `grace` seconds."""
    running = [s for s in servers if s.proc.poll() is None]
    for s in running:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(s.proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for s in running:
        try:
            s.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(s.proc.pid, signal.SIGKILL)
            s.proc.wait(timeout=10)


@dataclass
class ServerProcess:
    name: str
    port: int
    proc: subprocess.Popen[bytes]
    log_path: Path
    api_key: str | None = None
    args: list[str] = field(default_factory=list)

    @classmethod
    def launch(cls, name: str, args: list[str], cache_dir: Path, log_dir: Path,
               api_key: str | None = None) -> ServerProcess:
        port = free_port()
        cmd = [sys.executable, "-m", "freetoken_agent", "serve", "--port", str(port), "--host", "127.0.0.1", *args]
        if api_key:
            cmd += ["--api-key", api_key]
        log_path = log_dir / f"{name}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, cwd=REPO, env=child_env(cache_dir), stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        return cls(name=name, port=port, proc=proc, log_path=log_path, api_key=api_key, args=cmd)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def v1(self) -> str:
        return f"{self.base_url}/v1"

    def url(self, path: str) -> str:
        return f"{self.base_url}{path}"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server {self.name} exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                if httpx.get(self.url("/health"), timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server {self.name} not healthy after {timeout:.0f} s:\n{self.log()[-4000:]}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        stop_all([self])

    def health(self) -> dict[str, Any]:
        r = httpx.get(self.url("/health"), timeout=10)
        r.raise_for_status()
        return dict(r.json())

    def metrics(self) -> dict[str, float]:
        """Prometheus samples without labels, plus labelled ones keyed by their full line name."""
        r = httpx.get(self.url("/metrics"), headers=self.headers(), timeout=10)
        r.raise_for_status()
        return parse_prometheus(r.text)


def openai_client(server: ServerProcess, api_key: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key=api_key or server.api_key or "sk-unused", max_retries=0,
                         timeout=120)


def async_openai_client(server: ServerProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.v1, api_key=server.api_key or "sk-unused", max_retries=0, timeout=120)


def anthropic_client(server: ServerProcess, api_key: str | None = None) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key=api_key or server.api_key or "sk-unused",
                               max_retries=0, timeout=120)


def async_anthropic_client(server: ServerProcess) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=server.base_url, api_key=server.api_key or "sk-unused", max_retries=0,
                                    timeout=120)


def assert_alive(server: ServerProcess) -> None:
    """The server still answers a real (tiny) generation after whatever the test did."""
    r = httpx.post(server.url("/v1/chat/completions"), headers=server.headers(), timeout=60,
                   json={"messages": [{"role": "user", "content": "still there?"}], "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


def wait_idle(server: ServerProcess, timeout: float) -> float:
    """Seconds until `/health` shows nothing running or waiting; `inf` if that never happens in time."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        h = server.health()
        if h["running"] == 0 and h["waiting"] == 0:
            return time.monotonic() - start
        time.sleep(0.05)
    return float("inf")


def assert_openai_error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"], body
    assert isinstance(err["type"], str), body
    assert "param" in err and "code" in err, body
    return dict(err)


def assert_anthropic_error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert body["type"] == "error", body
    err = body["error"]
    assert isinstance(err["type"], str) and err["type"].endswith("_error"), body
    assert isinstance(err["message"], str) and err["message"], body
    return dict(err)


def pick_stop(text: str, width: int = 3) -> str:
    """A short substring from the middle of `text`: no whitespace, no U+FFFD, not at the start."""
    for k in range(max(3, len(text) // 3), len(text) - width):
        s = text[k:k + width]
        if not any(c.isspace() or c == "\ufffd" for c in s) and text.find(s) >= 3:
            return s
    raise AssertionError(f"no usable stop string in {text!r}")


def parse_prometheus(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        out[name] = float(value)
    return out


@dataclass
class SseEvent:
    event: str | None
    data: str
    comment: bool = False

    def json(self) -> Any:
        return json.loads(self.data)


def parse_sse(lines: Iterable[str]) -> Iterator[SseEvent]:
    """SSE events from decoded lines (as `httpx.Response.iter_lines` gives them); comments too."""
    event: str | None = None
    data: list[str] = []
    for line in lines:
        if line == "":
            if data or event is not None:
                yield SseEvent(event, "\n".join(data))
            event, data = None, []
            continue
        if line.startswith(":"):
            yield SseEvent(None, line[1:].strip(), comment=True)
            continue
        key, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if key == "event":
            event = value
        elif key == "data":
            data.append(value)
    if data or event is not None:
        yield SseEvent(event, "\n".join(data))


WEATHER_PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}
TIME_PARAMS: dict[str, Any] = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}},
                               "required": ["zone"]}
TOOL_SPECS: dict[str, tuple[str, dict[str, Any]]] = {
    "get_weather": ("Current weather in a city", WEATHER_PARAMS),
    "get_time": ("Current time in a time zone", TIME_PARAMS),
}


def chat_tools(*names: str) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": n, "description": TOOL_SPECS[n][0],
                                              "parameters": TOOL_SPECS[n][1]}} for n in names]


def anthropic_tools(*names: str) -> list[dict[str, Any]]:
    return [{"name": n, "description": TOOL_SPECS[n][0], "input_schema": TOOL_SPECS[n][1]} for n in names]


def responses_tools(*names: str) -> list[dict[str, Any]]:
    return [{"type": "function", "name": n, "description": TOOL_SPECS[n][0], "parameters": TOOL_SPECS[n][1],
             "strict": False} for n in names]


def check_arguments(name: str, args: Any) -> None:
    """Arguments of a constrained call: a JSON object whose keys fit the tool's schema."""
    assert isinstance(args, dict), args
    schema = TOOL_SPECS[name][1]
    assert set(schema["required"]) <= set(args), args
    assert set(args) <= set(schema["properties"]), args
    if name == "get_weather":
        assert args["unit"] in ("celsius", "fahrenheit"), args
        assert isinstance(args["city"], str), args
