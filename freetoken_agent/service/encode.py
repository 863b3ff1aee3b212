"""Prompt encoding: the chat template's own structure makes control tokens, message text never does.

Contract: `PromptEncoder(tokenizer)`:
- `escape(text)` replaces, in text a client wrote (system, user and tool content, tool schemas),
  every added-token string of the vocabulary (`<|im_start|>`, `<|im_end|>`, `<think>`,
  `<tool_call>`, ...) and the marker character itself by a two-character placeholder (a
  private-use marker, then the literal's index) before the template renders it;
- `encode(rendered)` tokenises the rendered prompt: the text between placeholders as usual (added
  tokens recognised: they are the template's), each placeholder as its literal spelled in ordinary
  tokens (the vocabulary without its added tokens). A literal thus costs the ids the same text
  gets from a tokenizer that knows no added tokens, cut at the same places a control token cuts.
  Text without any added-token string encodes exactly as `ChatTokenizer.encode`.
- Long text is tokenised in pieces of about `PIECE_CHARS`, cut only where the family's split
  pattern cuts anyway (after a newline before a non-space ASCII character, or before a space
  between an ASCII letter or digit and an ASCII letter), so the ids equal one whole encode; between
  pieces the worker thread lets the event loop run. Text with no such cut in `4 * PIECE_CHARS`
  characters is cut there (its ids may then differ from a whole encode at that point).
"""

from __future__ import annotations

import re
from typing import Any

from tokenizers import Tokenizer

from freetoken_agent.tokenizer import ChatTokenizer

MARK = "\U000f0000"  # private use: the placeholder marker
BASE = 0xF0100  # literal k is MARK + chr(BASE + k)
PIECE_CHARS = 32768
_CUT = re.compile(r"(?<=\n)(?=[!-~])|(?<=[A-Za-z0-9])(?= [A-Za-z])")


class PromptEncoder:
    def __init__(self, tokenizer: ChatTokenizer, piece_chars: int = PIECE_CHARS) -> None:
        self.tokenizer, self.piece_chars = tokenizer, piece_chars
        self.literals = [MARK, *sorted(tokenizer.special_ids, key=len, reverse=True)]
        self._index = {s: i for i, s in enumerate(self.literals)}
        self._find = re.compile("|".join(re.escape(s) for s in self.literals))
        self._firsts = frozenset(s[0] for s in self.literals)
        self._plain = [plain_ids(tokenizer.tokenizer, s) for s in self.literals]
        self._placeholder = re.compile(re.escape(MARK) + f"[{chr(BASE)}-{chr(BASE + len(self.literals) - 1)}]")

    def escape(self, text: str) -> str:
        if not any(c in text for c in self._firsts):
            return text
        return self._find.sub(lambda m: MARK + chr(BASE + self._index[m.group()]), text)

    def escape_tree(self, value: Any) -> Any:
        """`escape` on every string (keys too) of a JSON-like value; other values as they are."""
        if isinstance(value, str):
            return self.escape(value)
        if isinstance(value, dict):
            return {self.escape(k) if isinstance(k, str) else k: self.escape_tree(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.escape_tree(v) for v in value]
        return value

    def unescape(self, text: str) -> str:
        return self._placeholder.sub(lambda m: self.literals[ord(m.group()[1]) - BASE], text)

    def encode(self, rendered: str) -> list[int]:
        ids: list[int] = []
        pos = 0
        for m in self._placeholder.finditer(rendered):
            ids += self.encode_long(rendered[pos:m.start()])
            ids += self._plain[ord(m.group()[1]) - BASE]
            pos = m.end()
        return ids + self.encode_long(rendered[pos:])

    def encode_long(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in pieces(text, self.piece_chars):
            ids += self.tokenizer.encode(piece)
        return ids


def plain_ids(tok: Tokenizer, text: str) -> list[int]:
    """Ids of `text` by the vocabulary alone: normaliser, pre-tokeniser and model, no added tokens."""
    if tok.normalizer is not None:
        text = tok.normalizer.normalize_str(text)
    pre = tok.pre_tokenizer.pre_tokenize_str(text) if tok.pre_tokenizer is not None else [(text, (0, len(text)))]
    return [t.id for piece, _ in pre for t in tok.model.tokenize(piece)]


def pieces(text: str, size: int = PIECE_CHARS) -> list[str]:
    """`text` cut into pieces of at least `size` characters (the last may be shorter) at safe cuts."""
    out: list[str] = []
    start = 0
    while len(text) - start > size:
        m = _CUT.search(text, start + size, start + 4 * size)
        if m is None and len(text) - start <= 4 * size:
            break
        end = m.start() if m is not None else start + 4 * size
        if m is None:  # a hard cut, but never inside an added token written in the text
            near = text.rfind("<", end - 64, end)
            end = near if near > start else end
        out.append(text[start:end])
        start = end
    out.append(text[start:])
    return out
