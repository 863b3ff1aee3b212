"""o200k_harmony built offline from `bpe-openai`'s ranks encodes and decodes like openai-harmony's
own tokenizer (Rust tiktoken) and like bpe-openai's encoder, special tokens included."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from harmony_reference import harmony_encoding
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from freetoken_agent.tokenizer import ChatTokenizer, write_tokenizer
from freetoken_agent.tokenizer.build import load_ranks

TEXTS = [
    "hello world", "Hello, World!\n\n  indented\tTabs\r\n", "don't WE'LL you'd", "12345678 3.14159 1e-9",
    "ünïcödé — “quotes” ✓ 中文字符 日本語 한국어 emoji 🎉👍🏽", "def f(x):\n    return x**2  # sq\n",
    '{"location":"Paris, FR","unit":"celsius"}', "    \n\n\n   trailing   ", "a" * 300, "",
    "<|start|>assistant<|channel|>final<|message|>Hi!<|end|>", "x<|call|>y<|return|>z<|constrain|>json",
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> ChatTokenizer:
    out: Path = tmp_path_factory.mktemp("o200k")
    info = write_tokenizer(out, "gpt_oss")
    assert (info.vocab_size, info.eos_token_id, info.pad_token_id) == (201_088, 200_002, 199_999)
    return ChatTokenizer.from_dir(out)


def test_ranks_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    from freetoken_agent.tokenizer import build

    spec = build.FAMILIES["gpt_oss"]
    monkeypatch.setitem(build.FAMILIES, "gpt_oss", dataclasses.replace(spec, sha256="0" * 64))
    with pytest.raises(ValueError, match="SHA-256"):
        load_ranks("gpt_oss")


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_openai_harmony(tok: ChatTokenizer, text: str) -> None:
    enc = harmony_encoding()
    want = enc.encode(text, allowed_special="all")
    assert tok.encode(text) == want
    assert tok.decode(want) == enc.decode(want) == text


def test_special_tokens_match(tok: ChatTokenizer) -> None:
    enc = harmony_encoding()
    for name in ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>",
                 "<|endoftext|>", "<|startoftext|>", "<|reserved_200013|>", "<|reserved_201087|>"):
        assert [tok.token_to_id(name)] == enc.encode(name, allowed_special="all"), name
    assert set(enc.stop_tokens_for_assistant_actions()) == {tok.token_to_id("<|return|>"), tok.token_to_id("<|call|>")}


@pytest.fixture(scope="module")
def bpe_ref() -> object:
    import bpe_openai

    return bpe_openai.get_encoding("o200k_base")


@settings(max_examples=80, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=60))
def test_ordinary_text_matches_bpe_openai(tok: ChatTokenizer, bpe_ref: object, text: str) -> None:
    assume("<|" not in text)  # special tokens are recognised in text here, not by encode_ordinary
    assert tok.encode(text) == bpe_ref.encode_ordinary(text)  # type: ignore[attr-defined]
