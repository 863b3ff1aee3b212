"""Resolve `--model` arguments: a path to a Hugging Face directory, or `demo` for the built-in model.

Contract: `resolve_model(spec)` returns an existing directory or raises `UsageError` with a
one-line message. `demo` and `demo:ARCH` create the cached demo copy on first use.
"""

from __future__ import annotations

from pathlib import Path

from freetoken_agent.demo import ARCHES, demo_model_dir


class UsageError(Exception):
    """A command-line argument is wrong; the message is shown as is."""


def resolve_model(spec: str) -> Path:
    if spec == "demo" or spec.startswith("demo:"):
        arch = spec.partition(":")[2] or "qwen3_5_moe"
        if arch not in ARCHES:
            raise UsageError(f"unknown demo arch {arch!r} (choose from {', '.join(ARCHES)})")
        return demo_model_dir(arch)
    path = Path(spec).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        raise UsageError(f"{path}: serving needs a Hugging Face model directory (its tokenizer and chat "
                         f"template); GGUF files are read by `freetoken-agent bench --model` only")
    if not path.is_dir():
        raise UsageError(f"{path}: model directory not found")
    if not (path / "config.json").exists():
        raise UsageError(f"{path}: no config.json (not a Hugging Face model directory)")
    return path
