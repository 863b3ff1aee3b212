"""`freetoken-agent configure CLIENT`: point a coding agent at this server.

Contract:
- `render_config(client, target)` returns `(default config path, format, text)`. The text is
  what `configure` prints: a `#` line naming the file, then the configuration this server needs
  (for `claude-code` also the equivalent `export` lines, for `codex` the `export` of the API key
  it reads from the environment). It does not read any file.
- `write_config(client, target, path=None)` merges that configuration into the client's real
  config file (`path`, or the default below) and returns `(written file, backup or None)`. An
  existing file is first copied byte for byte to `FILE.bak-YYYYmmdd-HHMMSS` (`-N` added if that
  name is taken), then replaced atomically, keeping its permission bits; a new file is created
  with mode 0600 (it holds an API key). Only our keys are set: every other setting of the user
  stays, and writing the same target twice changes nothing the second time (no backup either,
  and no duplicate provider or model entries): objects are merged key by key, OpenClaw's model
  list entry by entry on `id`, an existing OpenClaw `models.mode` is kept. Comments of the old file are not carried over:
  the backup keeps them. A file that cannot be read or parsed, or that has a non-object where
  ours must go, raises `ConfigError` (a `ValueError`) with a one-line message naming the file,
  and the file is left untouched.
- `add_configure_parser(subparsers)` registers the `configure` sub-command (with
  `func=run_configure`); `run_configure(args)` prints or writes and returns the exit status:
  0, or 2 after printing one `error: ...` line on stderr.

Clients, their files and what is written (see README "Configure a coding agent"):
- `claude-code`: `$CLAUDE_CONFIG_DIR/settings.json` or `~/.claude/settings.json`, an `env` block
  (Anthropic Messages API at the server root, no `/v1`).
- `opencode`: `$XDG_CONFIG_HOME/opencode/opencode.json` or `~/.config/opencode/opencode.json`
  (an existing `opencode.jsonc` there is used instead when there is no `opencode.json`),
  provider `freetoken` through `@ai-sdk/openai-compatible` (Chat Completions at `/v1`).
- `openclaw`: `$OPENCLAW_CONFIG_PATH` or `~/.openclaw/openclaw.json` (JSON5 is read; plain JSON
  is written), provider `freetoken` with `api: "openai-completions"`.
- `codex`: `$CODEX_HOME/config.toml` or `~/.codex/config.toml`, provider `freetoken` with
  `wire_api = "responses"`; the key is read from `$FREETOKEN_API_KEY`.
`~` is `$HOME`.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from freetoken_agent.argtypes import positive_int
from freetoken_agent.clients import json5, toml_writer

__all__ = [
    "CLIENTS",
    "ClientTarget",
    "ConfigError",
    "add_configure_parser",
    "default_config_path",
    "render_config",
    "run_configure",
    "write_config",
]

CLIENTS: tuple[str, ...] = ("claude-code", "opencode", "openclaw", "codex")
ConfigFormat = Literal["json", "json5", "toml"]

PROVIDER_ID = "freetoken"
PROVIDER_NAME = "FreeToken (local)"
PLACEHOLDER_API_KEY = "freetoken"  # sent when no key is configured; the local server ignores it
CODEX_API_KEY_ENV = "FREETOKEN_API_KEY"
REQUEST_TIMEOUT_MS = 3_000_000  # 50 min for a whole request: long prefills of large contexts
CHUNK_TIMEOUT_MS = 600_000  # 10 min between streamed chunks

_DEFAULTS = {"context_window": 32768, "max_output_tokens": 8192}


class ConfigError(ValueError):
    """A config file cannot be read or merged; the one-line message names the file."""


@dataclass(frozen=True)
class ClientTarget:
    """The server a client is pointed at.

    `base_url` is the server root: a trailing `/` or `/v1` is removed (Claude Code wants the
    root, the OpenAI-style clients get `base_url + "/v1"`). `api_key=None` means the placeholder
    `"freetoken"` is sent. `max_output_tokens` must be smaller than `context_window`.
    """

    base_url: str = "http://127.0.0.1:8000"
    model: str = "freetoken-demo"
    api_key: str | None = None
    context_window: int = _DEFAULTS["context_window"]
    max_output_tokens: int = _DEFAULTS["max_output_tokens"]

    def __post_init__(self) -> None:
        url = self.base_url.strip().rstrip("/")
        url = url.removesuffix("/v1").rstrip("/")
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc or parts.query or parts.fragment:
            raise ValueError(f"base URL must look like http://HOST:PORT, got {self.base_url!r}")
        object.__setattr__(self, "base_url", url)
        if not self.model or any(c.isspace() for c in self.model):
            raise ValueError(f"model name must be non-empty without spaces, got {self.model!r}")
        if self.api_key is not None and (not self.api_key or any(c.isspace() for c in self.api_key)):
            raise ValueError("API key must be non-empty without spaces")
        for name in ("context_window", "max_output_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_output_tokens >= self.context_window:
            raise ValueError(f"max output tokens ({self.max_output_tokens}) must be smaller than "
                             f"the context window ({self.context_window})")

    @property
    def openai_base_url(self) -> str:
        return self.base_url + "/v1"

    @property
    def key(self) -> str:
        return self.api_key or PLACEHOLDER_API_KEY


# -- where each client reads its configuration --------------------------------------------------


def _home() -> Path:
    return Path(os.path.expanduser("~"))


def _env_dir(name: str) -> Path | None:
    value = os.environ.get(name, "")
    return Path(value).expanduser() if value else None


def default_config_path(client: str) -> Path:
    """The file `client` reads its user configuration from, honouring `$HOME` and its own env vars."""
    _check_client(client)
    if client == "claude-code":
        return (_env_dir("CLAUDE_CONFIG_DIR") or _home() / ".claude") / "settings.json"
    if client == "opencode":
        xdg = _env_dir("XDG_CONFIG_HOME")
        base = (xdg if xdg is not None and xdg.is_absolute() else _home() / ".config") / "opencode"
        if not (base / "opencode.json").exists() and (base / "opencode.jsonc").is_file():
            return base / "opencode.jsonc"
        return base / "opencode.json"
    if client == "openclaw":
        return _env_dir("OPENCLAW_CONFIG_PATH") or _home() / ".openclaw" / "openclaw.json"
    return (_env_dir("CODEX_HOME") or _home() / ".codex") / "config.toml"


def _check_client(client: str) -> None:
    if client not in CLIENTS:
        raise ValueError(f"unknown client {client!r} (choose from {', '.join(CLIENTS)})")


# -- what each client needs -----------------------------------------------------------------------


def _claude_env(t: ClientTarget) -> dict[str, str]:
    return {
        "ANTHROPIC_BASE_URL": t.base_url,
        "ANTHROPIC_AUTH_TOKEN": t.key,
        "ANTHROPIC_MODEL": t.model,
        "ANTHROPIC_SMALL_FAST_MODEL": t.model,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": t.model,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": t.model,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": t.model,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
        "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
        "API_TIMEOUT_MS": str(REQUEST_TIMEOUT_MS),
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(t.max_output_tokens),
        "CLAUDE_CODE_AUTO_COMPACT_WINDOW": str(t.context_window),
    }


def _fragment(client: str, t: ClientTarget) -> dict[str, Any]:
    """The part of the client's config file that this server owns."""
    if client == "claude-code":
        return {"env": _claude_env(t)}
    if client == "opencode":
        return {
            "provider": {PROVIDER_ID: {
                "npm": "@ai-sdk/openai-compatible",
                "name": PROVIDER_NAME,
                "options": {"baseURL": t.openai_base_url, "apiKey": t.key,
                            "timeout": REQUEST_TIMEOUT_MS, "chunkTimeout": CHUNK_TIMEOUT_MS},
                "models": {t.model: {
                    "name": t.model,
                    "limit": {"context": t.context_window, "output": t.max_output_tokens},
                    "reasoning": True,
                    "tool_call": True,
                    "interleaved": {"field": "reasoning_content"},
                }},
            }},
            "model": f"{PROVIDER_ID}/{t.model}",
            "small_model": f"{PROVIDER_ID}/{t.model}",
        }
    if client == "openclaw":
        return {
            "models": {"mode": "merge", "providers": {PROVIDER_ID: {
                "baseUrl": t.openai_base_url,
                "apiKey": t.key,
                "api": "openai-completions",
                "models": [{"id": t.model, "name": t.model, "reasoning": True, "input": ["text"],
                            "contextWindow": t.context_window, "maxTokens": t.max_output_tokens}],
            }}},
            "agents": {"defaults": {"model": {"primary": f"{PROVIDER_ID}/{t.model}"}}},
        }
    return {
        "model": t.model,
        "model_provider": PROVIDER_ID,
        "model_context_window": t.context_window,
        "model_providers": {PROVIDER_ID: {
            "name": PROVIDER_NAME,
            "base_url": t.openai_base_url,
            "env_key": CODEX_API_KEY_ENV,
            "wire_api": "responses",
        }},
    }


