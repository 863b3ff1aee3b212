"""GPT-2 byte-level alphabet shared by the tokenizer builder and the runtime detokeniser.

Contract: ``BYTE_TO_CHAR`` maps each of the 256 byte values to the printable unicode character that
stands for it inside byte-level BPE token strings; ``CHAR_TO_BYTE`` is its inverse.
"""

from __future__ import annotations


def _alphabet() -> dict[int, str]:
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


BYTE_TO_CHAR: dict[int, str] = _alphabet()
CHAR_TO_BYTE: dict[str, int] = {c: b for b, c in BYTE_TO_CHAR.items()}

# str.translate tables between latin-1 text (one char per byte) and the byte-level alphabet.
_TO_TOKEN = dict(BYTE_TO_CHAR)
_TO_LATIN1 = {ord(c): b for b, c in BYTE_TO_CHAR.items()}


def token_to_bytes(token: str) -> bytes:
    """Raw bytes of a byte-level token string (UnicodeEncodeError, a ValueError, for foreign text)."""
    return token.translate(_TO_LATIN1).encode("latin-1")


def bytes_to_token(raw: bytes) -> str:
    """Byte-level token string of raw bytes."""
    return raw.decode("latin-1").translate(_TO_TOKEN)
