"""Fixtures of the engine tests: tiny checkpoints built once per session, engines closed after use."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from checkpoints import TinySpec, build

from engine.engine import Engine
from engine.options import EngineOptions


@pytest.fixture(scope="session", autouse=True)
def _quiet_transformers() -> Iterator[None]:
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover
        pass
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[TinySpec], tuple[Path, torch.nn.Module]]:
    """`tiny_checkpoint(spec)` -> (checkpoint directory, HF model), built on first use only.
    Tests must not modify the directory (copy it first)."""
    built: dict[str, tuple[Path, torch.nn.Module]] = {}

    def get(spec: TinySpec) -> tuple[Path, torch.nn.Module]:
        if spec.name not in built:
            built[spec.name] = build(spec, tmp_path_factory.mktemp(spec.name) / "ckpt")
        return built[spec.name]

    return get


@pytest.fixture
def make_engine() -> Iterator[Callable[..., Engine]]:
    """`make_engine(model_dir, **options)` -> Engine (options by flat name, engine/options.py),
    closed at the end of the test."""
    engines: list[Engine] = []

    def make(model_dir: Path, **opts: object) -> Engine:
        engine = Engine(model_dir, EngineOptions.of(**opts))
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()