_FORMATS: dict[str, ConfigFormat] = {"claude-code": "json", "opencode": "json", "openclaw": "json5", "codex": "toml"}


def _format(client: str) -> ConfigFormat:
    return _FORMATS[client]


def _dump(fmt: ConfigFormat, data: dict[str, Any]) -> str:
    if fmt == "toml":
        return toml_writer.dumps(data)
    return json.dumps(data, indent=2, ensure_ascii=False) + "\n"


def _exports(client: str, t: ClientTarget) -> list[str]:
    if client == "claude-code":
        return [f"export {k}={shlex.quote(v)}" for k, v in _claude_env(t).items()]
    if client == "codex":
        return [f"export {CODEX_API_KEY_ENV}={shlex.quote(t.key)}"]
    return []


_HEADERS = {
    "claude-code": "# Claude Code: merge this into {path} (or run again with --write)",
    "opencode": "# OpenCode: merge this into {path} (or run again with --write)",
    "openclaw": "# OpenClaw: merge this into {path} (JSON5; or run again with --write)",
    "codex": "# Codex: merge this into {path} (or run again with --write)",
}
_EXPORT_HEADERS = {
    "claude-code": "# Or, instead of the file, for one shell session:",
    "codex": f"# Codex reads the API key from ${CODEX_API_KEY_ENV}; set it where codex runs:",
}


