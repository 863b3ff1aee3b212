"""A small JSON5 reader (a superset of JSON and of JSONC), no dependencies.

Contract: `loads(text)` returns the value as Python objects (`dict`, `list`, `str`, `int`,
`float`, `bool`, `None`), exactly as `json.loads` would for plain JSON text, or raises
`Json5Error` (a `ValueError`) whose message names the line and column of the first problem.
Accepted beyond JSON, per https://spec.json5.org: `//` and `/* */` comments, trailing commas,
unquoted identifier keys, single-quoted strings, the JSON5 string escapes (`\\x`, `\\v`, `\\0`,
`\\'`, line continuations), hexadecimal numbers, leading or trailing decimal points, a leading
`+`, `Infinity` and `NaN`. Duplicate keys: the last one wins (as in `JSON.parse`).
It is a reader only: writing back produces plain JSON, so comments are not preserved.
"""

from __future__ import annotations

import unicodedata
from typing import Any

__all__ = ["Json5Error", "loads"]


class Json5Error(ValueError):
    """The text is not valid JSON5; the message says where."""


_LINE_TERMINATORS = "\n\r\u2028\u2029"
_EXTRA_SPACE = "\t\v\f \u00a0\ufeff"
_SIMPLE_ESCAPES = {"b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v",
                   "'": "'", '"': '"', "\\": "\\", "/": "/"}
_KEYWORDS: dict[str, Any] = {"true": True, "false": False, "null": None,
                             "Infinity": float("inf"), "NaN": float("nan")}


def _is_space(ch: str) -> bool:
    return ch in _EXTRA_SPACE or ch in _LINE_TERMINATORS or unicodedata.category(ch) == "Zs"


def _is_id_start(ch: str) -> bool:
    return ch in "$_" or unicodedata.category(ch) in ("Lu", "Ll", "Lt", "Lm", "Lo", "Nl")


def _is_id_part(ch: str) -> bool:
    return (_is_id_start(ch) or ch in "\u200c\u200d"
            or unicodedata.category(ch) in ("Mn", "Mc", "Nd", "Pc"))


