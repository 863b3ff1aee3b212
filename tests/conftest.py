"""Suite-wide test setup: GPU tests are skipped on machines without CUDA. The demo checkpoints
(freetoken_agent/demo.py) are cached in `demo_cache`: `$FREETOKEN_CACHE_DIR` when set, else a
per-user temp directory kept between runs (the models are deterministic and versioned, written
atomically). `demo_model(arch)` is that cache's demo model of an arch, the very directory
`--model demo[:ARCH]` serves from there: tests read it and never write into it (one that edits a
model copies it first)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def demo_cache() -> Path:
    path = Path(os.environ.get("FREETOKEN_CACHE_DIR") or Path(tempfile.gettempdir()) /
                f"freetoken-test-cache-{os.getuid()}")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def demo_model(demo_cache: Path) -> Callable[[str], Path]:
    from freetoken_agent.demo import demo_model_dir

    def get(arch: str) -> Path:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("FREETOKEN_CACHE_DIR", str(demo_cache))
            return demo_model_dir(arch, progress=lambda *_: None)

    return get