def _render(client: str, target: ClientTarget, path: Path) -> str:
    text = _HEADERS[client].format(path=path) + "\n" + _dump(_format(client), _fragment(client, target))
    exports = _exports(client, target)
    if exports:
        text += "\n" + "\n".join([_EXPORT_HEADERS[client], *exports]) + "\n"
    return text


def render_config(client: str, target: ClientTarget) -> tuple[Path, ConfigFormat, str]:
    """(default config path, file format, text to print) for pointing `client` at `target`."""
    _check_client(client)
    path = default_config_path(client)
    return path, _format(client), _render(client, target, path)


# -- merging into an existing file --------------------------------------------------------------

# Keys whose existing value is the user's choice and is kept when present.
_KEEP_EXISTING = {("models", "mode")}


def _where(keys: tuple[str, ...]) -> str:
    return ".".join(keys) or "the top level"


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            type(None): "null"}.get(type(value), "a number")


def _merge(into: dict[str, Any], ours: dict[str, Any], file: Path, keys: tuple[str, ...] = ()) -> None:
    """Set `ours` in `into` (in place): objects are merged key by key, lists of `{"id": ...}`
    objects entry by entry (matched on `id`), anything else is replaced."""
    for key, value in ours.items():
        at = (*keys, key)
        if key not in into:
            into[key] = copy.deepcopy(value)
        elif at in _KEEP_EXISTING:
            continue
        elif isinstance(value, dict):
            old = into[key]
            if at == ("agents", "defaults", "model") and isinstance(old, str):
                old = into[key] = {"primary": old}  # OpenClaw's short form of the same setting
            if not isinstance(old, dict):
                raise ConfigError(f"{file}: {_where(at)} is {_kind(old)}, expected an object; "
                                  "fix it by hand, the file is unchanged")
            _merge(old, value, file, at)
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
                    _merge(match, item, file, (*at, str(item["id"])))
        else:
            into[key] = copy.deepcopy(value)


def _parse(fmt: ConfigFormat, text: str, file: Path, notes: list[str]) -> dict[str, Any]:
    if fmt == "toml":
        try:
            data: Any = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{file}: not valid TOML ({e}); the file is unchanged") from None
        if any(line.lstrip().startswith("#") for line in text.splitlines()):
            notes.append(f"{file}: its comments were not carried over (the backup keeps them)")
        return data
    if not text.strip():
        return {}
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        try:
            data = json5.loads(text)
        except json5.Json5Error as e:
            raise ConfigError(f"{file}: not valid JSON ({e}); the file is unchanged") from None
        notes.append(f"{file}: comments and JSON5 syntax were rewritten as plain JSON "
                     "(the backup keeps the original)")
    if not isinstance(data, dict):
        raise ConfigError(f"{file}: the top level is {_kind(data)}, expected an object; the file is unchanged")
    return data


def _backup_name(file: Path) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    candidate = file.with_name(f"{file.name}.bak-{stamp}")
    n = 1
    while candidate.exists() or candidate.is_symlink():
        candidate = file.with_name(f"{file.name}.bak-{stamp}-{n}")
        n += 1
    return candidate


def _atomic_write(file: Path, data: bytes, mode: int) -> None:
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


@dataclass(frozen=True)
class _WriteResult:
    path: Path
    backup: Path | None
    changed: bool
    notes: tuple[str, ...]


