"""`freetoken-agent configure`: each client's printed config, and `--write` merging into real files.

Checks the exact keys each client needs (parsed back with `json`/`tomllib`), that `--write` keeps
every unrelated setting of an existing file and backs the old file up byte for byte, that a second
write changes nothing and duplicates nothing, that an unreadable file is reported in one line and
left untouched, and the command end to end in a subprocess (HOME pointed at a temporary folder).
Also: a TOML file keeps its comments through a write (tomlkit), JSON5 files are read with the
`json5` library, Claude Code is refused a context window it would not honour, Codex's file needs no
environment variable, and the model, context window and output limit come from the running server
(a stand-in on loopback) when not given.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import stat
import subprocess
import sys
import threading
import tomllib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest

from freetoken_agent.configure import (
    CLIENTS,
    ClientTarget,
    ConfigError,
    add_configure_parser,
    default_config_path,
    render_config,
    run_configure,
    write_config,
)

REPO = Path(__file__).resolve().parents[2]
BACKUP = re.compile(r"\.bak-\d{8}-\d{6}(-\d+)?$")
TARGET = ClientTarget(base_url="http://10.0.0.5:9000/v1/", model="qwen3-moe", api_key="sk-local",
                      context_window=131072, max_output_tokens=16384)
CLIENT_ENV = ("CLAUDE_CONFIG_DIR", "XDG_CONFIG_HOME", "OPENCLAW_CONFIG_PATH", "CODEX_HOME")


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for name in CLIENT_ENV:
        monkeypatch.delenv(name, raising=False)
    return home


def _document(fmt: str, text: str) -> dict[str, Any]:
    """The config document inside printed text: after the `#` header, before any export section."""
    header, _, rest = text.partition("\n")
    assert header.startswith("# ")
    if fmt == "toml":
        return tomllib.loads(rest.split("\n\n# ", 1)[0])
    doc, end = json.JSONDecoder().raw_decode(rest)
    assert rest[end:].strip() == "" or rest[end:].startswith("\n\n# ")
    return doc


def _exports(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        if line.startswith("export "):
            name, _, value = line.removeprefix("export ").partition("=")
            (out[name],) = shlex.split(value)
    return out


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="freetoken-agent")
    add_configure_parser(parser.add_subparsers(dest="command", required=True))
    return parser


def _run(*argv: str, offline: bool = True) -> int:
    args = _parser().parse_args(["configure", *argv, *(["--offline"] if offline else [])])
    assert args.func is run_configure
    return args.func(args)


# -- what is printed ------------------------------------------------------------------------------

CLAUDE_ENV = {
    "ANTHROPIC_BASE_URL": "http://10.0.0.5:9000",
    "ANTHROPIC_AUTH_TOKEN": "sk-local",
    "ANTHROPIC_MODEL": "qwen3-moe",
    "ANTHROPIC_SMALL_FAST_MODEL": "qwen3-moe",
    "ANTHROPIC_DEFAULT_OPUS_MODEL": "qwen3-moe",
    "ANTHROPIC_DEFAULT_SONNET_MODEL": "qwen3-moe",
    "ANTHROPIC_DEFAULT_HAIKU_MODEL": "qwen3-moe",
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "DISABLE_TELEMETRY": "1",
    "DISABLE_AUTOUPDATER": "1",
    "DISABLE_ERROR_REPORTING": "1",
    "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
    "API_TIMEOUT_MS": "3000000",
    "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "16384",
    "CLAUDE_CODE_AUTO_COMPACT_WINDOW": "131072",
}
OPENCODE = {
    "provider": {"freetoken": {
        "npm": "@ai-sdk/openai-compatible",
        "name": "FreeToken (local)",
        "options": {"baseURL": "http://10.0.0.5:9000/v1", "apiKey": "sk-local",
                    "timeout": 3000000, "chunkTimeout": 600000},
        "models": {"qwen3-moe": {"name": "qwen3-moe", "limit": {"context": 131072, "output": 16384},
                                 "reasoning": True, "tool_call": True,
                                 "interleaved": {"field": "reasoning_content"}}},
    }},
    "model": "freetoken/qwen3-moe",
    "small_model": "freetoken/qwen3-moe",
    "autoupdate": False,
    "share": "disabled",
}
OPENCLAW = {
    "models": {"mode": "merge", "providers": {"freetoken": {
        "baseUrl": "http://10.0.0.5:9000/v1", "apiKey": "sk-local", "api": "openai-completions",
        "models": [{"id": "qwen3-moe", "name": "qwen3-moe", "reasoning": True, "input": ["text"],
                    "contextWindow": 131072, "maxTokens": 16384}],
    }}},
    "agents": {"defaults": {"model": {"primary": "freetoken/qwen3-moe"}}},
    "update": {"checkOnStart": False},
    "telemetry": {"enabled": False},
}
CODEX = {
    "model": "qwen3-moe",
    "model_provider": "freetoken",
    "model_context_window": 131072,
    "check_for_update_on_startup": False,
    "analytics": {"enabled": False},
    "model_providers": {"freetoken": {"name": "FreeToken (local)", "base_url": "http://10.0.0.5:9000/v1",
                                      "wire_api": "responses", "experimental_bearer_token": "sk-local"}},
}


def test_claude_code_prints_the_env_block_and_the_same_exports(home: Path) -> None:
    path, fmt, text = render_config("claude-code", TARGET)
    assert (path, fmt) == (home / ".claude" / "settings.json", "json")
    assert str(path) in text.splitlines()[0]
    assert _document(fmt, text) == {"env": CLAUDE_ENV}
    assert _exports(text) == CLAUDE_ENV
    assert not path.exists()  # printing writes nothing


def test_opencode_prints_a_provider_with_limits_and_reasoning(home: Path) -> None:
    path, fmt, text = render_config("opencode", TARGET)
    assert (path, fmt) == (home / ".config" / "opencode" / "opencode.json", "json")
    assert _document(fmt, text) == OPENCODE
    assert _exports(text) == {"OPENCODE_DISABLE_MODELS_FETCH": "1"}  # its file cannot say it


def test_openclaw_prints_a_merge_mode_provider_and_the_primary_model(home: Path) -> None:
    path, fmt, text = render_config("openclaw", TARGET)
    assert (path, fmt) == (home / ".openclaw" / "openclaw.json", "json5")
    assert _document(fmt, text) == OPENCLAW


def test_codex_prints_a_responses_provider_that_needs_no_environment(home: Path) -> None:
    path, fmt, text = render_config("codex", TARGET)
    assert (path, fmt) == (home / ".codex" / "config.toml", "toml")
    assert _document(fmt, text) == CODEX
    assert _exports(text) == {}
    keyless = _document(fmt, render_config("codex", ClientTarget(base_url="http://h:1", model="m"))[2])
    assert keyless["model_providers"]["freetoken"] == {"name": "FreeToken (local)", "base_url": "http://h:1/v1",
                                                       "wire_api": "responses"}  # no env_key, no key


def test_claude_code_is_refused_a_window_it_would_not_honour(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="at least 100000 tokens"):
        render_config("claude-code", ClientTarget(context_window=32768))
    assert _run("claude-code", "--context-window", "65536", "--write") == 2
    err = capsys.readouterr().err
    assert err.startswith("error: Claude Code needs a context window of at least 100000") and err.count("\n") == 1
    assert "--kv-tokens" in err and not (home / ".claude").exists()
    env = _document("json", render_config("claude-code", ClientTarget(context_window=100000))[2])["env"]
    assert env["CLAUDE_CODE_AUTO_COMPACT_WINDOW"] == "100000"


def test_defaults_placeholder_key_and_url_normalisation(home: Path) -> None:
    target = ClientTarget()
    assert (target.base_url, target.model, target.context_window, target.max_output_tokens) == (
        "http://127.0.0.1:8000", "freetoken-demo", 32768, 8192)
    env = _document("json", render_config("claude-code", ClientTarget(context_window=131072))[2])["env"]
    assert env["ANTHROPIC_AUTH_TOKEN"] == "freetoken" and env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:8000"
    for url in ("http://h:1", "http://h:1/", "http://h:1/v1", "http://h:1/v1/"):
        assert ClientTarget(base_url=url).base_url == "http://h:1"
        assert ClientTarget(base_url=url).openai_base_url == "http://h:1/v1"
    for bad in ({"base_url": "127.0.0.1:8000"}, {"base_url": "ftp://h"}, {"model": ""}, {"model": "a b"},
                {"context_window": 0}, {"context_window": 100, "max_output_tokens": 100}, {"api_key": ""}):
        with pytest.raises(ValueError):
            ClientTarget(**bad)


def test_default_paths_honour_each_clients_environment(home: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CODEX_HOME", str(tmp_path / "cx"))
    monkeypatch.setenv("CLAUDE_CONFIG_DIR", str(tmp_path / "cl"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("OPENCLAW_CONFIG_PATH", str(tmp_path / "oc.json5"))
    assert default_config_path("codex") == tmp_path / "cx" / "config.toml"
    assert default_config_path("claude-code") == tmp_path / "cl" / "settings.json"
    assert default_config_path("opencode") == tmp_path / "xdg" / "opencode" / "opencode.json"
    assert default_config_path("openclaw") == tmp_path / "oc.json5"
    (tmp_path / "xdg" / "opencode").mkdir(parents=True)
    (tmp_path / "xdg" / "opencode" / "opencode.jsonc").write_text("{}")
    assert default_config_path("opencode") == tmp_path / "xdg" / "opencode" / "opencode.jsonc"
    (tmp_path / "xdg" / "opencode" / "opencode.json").write_text("{}")
    assert default_config_path("opencode") == tmp_path / "xdg" / "opencode" / "opencode.json"


# -- --write into existing files -------------------------------------------------------------------

EXISTING: dict[str, str] = {
    "claude-code": json.dumps({"permissions": {"allow": ["Bash(ls:*)"]}, "theme": "dark",
                               "env": {"MY_VAR": "1", "ANTHROPIC_MODEL": "claude-opus"}}, indent=4),
    "opencode": json.dumps({"$schema": "https://opencode.ai/config.json", "theme": "tokyonight",
                            "model": "anthropic/claude-sonnet",
                            "provider": {"ollama": {"npm": "@ai-sdk/openai-compatible",
                                                    "models": {"llama3": {}}},
                                         "freetoken": {"options": {"headers": {"X-Team": "a"}},
                                                       "models": {"old-model": {"name": "old"}}}}}),
    "openclaw": json.dumps({"gateway": {"port": 18789}, "models": {"mode": "replace", "providers": {
        "ollama": {"baseUrl": "http://127.0.0.1:11434", "models": [{"id": "llama3"}]},
        "freetoken": {"models": [{"id": "qwen3-moe", "compat": {"supportsPromptCacheKey": True}}]}}},
        "agents": {"defaults": {"workspace": "~/w", "model": {"fallbacks": ["ollama/llama3"]}}}}),
    "codex": ('# my codex settings\napproval_policy = "never"  # ask me never\nmodel = "gpt-5"\n\n'
              '[model_providers.other]\nname = "Other"\nbase_url = "http://o/v1"\n\n'
              '[model_providers.freetoken]\nhttp_headers = { "X-Team" = "a" }\n\n'
              '# my fast profile\n[profiles.fast]\nmodel = "gpt-5-mini"\n\n[[hooks]]\ncmd = ["a", "b"]\n'),
}


def _load(client: str, path: Path) -> dict[str, Any]:
    text = path.read_text()
    return tomllib.loads(text) if client == "codex" else json.loads(text)


def _expected_after_merge(client: str) -> dict[str, Any]:
    """The existing file of EXISTING with our settings for TARGET merged in, spelled out."""
    if client == "claude-code":
        return {"permissions": {"allow": ["Bash(ls:*)"]}, "theme": "dark", "env": {"MY_VAR": "1", **CLAUDE_ENV}}
    if client == "opencode":
        ours = OPENCODE["provider"]["freetoken"]
        return {"$schema": "https://opencode.ai/config.json", "theme": "tokyonight",
                "model": "freetoken/qwen3-moe", "small_model": "freetoken/qwen3-moe",
                "autoupdate": False, "share": "disabled",
                "provider": {"ollama": {"npm": "@ai-sdk/openai-compatible", "models": {"llama3": {}}},
                             "freetoken": {**ours,
                                           "options": {"headers": {"X-Team": "a"}, **ours["options"]},
                                           "models": {"old-model": {"name": "old"}, **ours["models"]}}}}
    if client == "openclaw":
        ours = OPENCLAW["models"]["providers"]["freetoken"]
        model = {**ours["models"][0], "compat": {"supportsPromptCacheKey": True}}
        return {"gateway": {"port": 18789},
                "models": {"mode": "replace", "providers": {
                    "ollama": {"baseUrl": "http://127.0.0.1:11434", "models": [{"id": "llama3"}]},
                    "freetoken": {**ours, "models": [model]}}},
                "agents": {"defaults": {"workspace": "~/w", "model": {"fallbacks": ["ollama/llama3"],
                                                                      "primary": "freetoken/qwen3-moe"}}},
                "update": {"checkOnStart": False}, "telemetry": {"enabled": False}}
    return {"approval_policy": "never", "model": "qwen3-moe", "model_provider": "freetoken",
            "model_context_window": 131072, "check_for_update_on_startup": False, "analytics": {"enabled": False},
            "model_providers": {"other": {"name": "Other", "base_url": "http://o/v1"},
                                "freetoken": {"http_headers": {"X-Team": "a"},
                                              **CODEX["model_providers"]["freetoken"]}},
            "profiles": {"fast": {"model": "gpt-5-mini"}}, "hooks": [{"cmd": ["a", "b"]}]}


def _put(client: str, text: str) -> Path:
    path = default_config_path(client)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.mark.parametrize("client", CLIENTS)
def test_write_keeps_other_settings_adds_ours_and_backs_up(home: Path, client: str) -> None:
    path = _put(client, EXISTING[client])
    os.chmod(path, 0o640)
    old = path.read_bytes()
    written, backup = write_config(client, TARGET)
    assert written == path
    assert _load(client, path) == _expected_after_merge(client)
    assert backup is not None and backup.parent == path.parent
    assert backup.name.startswith(path.name) and BACKUP.search(backup.name)
    assert backup.read_bytes() == old
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert sorted(p.name for p in path.parent.iterdir()) == sorted([path.name, backup.name])  # no temp left


@pytest.mark.parametrize("client", CLIENTS)
def test_write_twice_is_idempotent_and_a_new_model_is_added_once(home: Path, client: str) -> None:
    path = _put(client, EXISTING[client])
    write_config(client, TARGET)
    first = path.read_bytes()
    written, backup = write_config(client, TARGET)
    assert (written, backup) == (path, None)
    assert path.read_bytes() == first
    assert len(list(path.parent.glob(path.name + ".bak-*"))) == 1

    other = ClientTarget(base_url=TARGET.base_url, model="other-moe", api_key="sk-local", context_window=200000)
    _, backup = write_config(client, other)
    assert backup is not None and backup.read_bytes() == first
    write_config(client, other)
    data = _load(client, path)
    if client == "claude-code":
        assert data["env"]["ANTHROPIC_MODEL"] == "other-moe" and data["env"]["MY_VAR"] == "1"
    elif client == "opencode":
        assert list(data["provider"]) == ["ollama", "freetoken"]
        assert list(data["provider"]["freetoken"]["models"]) == ["old-model", "qwen3-moe", "other-moe"]
        assert data["model"] == data["small_model"] == "freetoken/other-moe"
    elif client == "openclaw":
        assert list(data["models"]["providers"]) == ["ollama", "freetoken"]
        assert [m["id"] for m in data["models"]["providers"]["freetoken"]["models"]] == ["qwen3-moe", "other-moe"]
        assert data["agents"]["defaults"]["model"]["primary"] == "freetoken/other-moe"
    else:
        assert list(data["model_providers"]) == ["other", "freetoken"]
        assert (data["model"], data["model_context_window"]) == ("other-moe", 200000)


@pytest.mark.parametrize("client", CLIENTS)
def test_write_into_an_empty_home_creates_the_file_private(home: Path, client: str) -> None:
    written, backup = write_config(client, TARGET)
    assert backup is None and written == default_config_path(client)
    assert _load(client, written) == _document(render_config(client, TARGET)[1], render_config(client, TARGET)[2])
    assert stat.S_IMODE(written.stat().st_mode) == 0o600


BROKEN = {"claude-code": '{"env": {"A": "1",}, oops}', "opencode": '{"model": "x"',
          "openclaw": "{ models: { providers: [ }", "codex": 'model = "x"\nmodel = "y"\n'}


@pytest.mark.parametrize("client", CLIENTS)
def test_unreadable_file_is_an_error_naming_it_and_left_untouched(home: Path, client: str,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    path = _put(client, BROKEN[client])
    with pytest.raises(ConfigError, match=re.escape(str(path))):
        write_config(client, TARGET)
    assert _run(client, "--write") == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}: ") and err.count("\n") == 1 and "line" in err
    assert path.read_text() == BROKEN[client]
    assert list(path.parent.iterdir()) == [path]


@pytest.mark.parametrize(("client", "text", "where"), [
    ("claude-code", '{"env": ["A=1"]}', "env is a list"),
    ("opencode", '{"provider": "ollama"}', "provider is a string"),
    ("openclaw", '{"models": {"providers": {"freetoken": {"models": {"id": "x"}}}}}',
     "models.providers.freetoken.models is an object"),
    ("codex", "model_providers = 3\n", "model_providers is a number"),
    ("opencode", "[1, 2]", "the top level is a list"),
])
def test_a_setting_of_the_wrong_type_is_an_error_not_overwritten(home: Path, client: str, text: str,
                                                                 where: str) -> None:
    path = _put(client, text)
    with pytest.raises(ConfigError, match=re.escape(f"{path}: {where}")):
        write_config(client, TARGET)
    assert path.read_text() == text


def test_openclaw_json5_with_comments_is_read_and_rewritten_as_json(home: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    text = ("// OpenClaw config\n{\n  gateway: { port: 18789, },  /* keep */\n"
            "  agents: { defaults: { model: 'ollama/llama3' } },\n}\n")
    path = _put("openclaw", text)
    assert _run("openclaw", "--write", "--model", "m") == 0
    captured = capsys.readouterr()
    assert "note: " in captured.err and "updated " in captured.out
    data = json.loads(path.read_text())
    assert data["gateway"] == {"port": 18789}
    assert data["agents"]["defaults"]["model"] == {"primary": "freetoken/m"}
    assert [m["id"] for m in data["models"]["providers"]["freetoken"]["models"]] == ["m"]
    (backup,) = path.parent.glob("openclaw.json.bak-*")
    assert backup.read_text() == text


def test_path_option_and_symlinked_config_are_written_through(home: Path, tmp_path: Path) -> None:
    real = tmp_path / "dotfiles" / "config.toml"
    real.parent.mkdir()
    real.write_text('approval_policy = "never"\n')
    link = home / ".codex" / "config.toml"
    link.parent.mkdir()
    link.symlink_to(real)
    _, backup = write_config("codex", TARGET)
    assert link.is_symlink() and tomllib.loads(real.read_text())["model_provider"] == "freetoken"
    assert backup is not None and backup.parent == real.parent
    custom = tmp_path / "elsewhere" / "settings.json"
    assert _run("claude-code", "--write", "--path", str(custom), "--context-window", "131072") == 0
    assert json.loads(custom.read_text())["env"]["ANTHROPIC_MODEL"] == "freetoken-demo"


def test_max_output_default_follows_a_small_context_window(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _run("opencode", "--context-window", "4096") == 0
    limit = _document("json", capsys.readouterr().out)["provider"]["freetoken"]["models"]["freetoken-demo"]["limit"]
    assert limit == {"context": 4096, "output": 1024}
    assert _run("opencode", "--context-window", "4096", "--max-output-tokens", "4096") == 2
    assert capsys.readouterr().err.startswith("error: max output tokens (4096)")


# -- end to end -----------------------------------------------------------------------------------

WRAPPER = """
import argparse, sys
from freetoken_agent.configure import add_configure_parser

