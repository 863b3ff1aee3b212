"""`freetoken-agent configure CLIENT`: point a coding agent at this server.

Contract:
- `render_config(client, target)` returns `(default config path, format, text)`. The text is
  what `configure` prints: a `#` line naming the file, then the configuration this server needs,
  then the client's `export` lines if it has any (claude-code: the same settings for one shell;
  opencode: the variable that stops its model-list fetch). It does not read any file.
- `write_config(client, target, path=None)` merges that configuration into the client's real
  config file (`path`, or the default below) and returns `(written file, backup or None)`. An
  existing file is first copied byte for byte to `FILE.bak-YYYYmmdd-HHMMSS` (`-N` added if that
  name is taken), then replaced atomically, keeping its permission bits; a new file is created
  with mode 0600 (it may hold an API key). Only our keys are set: every other setting of the user
  stays, and writing the same target twice changes nothing the second time (no backup either,
  and no duplicate provider or model entries): objects are merged key by key, OpenClaw's model
  list entry by entry on `id`, an existing OpenClaw `models.mode` is kept. A TOML file keeps its
  comments and layout; a JSON5 file is rewritten as plain JSON (the backup keeps its comments, and
  a note says so). A file that cannot be read or parsed, or that has a non-object where ours must
  go, raises `ConfigError` (a `ValueError`) with a one-line message naming the file, and the file
  is left untouched.
- What is written runs as is: no environment variable is needed (Codex sends no key when the
  server has none), and each client's update checks, telemetry or analytics and sharing are
  turned off where its file can say so.
- `add_configure_parser(subparsers)` registers the `configure` sub-command (with
  `func=run_configure`); `run_configure(args)` prints or writes and returns the exit status:
  0, or 2 after printing one `error: ...` line on stderr. The model name, context window and
  output limit not given as flags are asked from the running server (`GET /v1/models`,
  `freetoken_agent.clients.probe`; `--offline` skips it), else the defaults; a note on stderr says
  which. After `--write` it prints how to start the client and continue a conversation.

Clients, their files and what is written (see README "Configure a coding agent"):
- `claude-code`: `$CLAUDE_CONFIG_DIR/settings.json` or `~/.claude/settings.json`, an `env` block
  (Anthropic Messages API at the server root, no `/v1`); a context window under 100000 tokens is
  refused, since Claude Code would compact against 100000 anyway.
- `opencode`: `$XDG_CONFIG_HOME/opencode/opencode.json` or `~/.config/opencode/opencode.json`
  (an existing `opencode.jsonc` there is used instead when there is no `opencode.json`),
  provider `freetoken` through `@ai-sdk/openai-compatible` (Chat Completions at `/v1`).
- `openclaw`: `$OPENCLAW_CONFIG_PATH` or `~/.openclaw/openclaw.json` (JSON5 is read; plain JSON
  is written), provider `freetoken` with `api: "openai-completions"`.
- `codex`: `$CODEX_HOME/config.toml` or `~/.codex/config.toml`, provider `freetoken` with
  `wire_api = "responses"`.
`~` is `$HOME`.

Layout: this module is the public API and the command line. Each client's file location and
fragment live in `freetoken_agent.clients.{claude_code,opencode,openclaw,codex}`; `ClientTarget`
in `freetoken_agent.clients.target`; reading, merging, backing up and rewriting files in
`freetoken_agent.clients.files`; asking the server in `freetoken_agent.clients.probe`.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from freetoken_agent.argtypes import positive_int
from freetoken_agent.clients import claude_code, codex, files, openclaw, opencode
from freetoken_agent.clients.files import ConfigError, ConfigFormat
from freetoken_agent.clients.probe import ProbeError, ServedModel, served_model
from freetoken_agent.clients.target import DEFAULTS, PLACEHOLDER_API_KEY, ClientTarget

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

_MODULES: dict[str, ModuleType] = {
    "claude-code": claude_code,
    "opencode": opencode,
    "openclaw": openclaw,
    "codex": codex,
}
CLIENTS: tuple[str, ...] = tuple(_MODULES)


def _check_client(client: str) -> None:
    if client not in CLIENTS:
        raise ValueError(f"unknown client {client!r} (choose from {', '.join(CLIENTS)})")


def default_config_path(client: str) -> Path:
    """The file `client` reads its user configuration from, honouring `$HOME` and its own env vars."""
    _check_client(client)
    path: Path = _MODULES[client].default_path()
    return path


def _format(client: str) -> ConfigFormat:
    fmt: ConfigFormat = _MODULES[client].FORMAT
    return fmt


def _fragment(client: str, t: ClientTarget) -> dict[str, Any]:
    """The part of the client's config file that this server owns."""
    fragment: dict[str, Any] = _MODULES[client].fragment(t)
    return fragment


def _exports(client: str, t: ClientTarget) -> list[str]:
    lines: list[str] = _MODULES[client].exports(t)
    return lines


