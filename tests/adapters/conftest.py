"""Session fixtures for the end-to-end server tests: real `freetoken-agent serve` processes.

Three servers run for the whole session, started together once the demo models exist:
- `q35`: the Qwen3.5-MoE demo (hybrid attention; thinking starts inside `<think>`), short ping
  interval so keep-alives show up in streams;
- `q3`: the Qwen3-MoE demo (full attention: prompt prefixes are reused from the radix cache);
- `locked`: the Qwen3.5 demo with `--api-key` and `--context-window 256` (auth and overflow);
- `endless`: a copy of the Qwen3.5 demo whose `</think>` / EOS rows are ordinary random rows. The
  demo (v2+) closes its reasoning at once and, with thinking off, ends its turn at once; this copy
  reasons (thinking on) or writes text (thinking off) until max_tokens, which the tests of
  reasoning, stop strings, disconnects and joining need.
The demo models are cached in the suite's `demo_cache` (tests/conftest.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from server_fixture import (
    API_KEY,
    MODEL_NAME,
    SMALL_CONTEXT,
    ServerProcess,
    build_demo_models,
    build_endless_model,
    stop_all,
)

from freetoken_agent.tokenizer import ChatTokenizer

# litellm fetches its model price list from the network at import unless told not to.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("LITELLM_TELEMETRY", "False")


@pytest.fixture(scope="session")
def demo_dirs(demo_cache: Path) -> dict[str, Path]:
    """The demo model directories (built here, once, before any server starts)."""
    return build_demo_models(demo_cache)


@pytest.fixture(scope="session")
def servers(demo_cache: Path, demo_dirs: dict[str, Path],
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServerProcess]]:
    log_dir = tmp_path_factory.mktemp("server-logs")
    endless_dir = build_endless_model(demo_dirs["qwen3_5_moe"], demo_cache)
    specs = {
        "q35": (["--model", "demo", "--ping-interval", "0.25"], None),
        "q3": (["--model", "demo:qwen3_moe"], None),
        "locked": (["--model", "demo", "--context-window", str(SMALL_CONTEXT)], API_KEY),
        "endless": (["--model", str(endless_dir), "--served-model-name", MODEL_NAME], None),
    }
    started: dict[str, ServerProcess] = {}
    try:
        for name, (args, key) in specs.items():
            started[name] = ServerProcess.launch(name, args, demo_cache, log_dir, api_key=key)
        for server in started.values():
            server.wait_ready()
        yield started
    finally:
        stop_all(started.values())


@pytest.fixture(scope="session")
def q35(servers: dict[str, ServerProcess]) -> ServerProcess:
    return servers["q35"]


@pytest.fixture(scope="session")
def q3(servers: dict[str, ServerProcess]) -> ServerProcess:
    return servers["q3"]


@pytest.fixture(scope="session")
def locked(servers: dict[str, ServerProcess]) -> ServerProcess:
    return servers["locked"]


@pytest.fixture(scope="session")
def endless(servers: dict[str, ServerProcess]) -> ServerProcess:
    return servers["endless"]


@pytest.fixture(scope="session", params=["q35", "q3"])
def family_server(request: pytest.FixtureRequest, servers: dict[str, ServerProcess]) -> ServerProcess:
    """Each unlocked server in turn: the test runs once per model family."""
    return servers[request.param]


@pytest.fixture(scope="session")
def tokenizers(demo_dirs: dict[str, Path]) -> dict[str, ChatTokenizer]:
    return {"q35": ChatTokenizer.from_dir(demo_dirs["qwen3_5_moe"]),
            "q3": ChatTokenizer.from_dir(demo_dirs["qwen3_moe"])}