class OneLine(argparse.ArgumentParser):
    def error(self, message):
        self.exit(2, f"error: {message}\\n")

parser = OneLine(prog="freetoken-agent")
add_configure_parser(parser.add_subparsers(dest="command", required=True, parser_class=OneLine))
args = parser.parse_args(sys.argv[1:])
raise SystemExit(args.func(args))
"""


def _cli(home: Path, *argv: str, wrapper: bool = True) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in CLIENT_ENV}
    env.update(HOME=str(home), PYTHONPATH=str(REPO))
    cmd = ["-c", WRAPPER] if wrapper else ["-m", "freetoken_agent"]
    return subprocess.run([sys.executable, *cmd, *argv], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=60)


def test_configure_end_to_end(home: Path) -> None:
    proc = _cli(home, "configure", "codex", "--model", "qwen3-moe", "--api-key", "sk-1", "--offline")
    assert proc.returncode == 0, proc.stderr
    assert _document("toml", proc.stdout)["model"] == "qwen3-moe"
    assert not (home / ".codex").exists()

    proc = _cli(home, "configure", "codex", "--model", "qwen3-moe", "--api-key", "sk-1", "--write", "--offline")
    assert proc.returncode == 0, proc.stderr
    assert "export" not in proc.stdout and "codex exec resume --last" in proc.stdout
    written = tomllib.loads((home / ".codex" / "config.toml").read_text())
    assert written["model_providers"]["freetoken"]["experimental_bearer_token"] == "sk-1"
    proc = _cli(home, "configure", "claude-code", "--write", "--offline", "--context-window", "131072")
    assert proc.returncode == 0 and "export" not in proc.stdout  # the file replaces the exports
    assert "claude -p -c" in proc.stdout
    proc = _cli(home, "configure", "openclaw", "--write", "--offline")
    assert proc.returncode == 0, proc.stderr
    assert "Node >= 24.16" in proc.stdout and "openclaw agent --local --session-id" in proc.stdout
    proc = _cli(home, "configure", "opencode", "--write", "--offline")
    assert "export OPENCODE_DISABLE_MODELS_FETCH=1" in proc.stdout.splitlines()

    proc = _cli(home, "configure", "vim")
    assert proc.returncode == 2 and "invalid choice: 'vim'" in proc.stderr and proc.stderr.count("\n") == 1


def test_configure_through_the_real_cli(home: Path) -> None:
    from freetoken_agent.cli import build_parser

    args = build_parser().parse_args(["configure", "opencode"])  # exits (fails the test) if not registered
    assert args.func is run_configure
    proc = _cli(home, "configure", "opencode", "--write", "--offline", wrapper=False)
    assert proc.returncode == 0, proc.stderr
    written = home / ".config" / "opencode" / "opencode.json"
    assert json.loads(written.read_text())["model"] == "freetoken/freetoken-demo"
    proc = _cli(home, "configure", "opencode", "--base-url", "nope", "--offline", wrapper=False)
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1


# -- the server says what it serves; TOML comments survive; JSON5 is read ---------------------------


class _Models(BaseHTTPRequestHandler):
    card: ClassVar[dict[str, Any]] = {}

    def log_message(self, format: str, *args: Any) -> None:
        return None

    def do_GET(self) -> None:
        ok = self.path == "/v1/models"
        body = json.dumps({"object": "list", "data": [self.card]} if ok else {"error": "no"}).encode()
        self.send_response(200 if ok else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def server() -> Iterator[str]:
    _Models.card = {"id": "served-moe", "object": "model", "context_window": 200000, "max_output_tokens": 4096}
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Models)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_the_running_servers_model_and_window_are_used(home: Path, server: str,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert _run("claude-code", "--base-url", server, "--write", offline=False) == 0
    env = json.loads((home / ".claude" / "settings.json").read_text())["env"]
    assert (env["ANTHROPIC_MODEL"], env["CLAUDE_CODE_AUTO_COMPACT_WINDOW"], env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"]) == (
        "served-moe", "200000", "4096")
    assert "serves served-moe with a context window of 200000 tokens" in capsys.readouterr().err
    assert _run("codex", "--base-url", server, "--context-window", "150000", "--model", "mine", offline=False) == 0
    doc = _document("toml", capsys.readouterr().out)
    assert (doc["model"], doc["model_context_window"]) == ("mine", 150000)  # flags win
    _Models.card = {**_Models.card, "context_window": 32768}
    assert _run("claude-code", "--base-url", server, offline=False) == 2
    assert "error: Claude Code needs a context window of at least 100000" in capsys.readouterr().err


def test_no_server_means_the_defaults_and_a_note(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    assert _run("opencode", "--base-url", url, offline=False) == 0
    captured = capsys.readouterr()
    assert "note: no server answered at " + url in captured.err
    model = _document("json", captured.out)["provider"]["freetoken"]["models"]["freetoken-demo"]
    assert model["limit"] == {"context": 32768, "output": 8192}


def test_a_toml_files_comments_and_layout_survive_the_write(home: Path) -> None:
    path = _put("codex", EXISTING["codex"])
    write_config("codex", TARGET)
    text = path.read_text()
    for kept in ("# my codex settings\n", 'approval_policy = "never"  # ask me never\n', "# my fast profile\n[profiles.fast]"):
        assert kept in text, text
    assert text.index("[model_providers.other]") < text.index("[model_providers.freetoken]") < text.index("[profiles.fast]")
    first = path.read_bytes()
    assert write_config("codex", TARGET)[1] is None and path.read_bytes() == first


def test_json5_files_are_read_with_the_json5_library(home: Path) -> None:
    text = "// c\n{models: {providers: {ollama: {baseUrl: 'http://h', models: [{id: 'x',},],},},}, n: 0x1F, f: .5,}\n"
    path = _put("openclaw", text)
    write_config("openclaw", TARGET)
    data = json.loads(path.read_text())
    assert data["n"] == 31 and data["f"] == 0.5
    assert data["models"]["providers"]["ollama"] == {"baseUrl": "http://h", "models": [{"id": "x"}]}
    assert not (REPO / "freetoken_agent" / "clients" / "json5.py").exists()
    assert not (REPO / "freetoken_agent" / "clients" / "toml_writer.py").exists()
