"""A small TOML writer for the values `tomllib` produces, no dependencies.

Contract: for any mapping `data` that `tomllib.loads` can return (keys `str`; values `str`, `int`,
`float`, `bool`, `datetime`/`date`/`time`, lists, nested dicts), `tomllib.loads(dumps(data))`
equals `data` (NaN aside, which never compares equal). Key order is kept. Within each table the
plain keys come first, then sub-tables (`[a.b]`) and arrays of tables (`[[a.c]]`), since TOML
assigns every bare key to the header above it. Lists whose items are all tables become arrays of
tables; other lists are inline arrays (tables inside them are inline tables). Comments and the
original layout of a file that was read are not reproduced. Unsupported types raise `TypeError`.
"""

from __future__ import annotations

import datetime as dt
import math
import re
from collections.abc import Mapping
from typing import Any

__all__ = ["dumps"]

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_ESCAPES = {"\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r", '"': '\\"', "\\": "\\\\"}


def _string(text: str) -> str:
    out = []
    for ch in text:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _key(key: str) -> str:
    if not isinstance(key, str):
        raise TypeError(f"TOML keys must be strings, got {type(key).__name__}")
    return key if _BARE_KEY.fullmatch(key) else _string(key)


def _float(value: float) -> str:
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    text = repr(value)
    return text if any(c in text for c in ".eE") else text + ".0"


def _value(value: Any) -> str:
    # bool before int: bool is a subclass of int.
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return _float(value)
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, dt.datetime | dt.date | dt.time):
        return value.isoformat()
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{_key(k)} = {_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write a {type(value).__name__} as TOML")


def _is_table_array(value: Any) -> bool:
    return isinstance(value, list | tuple) and bool(value) and all(isinstance(v, Mapping) for v in value)


def _table(lines: list[str], path: list[str], table: Mapping[str, Any], header: str | None) -> None:
    plain = [(k, v) for k, v in table.items() if not isinstance(v, Mapping) and not _is_table_array(v)]
    nested = [(k, v) for k, v in table.items() if isinstance(v, Mapping) or _is_table_array(v)]
    # A table holding only sub-tables needs no header of its own (the sub-headers define it),
    # unless it is an array-of-tables item, whose `[[...]]` header creates the item.
    if header is not None and (plain or not nested or header.startswith("[[")):
        if lines:
            lines.append("")
        lines.append(header)
    for key, value in plain:
        lines.append(f"{_key(key)} = {_value(value)}")
    for key, value in nested:
        sub = [*path, _key(key)]
        if isinstance(value, Mapping):
            _table(lines, sub, value, "[" + ".".join(sub) + "]")
        else:
            for item in value:
                _table(lines, sub, item, "[[" + ".".join(sub) + "]]")


def dumps(data: Mapping[str, Any]) -> str:
    """Return `data` as TOML text ending in a newline ("" for an empty mapping)."""
    lines: list[str] = []
    _table(lines, [], data, None)
    return "\n".join(lines) + "\n" if lines else ""
