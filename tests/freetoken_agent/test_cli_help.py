"""The command line's own surface: `--version`, help for every option with its default, and `--help`
answering at once (no torch, no engine, no server stack imported to print it).

Runs `python -m freetoken_agent` in subprocesses for the timing and the imports, and walks the
parser that `main` uses for the help texts.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from freetoken_agent import __version__
from freetoken_agent.cli import HelpFormatter, build_parser

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "engine.engine", "fastapi", "uvicorn", "huggingface_hub", "adapters", "safetensors", "httpx")


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO)}


def _commands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every (argv prefix, parser) pair, sub-commands of sub-commands included."""
    out = [(prefix, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out += _commands(sub, (*prefix, name))
    return out


COMMANDS = _commands(build_parser())


def test_every_command_is_reachable() -> None:
    names = {" ".join(argv) for argv, _ in COMMANDS}
    assert {"serve", "pull", "configure", "generate", "sessions", "demo-model", "calibrate", "bench",
            "bench decode", "bench prefill", "bench cpu-experts"} <= names


@pytest.mark.parametrize(("argv", "parser"), COMMANDS, ids=[" ".join(a) or "top" for a, _ in COMMANDS])
def test_every_option_has_help_and_shows_its_default(argv: tuple[str, ...], parser: argparse.ArgumentParser) -> None:
    formatter = HelpFormatter(prog="x")
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
            continue
        name = "/".join(action.option_strings) or action.dest
        assert action.help, f"freetoken-agent {' '.join(argv)}: {name} has no help text"
        shown = formatter._get_help_string(action) % {**vars(action), "prog": "x"}
        empty = action.default in (None, False, argparse.SUPPRESS) or action.nargs == 0
        if action.option_strings and not empty:
            assert "default" in shown.lower(), f"freetoken-agent {' '.join(argv)}: {name}: {shown!r}"
    help_text = parser.format_help()  # formats without error (a stray % in a help text would raise)
    assert help_text.startswith("usage:")


def test_help_shows_defaults_in_the_text() -> None:
    serve = dict(COMMANDS)[("serve",)].format_help()
    assert "(default: 8000)" in serve and "(default: 127.0.0.1)" in serve and "(default: auto)" in serve
    prefill = dict(COMMANDS)[("bench", "prefill")].format_help()
    assert "1024,4096,16384" in prefill


def test_version() -> None:
    proc = subprocess.run([sys.executable, "-m", "freetoken_agent", "--version"], capture_output=True, text=True,
                          env=_env(), cwd=REPO, timeout=60)
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"freetoken-agent {__version__}"
    assert __version__.count(".") == 2


def test_anchor_policy_choices_are_the_enums_values() -> None:
    from freetoken_agent.serve import ANCHOR_POLICIES
    from freetoken_agent.sessions import AnchorPolicy

    assert tuple(a.value for a in AnchorPolicy) == ANCHOR_POLICIES


PROBE = """
import json, sys
from freetoken_agent.cli import build_parser
parser = build_parser()
for argv in json.loads(sys.argv[1]):
    try:
        parser.parse_args([*argv, "--help"])
    except SystemExit:
        pass
print(json.dumps(sorted(m for m in sys.modules)), file=sys.stderr)
"""


def test_help_of_every_command_imports_no_torch_engine_or_server() -> None:
    argvs = [list(argv) for argv, _ in COMMANDS]
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps(argvs)], capture_output=True, text=True,
                          env=_env(), cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    modules = json.loads(proc.stderr.strip().splitlines()[-1])
    loaded = [m for m in modules if any(m == h or m.startswith(h + ".") for h in HEAVY)]
    assert loaded == [], loaded


def test_help_answers_in_under_a_second() -> None:
    """CPU time of the whole process (interpreter start included), which other load on the machine
    does not inflate the way it inflates wall time."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    for argv in (["--help"], ["serve", "--help"], ["--version"]):
        proc = subprocess.run([sys.executable, "-m", "freetoken_agent", *argv], capture_output=True, text=True,
                              env=_env(), cwd=REPO, timeout=60)
        assert proc.returncode == 0, proc.stderr
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert cpu / 3 < 1.0, f"{cpu / 3:.2f} s of CPU per --help"


def test_device_defaults_to_auto_and_auto_picks_what_is_there() -> None:
    import torch

    from freetoken_agent.models import UsageError
    from freetoken_agent.serve import resolve_device

    parser = build_parser()
    assert parser.parse_args(["serve"]).device == "auto"
    assert parser.parse_args(["generate", "--prompt", "x"]).device == "auto"
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto") == expected
    assert resolve_device("cpu") == "cpu"
    if not torch.cuda.is_available():
        with pytest.raises(UsageError, match="no CUDA device"):
            resolve_device("cuda")