def _render(client: str, target: ClientTarget, path: Path) -> str:
    module = _MODULES[client]
    text = module.HEADER.format(path=path) + "\n" + files.dump(_format(client), _fragment(client, target))
    exports = _exports(client, target)
    if exports:
        text += "\n" + "\n".join([module.EXPORT_HEADER, *exports]) + "\n"
    return text


def render_config(client: str, target: ClientTarget) -> tuple[Path, ConfigFormat, str]:
    """(default config path, file format, text to print) for pointing `client` at `target`."""
    _check_client(client)
    path = default_config_path(client)
    return path, _format(client), _render(client, target, path)


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
        old, text = files.read_text(real, name=file)
        data = files.parse(fmt, text, file, notes)
    else:
        data = {}
    files.merge(data, _fragment(client, target), file)
    new = files.dump(fmt, data).encode("utf-8")
    if new == old:
        return _WriteResult(file, None, False, ())
    backup = None
    try:
        real.parent.mkdir(parents=True, exist_ok=True)
        mode = 0o600
        if old is not None:
            mode = real.stat().st_mode & 0o7777
            backup = files.backup_name(real)
            shutil.copy2(real, backup)
        files.atomic_write(real, new, mode)
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


def add_configure_parser(subparsers: Any) -> None:
    """Register `configure` on an argparse sub-parsers object, with `func=run_configure`."""
    d = ClientTarget()
    p = subparsers.add_parser(
        "configure",
        help="print (or --write) a coding agent's configuration for this server",
        description="Print the configuration that points a coding agent at this server; with "
                    "--write, merge it into the agent's config file after backing that file up. "
                    "The model name, context window and output limit are asked from the running "
                    "server unless given.")
    p.add_argument("client", choices=CLIENTS, help="the coding agent to configure")
    p.add_argument("--base-url", default=d.base_url, metavar="URL", help="the server's root URL")
    p.add_argument("--model", default=None, metavar="NAME",
                   help=f"model name the server serves (default: the server's, else {d.model})")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help=f"the server's API key (default: none; the placeholder {PLACEHOLDER_API_KEY!r} is sent "
                        "where a client insists on one)")
    p.add_argument("--context-window", type=positive_int, default=None, metavar="N",
                   help=f"context window in tokens (default: the server's, else {d.context_window})")
    p.add_argument("--max-output-tokens", type=positive_int, default=None, metavar="N",
                   help=f"max tokens per response (default: {d.max_output_tokens}, at most the server's limit "
                        "and a quarter of the context window)")
    p.add_argument("--offline", action="store_true",
                   help="do not ask the server; use the flags and the defaults")
    p.add_argument("--write", action="store_true",
                   help="merge into the config file (the old one is kept as FILE.bak-YYYYmmdd-HHMMSS)")
    p.add_argument("--path", type=Path, default=None, metavar="FILE",
                   help="config file to use instead of the client's default")
    p.set_defaults(func=run_configure)


def _target(args: argparse.Namespace, notes: list[str]) -> ClientTarget:
    """The target from the flags, the running server for what they leave out, then the defaults."""
    d = ClientTarget()
    served: ServedModel | None = None
    if not args.offline and (args.model is None or args.context_window is None):
        try:
            served = served_model(args.base_url, args.api_key)
            notes.append(f"{args.base_url} serves {served.id} with a context window of {served.context_window} tokens")
        except ProbeError as e:
            notes.append(f"{e}; assuming the defaults (start the server first, or pass --model and --context-window)")
    model = args.model or (served.id if served else d.model)
    window = args.context_window or (served.context_window if served else d.context_window)
    max_out = args.max_output_tokens
    if max_out is None:
        limits = [DEFAULTS["max_output_tokens"], window // 4]
        if served and served.max_output_tokens:
            limits.append(served.max_output_tokens)
        max_out = max(1, min(limits))
    return ClientTarget(base_url=args.base_url, model=model, api_key=args.api_key,
                        context_window=window, max_output_tokens=max_out)


def _echo(text: str) -> None:
    sys.stdout.write(text)


def run_configure(args: argparse.Namespace) -> int:
    """Run `configure` for parsed `args`; 0 on success, 2 after one `error:` line on stderr."""
    echo = _echo  # one place to redirect the command's output
    notes: list[str] = []
    try:
        target = _target(args, notes)
        client: str = args.client
        if not args.write:
            for note in notes:
                print(f"note: {note}", file=sys.stderr)
            path = args.path.expanduser() if args.path else default_config_path(client)
            echo(_render(client, target, path))
            return 0
        result = _write(client, target, args.path)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for note in [*notes, *result.notes]:
        print(f"note: {note}", file=sys.stderr)
    if not result.changed:
        echo(f"{result.path} already points {client} at {target.base_url} (unchanged)\n")
    elif result.backup is not None:
        echo(f"updated {result.path} (the old file is saved as {result.backup})\n")
    else:
        echo(f"wrote {result.path}\n")
    module = _MODULES[client]
    lines = [module.NEXT_STEP.format(model=target.model)]
    if module.EXPORTS_AFTER_WRITE and module.EXPORT_HEADER:
        lines += [module.EXPORT_HEADER, *_exports(client, target)]
    echo("\n".join(lines) + "\n")
    return 0
