"""Resolve `--model` arguments: a model directory, a Hugging Face id in the local cache, or `demo`.

Contract: `resolve_model(spec)` returns an existing directory that holds `config.json` and the
tokenizer files the server reads, or raises `UsageError` with a one-line message naming the missing
file or what to run:
- `demo` and `demo:ARCH`: the cached demo model, written on first use (with progress);
- an existing path: that directory, or a `.gguf` file (the first part of a split set): its tokenizer
  and chat template come from the file's metadata (freetoken_agent/tokenizer/gguf.py);
- otherwise an id `OWNER/NAME` is looked up in the Hugging Face cache (`$HF_HUB_CACHE`, `$HF_HOME`,
  default `~/.cache/huggingface/hub`) without any network access, at its `main` revision; a
  missing id says `freetoken-agent pull OWNER/NAME`.
`check_model_dir(path)` is the file check alone. `load_tokenizer(path)` reads the directory's chat
tokenizer (a GGUF file's from its metadata), a file it cannot read being one `UsageError` line naming it. Importing this module
imports neither torch nor huggingface_hub.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

from freetoken_agent.demo import ARCHES, demo_model_dir

if TYPE_CHECKING:
    from freetoken_agent.tokenizer import ChatTokenizer

# what the model directory must hold for the engine and the chat tokenizer, besides the weights
REQUIRED_FILES = ("config.json", "tokenizer.json")
HF_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class UsageError(Exception):
    """A command-line argument is wrong; the message is shown as is."""


def check_model_dir(path: Path) -> Path:
    """`path` if it holds a readable `config.json` and a `tokenizer.json`; else `UsageError` naming the file."""
    if not (path / "config.json").exists():
        gguf = sorted(p.name for p in path.glob("*.gguf"))
        hint = f" (it holds {gguf[0]}: pass the GGUF file itself, --model {path / gguf[0]})" if gguf else ""
        raise UsageError(f"{path / 'config.json'}: missing (not a Hugging Face model directory){hint}")
    for name in REQUIRED_FILES[1:]:
        if not (path / name).is_file():
            raise UsageError(f"{path / name}: missing (the model's tokenizer; copy it from the model's "
                             f"original repository)")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        file = path / name
        if not file.exists():
            continue
        try:
            json.loads(file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UsageError(f"{file}: not valid JSON ({e})") from None
    return path


def load_tokenizer(model_dir: Path) -> ChatTokenizer:
    """The chat tokenizer of `model_dir`; a file that cannot be read is one line naming it."""
    from freetoken_agent.tokenizer import ChatTokenizer

    if model_dir.suffix == ".gguf" and model_dir.is_file():
        from freetoken_agent.tokenizer.gguf import chat_tokenizer_from_gguf

        try:
            return chat_tokenizer_from_gguf(model_dir)
        except ValueError as e:
            raise UsageError(str(e)) from None
    try:
        return ChatTokenizer.from_dir(model_dir)
    except OSError as e:
        raise UsageError(f"{e.filename or model_dir}: cannot be read ({e.strerror or e})") from None
    except Exception as e:  # the tokenizers library raises plain Exceptions for a file it cannot parse
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UsageError(f"{model_dir / 'tokenizer.json'}: cannot be read by the tokenizers library ({reason})") from None


def hf_cache_dir() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def resolve_hf_id(repo_id: str, revision: str | None = None) -> Path:
    """The cached snapshot of `repo_id` (no network); `UsageError` saying how to pull it when absent."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, revision=revision, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError):
        pull = f"freetoken-agent pull {repo_id}" + (f" --revision {revision}" if revision else "")
        raise UsageError(f"{repo_id}: not a directory here and not in the Hugging Face cache ({hf_cache_dir()}); "
                         f"download it with `{pull}`") from None


def resolve_model(spec: str) -> Path:
    if spec == "demo" or spec.startswith("demo:"):
        arch = spec.partition(":")[2] or "qwen3_5_moe"
        if arch not in ARCHES:
            raise UsageError(f"unknown demo arch {arch!r} (choose from {', '.join(ARCHES)})")
        return demo_model_dir(arch)
    path = Path(spec).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return path  # the engine and the tokenizer read the file (and a split set's other parts)
    if path.is_dir():
        return check_model_dir(path)
    if path.exists():
        raise UsageError(f"{path}: not a model directory")
    if HF_ID.match(spec) and not spec.startswith((".", "~")):
        return check_model_dir(resolve_hf_id(spec))
    raise UsageError(f"{path}: model directory not found")
