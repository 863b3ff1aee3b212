"""Reading, merging and safely rewriting a client's JSON/JSON5/TOML config file.

Contract:
- `ConfigError` (a `ValueError`): a config file cannot be read, parsed or merged; its one-line
  message names the file.
- `dump(fmt, data)` renders a document (JSON with 2-space indent, or TOML through `tomlkit`);
  `parse(fmt, text, file, notes)` reads one (JSON, falling back to JSON5 through the `json5`
  library, or TOML through `tomlkit`, whose document keeps the user's comments and layout when it
  is written back), appending to `notes` what a rewrite will lose (a JSON5 file's comments), and
  raises `ConfigError` for bad syntax or a non-object top level.
- `merge(into, ours, file)` sets `ours` in `into` in place: objects key by key, lists of
  `{"id": ...}` objects entry by entry, anything else replaced (a value already equal is left as
  it is, so its formatting and comments stay); an existing `models.mode` is kept
  and OpenClaw's string `agents.defaults.model` is widened to `{"primary": ...}`. A non-object (or
  non-list) where ours must go raises `ConfigError`.
- `read_text(path, name)` reads an existing file as UTF-8 (BOM allowed) and returns `(bytes, text)`
  (errors name `name`, e.g. the symlink the user gave);
  `backup_name(file)` picks a free `FILE.bak-YYYYmmdd-HHMMSS[-N]`; `atomic_write(file, data, mode)`
  replaces `file` via a temp file in the same directory with the given permission bits.
- `home()` is `~` (from `$HOME`); `env_dir(name)` is the path in env var `name`, or None if unset.
"""

from __future__ import annotations

import copy
import json
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

ConfigFormat = Literal["json", "json5", "toml"]


class ConfigError(ValueError):
    """A config file cannot be read or merged; the one-line message names the file."""


def home() -> Path:
    return Path(os.path.expanduser("~"))


def env_dir(name: str) -> Path | None:
    value = os.environ.get(name, "")
    return Path(value).expanduser() if value else None


def dump(fmt: ConfigFormat, data: dict[str, Any]) -> str:
    if fmt == "toml":
        import tomlkit

        return tomlkit.dumps(data)
    return json.dumps(data, indent=2, ensure_ascii=False) + "\n"


# Keys whose existing value is the user's choice and is kept when present.
_KEEP_EXISTING = {("models", "mode")}


def _where(keys: tuple[str, ...]) -> str:
    return ".".join(keys) or "the top level"


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            type(None): "null"}.get(type(value), "a number")


def _add(into: dict[str, Any], key: str, value: Any) -> None:
    """`into[key] = value` for a new key; in a TOML table, before the comments and blank lines that end
    it, which belong to the next table (a comment above `[profiles.fast]` stays above it)."""
    table: Any = into
    body = getattr(getattr(table, "value", None), "body", None)
    if type(table).__name__ != "Table" or not isinstance(body, list) or not hasattr(table.value, "_insert_at"):
        into[key] = value
        return
    import tomlkit
    from tomlkit.items import Comment, Whitespace

    at = len(body)
    while at and body[at - 1][0] is None and isinstance(body[at - 1][1], Comment | Whitespace):
        at -= 1
    if at == len(body):
        into[key] = value
    else:
        table.value._insert_at(at, key, tomlkit.item(value))


def merge(into: dict[str, Any], ours: dict[str, Any], file: Path, keys: tuple[str, ...] = ()) -> None:
    """Set `ours` in `into` (in place): objects are merged key by key, lists of `{"id": ...}`
    objects entry by entry (matched on `id`), anything else is replaced."""
    for key, value in ours.items():
        at = (*keys, key)
        if key not in into:
            _add(into, key, copy.deepcopy(value))
        elif at in _KEEP_EXISTING or (not isinstance(value, dict | list) and into[key] == value):
            continue
        elif isinstance(value, dict):
            old = into[key]
            if at == ("agents", "defaults", "model") and isinstance(old, str):
                old = into[key] = {"primary": old}  # OpenClaw's short form of the same setting
            if not isinstance(old, dict):
                raise ConfigError(f"{file}: {_where(at)} is {_kind(old)}, expected an object; "
                                  "fix it by hand, the file is unchanged")
            merge(old, value, file, at)
        elif isinstance(value, list) and value and all(isinstance(v, dict) and "id" in v for v in value):
            old = into[key]
            if not isinstance(old, list):
                raise ConfigError(f"{file}: {_where(at)} is {_kind(old)}, expected a list; "
                                  "fix it by hand, the file is unchanged")
            for item in value:
                match = next((o for o in old if isinstance(o, dict) and o.get("id") == item["id"]), None)
                if match is None:
                    old.append(copy.deepcopy(item))
                else:
                    merge(match, item, file, (*at, str(item["id"])))
        else:
            into[key] = copy.deepcopy(value)


def parse(fmt: ConfigFormat, text: str, file: Path, notes: list[str]) -> dict[str, Any]:
    if fmt == "toml":
        import tomlkit
        from tomlkit.exceptions import ParseError

        try:
            data: Any = tomlkit.parse(text)
        except ParseError as e:
            raise ConfigError(f"{file}: not valid TOML ({e}); the file is unchanged") from None
        return data
    if not text.strip():
        return {}
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        import json5

        try:
            data = json5.loads(text)
        except ValueError as e:  # "<string>:LINE Unexpected ... at column N"
            reason = re.sub(r"^<string>:(\d+) ", r"line \1: ", str(e))
            raise ConfigError(f"{file}: not valid JSON ({reason}); the file is unchanged") from None
        notes.append(f"{file}: comments and JSON5 syntax were rewritten as plain JSON "
                     "(the backup keeps the original)")
    if not isinstance(data, dict):
        raise ConfigError(f"{file}: the top level is {_kind(data)}, expected an object; the file is unchanged")
    return data


def read_text(path: Path, name: Path | None = None) -> tuple[bytes, str]:
    """The bytes of the existing file `path` and their UTF-8 text; `ConfigError` (naming `name`,
    default `path`) if it cannot be read or is not UTF-8."""
    file = path if name is None else name
    try:
        old = path.read_bytes()
        text = old.decode("utf-8-sig")
    except OSError as e:
        raise ConfigError(f"{file}: cannot read it ({e.strerror or e}); the file is unchanged") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{file}: not UTF-8 text; the file is unchanged") from None
    return old, text


def backup_name(file: Path) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    candidate = file.with_name(f"{file.name}.bak-{stamp}")
    n = 1
    while candidate.exists() or candidate.is_symlink():
        candidate = file.with_name(f"{file.name}.bak-{stamp}-{n}")
        n += 1
    return candidate


def atomic_write(file: Path, data: bytes, mode: int) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{file.name}.", suffix=".tmp", dir=file.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, file)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
