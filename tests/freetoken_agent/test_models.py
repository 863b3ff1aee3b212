"""`--model` resolution's file checks (freetoken_agent/models.py): every file the server needs and
cannot read is one `UsageError` line naming that file. In-process, on directories made here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from freetoken_agent.models import UsageError, check_model_dir, load_tokenizer, resolve_model


def _dir(tmp_path: Path, **files: str) -> Path:
    d = tmp_path / "m"
    d.mkdir()
    for name, text in files.items():
        (d / name.replace("__", ".")).write_text(text)
    return d


@pytest.mark.parametrize(("files", "culprit", "words"), [
    ({"tokenizer__json": "{}"}, "config.json", "missing"),
    ({"config__json": "{}"}, "tokenizer.json", "missing"),
    ({"config__json": "{oops", "tokenizer__json": "{}"}, "config.json", "not valid JSON"),
    ({"config__json": "{}", "tokenizer__json": "[1,"}, "tokenizer.json", "not valid JSON"),
    ({"config__json": "{}", "tokenizer__json": "{}", "tokenizer_config__json": "{,}"}, "tokenizer_config.json",
     "not valid JSON"),
    ({"model-Q4_K_M__gguf": "x"}, "config.json", "pass the GGUF file itself"),
])
def test_an_unreadable_model_file_is_named(tmp_path: Path, files: dict[str, str], culprit: str, words: str) -> None:
    d = _dir(tmp_path, **files)
    with pytest.raises(UsageError) as info:
        resolve_model(str(d))
    message = str(info.value)
    assert str(d / culprit) in message and words in message and "\n" not in message


def test_a_tokenizer_json_the_library_cannot_read_is_named(tmp_path: Path) -> None:
    d = _dir(tmp_path, config__json="{}", tokenizer__json=json.dumps({"model": {"type": "nothing"}}))
    assert check_model_dir(d) == d
    with pytest.raises(UsageError, match=r"tokenizer\.json: cannot be read by the tokenizers library"):
        load_tokenizer(d)


def test_a_bad_gguf_file_and_a_plain_file_are_refused(tmp_path: Path) -> None:
    (tmp_path / "x.gguf").write_text("x")
    (tmp_path / "notes.txt").write_text("x")
    assert resolve_model(str(tmp_path / "x.gguf")) == tmp_path / "x.gguf"  # a GGUF file is a model
    with pytest.raises(UsageError, match=r"x\.gguf: not a readable GGUF file"):
        load_tokenizer(tmp_path / "x.gguf")
    with pytest.raises(UsageError, match="not a model directory"):
        resolve_model(str(tmp_path / "notes.txt"))
    with pytest.raises(UsageError, match="unknown demo arch"):
        resolve_model("demo:llama")