class _Reader:
    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    # -- positions and errors -------------------------------------------------------------

    def error(self, message: str, pos: int | None = None) -> Json5Error:
        pos = self.pos if pos is None else pos
        line = self.text.count("\n", 0, pos) + 1
        col = pos - (self.text.rfind("\n", 0, pos) + 1) + 1
        return Json5Error(f"{message} at line {line} column {col}")

    def peek(self) -> str:
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def skip_space(self) -> None:
        text, n = self.text, len(self.text)
        while self.pos < n:
            ch = text[self.pos]
            if _is_space(ch):
                self.pos += 1
            elif text.startswith("//", self.pos):
                while self.pos < n and text[self.pos] not in _LINE_TERMINATORS:
                    self.pos += 1
            elif text.startswith("/*", self.pos):
                end = text.find("*/", self.pos + 2)
                if end < 0:
                    raise self.error("unterminated /* comment")
                self.pos = end + 2
            else:
                return

    # -- values ----------------------------------------------------------------------------

    def value(self, depth: int = 0) -> Any:
        if depth > 500:
            raise self.error("nesting too deep")
        self.skip_space()
        ch = self.peek()
        if not ch:
            raise self.error("unexpected end of text")
        if ch == "{":
            return self.obj(depth)
        if ch == "[":
            return self.array(depth)
        if ch in "\"'":
            return self.string()
        if ch in "+-.0123456789IN":
            return self.number()
        if _is_id_start(ch):
            start = self.pos
            word = self.identifier()
            if word in ("true", "false", "null"):
                return _KEYWORDS[word]
            raise self.error(f"unexpected word {word!r}", start)
        raise self.error(f"unexpected character {ch!r}")

    def obj(self, depth: int) -> dict[str, Any]:
        self.pos += 1  # "{"
        out: dict[str, Any] = {}
        while True:
            self.skip_space()
            if self.peek() == "}":
                self.pos += 1
                return out
            ch = self.peek()
            if ch and ch in "\"'":
                key = self.string()
            elif ch and (_is_id_start(ch) or ch == "\\"):
                key = self.identifier()
            else:
                raise self.error("expected a key or '}'" if ch else "unterminated object")
            self.skip_space()
            if self.peek() != ":":
                raise self.error("expected ':' after a key")
            self.pos += 1
            out[key] = self.value(depth + 1)
            self.skip_space()
            ch = self.peek()
            if ch == ",":
                self.pos += 1
            elif ch == "}":
                self.pos += 1
                return out
            else:
                raise self.error("expected ',' or '}'" if ch else "unterminated object")

    def array(self, depth: int) -> list[Any]:
        self.pos += 1  # "["
        out: list[Any] = []
        while True:
            self.skip_space()
            if self.peek() == "]":
                self.pos += 1
                return out
            if not self.peek():
                raise self.error("unterminated array")
            out.append(self.value(depth + 1))
            self.skip_space()
            ch = self.peek()
            if ch == ",":
                self.pos += 1
            elif ch == "]":
                self.pos += 1
                return out
            else:
                raise self.error("expected ',' or ']'" if ch else "unterminated array")

    def identifier(self) -> str:
        chars: list[str] = []
        first = True
        while True:
            ch = self.peek()
            if ch == "\\":
                start = self.pos
                if not self.text.startswith("\\u", self.pos):
                    raise self.error("only \\u escapes are allowed in a key")
                self.pos += 2
                ch = chr(self.hex_digits(4))
                if not (_is_id_start(ch) if first else _is_id_part(ch)):
                    raise self.error("escaped character not allowed in a key", start)
            elif ch and (_is_id_start(ch) if first else _is_id_part(ch)):
                self.pos += 1
            else:
                return "".join(chars)
            chars.append(ch)
            first = False

    def hex_digits(self, count: int) -> int:
        digits = self.text[self.pos:self.pos + count]
        if len(digits) != count or any(c not in "0123456789abcdefABCDEF" for c in digits):
            raise self.error(f"expected {count} hexadecimal digits")
        self.pos += count
        return int(digits, 16)

    def string(self) -> str:
        quote = self.text[self.pos]
        start = self.pos
        self.pos += 1
        chars: list[str] = []
        text = self.text
        while True:
            if self.pos >= len(text):
                raise self.error("unterminated string", start)
            ch = text[self.pos]
            if ch == quote:
                self.pos += 1
                return "".join(chars)
            if ch in "\n\r":
                raise self.error("line break inside a string")
            if ch != "\\":
                chars.append(ch)
                self.pos += 1
                continue
            self.pos += 1
            esc = self.peek()
            if not esc:
                raise self.error("unterminated string", start)
            self.pos += 1
            if esc in _SIMPLE_ESCAPES:
                chars.append(_SIMPLE_ESCAPES[esc])
            elif esc == "0":
                if self.peek().isdigit():
                    raise self.error("octal escapes are not allowed")
                chars.append("\0")
            elif esc in "123456789":
                raise self.error("octal escapes are not allowed", self.pos - 2)
            elif esc == "x":
                chars.append(chr(self.hex_digits(2)))
            elif esc == "u":
                code = self.hex_digits(4)
                if 0xD800 <= code < 0xDC00 and text.startswith("\\u", self.pos):
                    save = self.pos
                    self.pos += 2
                    low = self.hex_digits(4)
                    if 0xDC00 <= low < 0xE000:
                        code = 0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)
                    else:
                        self.pos = save
                chars.append(chr(code))
            elif esc == "\r":
                if self.peek() == "\n":
                    self.pos += 1
            elif esc in "\n\u2028\u2029":
                pass  # line continuation
            else:
                chars.append(esc)  # JSON5: any other character escapes to itself

    def number(self) -> int | float:
        text, start = self.text, self.pos
        sign = 1
        if self.peek() in ("+", "-"):
            sign = -1 if self.peek() == "-" else 1
            self.pos += 1
        for word in ("Infinity", "NaN"):
            if text.startswith(word, self.pos):
                self.pos += len(word)
                if self.peek() and _is_id_part(self.peek()):
                    raise self.error("invalid number", start)
                return sign * _KEYWORDS[word]
        if text.startswith(("0x", "0X"), self.pos):
            self.pos += 2
            begin = self.pos
            while self.peek() and self.peek() in "0123456789abcdefABCDEF":
                self.pos += 1
            if self.pos == begin:
                raise self.error("invalid hexadecimal number", start)
            value = sign * int(text[begin:self.pos], 16)
            if self.peek() and _is_id_part(self.peek()):
                raise self.error("invalid number", start)
            return value
        begin = self.pos
        int_digits = self.digits()
        if len(int_digits) > 1 and int_digits[0] == "0":
            raise self.error("leading zeros are not allowed", start)
        frac = exp = ""
        if self.peek() == ".":
            self.pos += 1
            frac = "." + self.digits()
        if not int_digits and len(frac) < 2:
            raise self.error("invalid number", start)
        if self.peek() in ("e", "E"):
            self.pos += 1
            exp = "e"
            if self.peek() in ("+", "-"):
                exp += self.peek()
                self.pos += 1
            exp_digits = self.digits()
            if not exp_digits:
                raise self.error("invalid exponent", start)
            exp += exp_digits
        if self.peek() and _is_id_part(self.peek()):
            raise self.error("invalid number", start)
        literal = text[begin:self.pos]
        if not frac and not exp:
            return sign * int(literal)
        return sign * float(literal)

    def digits(self) -> str:
        begin = self.pos
        while self.peek() and self.peek() in "0123456789":
            self.pos += 1
        return self.text[begin:self.pos]


def loads(text: str) -> Any:
    """Parse JSON5 `text`; raise `Json5Error` naming line and column on the first problem."""
    reader = _Reader(text)
    value = reader.value()
    reader.skip_space()
    if reader.pos != len(text):
        raise reader.error("unexpected text after the value")
    return value
