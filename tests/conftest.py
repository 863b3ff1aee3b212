"""Suite-wide test setup: GPU tests are skipped on machines without CUDA. The demo checkpoints
(freetoken_agent/demo.py) are cached in `demo_cache`: `$FREETOKEN_CACHE_DIR` when set, else a
per-user temp directory kept between runs (the models are deterministic and versioned, written
atomically). `demo_model(arch)` is that cache's demo model of an arch, the very directory
`--model demo[:ARCH]` serves from there: tests read it and never write into it (one that edits a
model copies it first). The peer GGUF writer's tests share `wg` (evals/peer/write_gguf.py loaded as a
module; a test that changes one of its settings does so through monkeypatch) and `vocab` (the small
stand-in vocabulary GGUF of tests/peer_gguf.py, N_VOCAB tokens)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

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


@pytest.fixture(scope="session")
def wg() -> ModuleType:
    from peer_gguf import write_gguf_module

    return write_gguf_module()


@pytest.fixture(scope="session")
def vocab(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from peer_gguf import N_VOCAB, write_vocab

    return write_vocab(tmp_path_factory.mktemp("vocab") / "vocab.gguf", N_VOCAB)