def _write(client: str, target: ClientTarget, path: Path | None) -> _WriteResult:
    _check_client(client)
    fmt = _format(client)
    file = (path or default_config_path(client)).expanduser()
    real = file.resolve() if file.is_symlink() else file  # write through a dotfiles symlink
    notes: list[str] = []
    old: bytes | None = None
    if real.exists():
        if not real.is_file():
            raise ConfigError(f"{file}: not a regular file; the file is unchanged")
        try:
            old = real.read_bytes()
            text = old.decode("utf-8-sig")
        except OSError as e:
            raise ConfigError(f"{file}: cannot read it ({e.strerror or e}); the file is unchanged") from None
        except UnicodeDecodeError:
            raise ConfigError(f"{file}: not UTF-8 text; the file is unchanged") from None
        data = _parse(fmt, text, file, notes)
    else:
        data = {}
    _merge(data, _fragment(client, target), file)
    new = _dump(fmt, data).encode("utf-8")
    if new == old:
        return _WriteResult(file, None, False, ())
    backup = None
    try:
        real.parent.mkdir(parents=True, exist_ok=True)
        mode = 0o600
        if old is not None:
            mode = real.stat().st_mode & 0o7777
            backup = _backup_name(real)
            shutil.copy2(real, backup)
        _atomic_write(real, new, mode)
    except OSError as e:
        raise ConfigError(f"{file}: cannot write it ({e.strerror or e})") from None
    return _WriteResult(file, backup, True, tuple(notes))


def write_config(client: str, target: ClientTarget, path: Path | None = None) -> tuple[Path, Path | None]:
    """Merge `client`'s configuration for `target` into `path` (default: the client's own file).

    Returns (written file, backup of the old file or None when there was no old file or nothing
    changed). Raises `ConfigError` naming the file, which is then left untouched.
    """
    result = _write(client, target, path)
    return result.path, result.backup


# -- command line --------------------------------------------------------------------------------


_NEXT_STEP = {
    "claude-code": "start `claude` as usual; it reads the env block at start",
    "opencode": f"start `opencode`; the model is {PROVIDER_ID}/{{model}}",
    "openclaw": f"start `openclaw`; the default model is {PROVIDER_ID}/{{model}}",
    "codex": "set the key in the shell that runs codex:",
}


def add_configure_parser(subparsers: Any) -> None:
    """Register `configure` on an argparse sub-parsers object, with `func=run_configure`."""
    d = ClientTarget()
    p = subparsers.add_parser(
        "configure",
        help="print (or --write) a coding agent's configuration for this server",
        description="Print the configuration that points a coding agent at this server; with "
                    "--write, merge it into the agent's config file after backing that file up.")
    p.add_argument("client", choices=CLIENTS, help="the coding agent to configure")
    p.add_argument("--base-url", default=d.base_url, metavar="URL", help=f"server root URL (default {d.base_url})")
    p.add_argument("--model", default=d.model, metavar="NAME", help=f"model name the server serves (default {d.model})")
    p.add_argument("--api-key", default=None, metavar="KEY", help=f"API key to send (default: the placeholder {PLACEHOLDER_API_KEY!r})")
    p.add_argument("--context-window", type=positive_int, default=d.context_window, metavar="N",
                   help=f"context window in tokens (default {d.context_window})")
    p.add_argument("--max-output-tokens", type=positive_int, default=None, metavar="N",
                   help=f"max tokens per response (default {d.max_output_tokens}, "
                        "at most a quarter of the context window)")
    p.add_argument("--write", action="store_true",
                   help="merge into the config file (the old one is kept as FILE.bak-YYYYmmdd-HHMMSS)")
    p.add_argument("--path", type=Path, default=None, metavar="FILE", help="config file to use instead of the client's default")
    p.set_defaults(func=run_configure)


def _target(args: argparse.Namespace) -> ClientTarget:
    max_out = args.max_output_tokens
    if max_out is None:
        max_out = max(1, min(_DEFAULTS["max_output_tokens"], args.context_window // 4))
    return ClientTarget(base_url=args.base_url, model=args.model, api_key=args.api_key,
                        context_window=args.context_window, max_output_tokens=max_out)


def _echo(text: str) -> None:
    sys.stdout.write(text)


def run_configure(args: argparse.Namespace) -> int:
    """Run `configure` for parsed `args`; 0 on success, 2 after one `error:` line on stderr."""
    echo = _echo  # one place to redirect the command's output
    try:
        target = _target(args)
        client: str = args.client
        if not args.write:
            path = args.path.expanduser() if args.path else default_config_path(client)
            echo(_render(client, target, path))
            return 0
        result = _write(client, target, args.path)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for note in result.notes:
        print(f"note: {note}", file=sys.stderr)
    if not result.changed:
        echo(f"{result.path} already points {client} at {target.base_url} (unchanged)\n")
    elif result.backup is not None:
        echo(f"updated {result.path} (the old file is saved as {result.backup})\n")
    else:
        echo(f"wrote {result.path}\n")
    lines = [_NEXT_STEP[client].format(model=target.model)]
    if client == "codex":  # the file names the variable; the key itself lives in the environment
        lines += [*_exports(client, target), f"then run `codex` (model {target.model}, provider {PROVIDER_ID})"]
    echo("\n".join(lines) + "\n")
    return 0
