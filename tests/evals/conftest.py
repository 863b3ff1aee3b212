"""One real `freetoken-agent serve` of the demo model on loopback for the eval tests (module-shared:
each test file salts its own sessions, so they never meet). Every server the eval tests start
finds the demo models in the suite's `demo_cache` (tests/conftest.py), written once for all."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


@pytest.fixture(scope="session", autouse=True)
def _shared_demo_cache(demo_cache: Path) -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FREETOKEN_CACHE_DIR", str(demo_cache))
        yield


@pytest.fixture(scope="session")
def demo_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from evals.clients.server import serve_with

    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with serve_with(["--model", "demo", "--kv-tokens", "32768"], log, startup_timeout=600) as url:
        yield url


@pytest.fixture(scope="session")
def clients_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The demo served with the 131072-token window `configure claude-code` requires (`clients` tests)."""
    from evals.clients.server import serve_with

    log = tmp_path_factory.mktemp("serve-clients") / "serve.log"
    with serve_with(["--model", "demo", "--kv-tokens", "131072"], log, startup_timeout=600) as url:
        yield url


@pytest.fixture(scope="session")
def oss_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The gpt-oss demo (harmony format, o200k_harmony) with the same window (`clients` tests)."""
    from evals.clients.server import serve_with

    log = tmp_path_factory.mktemp("serve-oss") / "serve.log"
    with serve_with(["--model", "demo:gpt_oss", "--kv-tokens", "131072"], log, startup_timeout=600) as url:
        yield url
