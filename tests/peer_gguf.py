"""Helpers shared by the tests of the peer's GGUF writer (evals/peer/write_gguf.py) and the engine's
GGUF reader: the writer loaded as a module, a small BPE vocabulary GGUF standing in for
llama.cpp's models/ggml-vocab-qwen2.gguf (token i is "t{i}", the last one the end token), a shape's
options for the writer, and metadata read back."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parents[1]
N_VOCAB = 300  # the stand-in vocabulary's size (the `vocab` fixture of tests/conftest.py)


def write_gguf_module(name: str = "peer_write_gguf") -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, REPO / "evals" / "peer" / "write_gguf.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def write_vocab(path: Path, n_vocab: int) -> Path:
    import gguf

    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list([f"t{i}" for i in range(n_vocab)])
    w.add_token_types([1] * (n_vocab - 1) + [3])
    w.add_token_merges(["t 1", "t 2"])
    w.add_bos_token_id(n_vocab - 1)
    w.add_eos_token_id(n_vocab - 1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def shape_args(shape: dict[str, int]) -> list[str]:
    """write_gguf.py's command-line options for a shape given as {option_name: value}."""
    return [arg for k, v in shape.items() for arg in (f"--{k.replace('_', '-')}", str(v))]


def field(reader: Any, key: str) -> Any:
    """A GGUF metadata value, read back with the gguf package's reader."""
    return reader.fields[key].contents()
