"""The engine options (engine/options.py): one registry, filled once, CLI > environment > default.

- every option has a unique flat name, a help text and at most one environment variable, and every
  FREETOKEN_* variable the engine documents appears once; docs/options.md is the registry's table,
  up to date, with each option on exactly one row;
- `resolve`: a given value beats the environment, which beats the default, for options of the root
  and of each section; a bad value names its variable; an unknown name is refused;
- `of` / `replace` reach every section by flat name and validate; the CLI flags made from the
  registry (freetoken_agent/argtypes.py) store nothing unless given, and a given flag beats the
  environment;
- no module of engine/ or native/ but engine/options.py reads the environment (read from the source).
"""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

import pytest

from engine.errors import ConfigError
from engine.options import EngineOptions, markdown, options

ROOT = Path(__file__).resolve().parents[2]


def test_every_option_once_with_help_and_its_own_variable() -> None:
    opts = options()
    names = [o.name for o in opts]
    envs = [o.env for o in opts if o.env]
    assert len(names) == len(set(names)) and len(envs) == len(set(envs))
    assert all(o.help and o.path.endswith(o.name) for o in opts)
    assert all(o.parse is not None for o in opts if o.env)  # a variable's text must parse
    assert {"kv_tokens", "gpu.split_expert", "kernels.fused_ops", "native.native_isa"} <= {o.path for o in opts}
    # the defaults are the dataclasses' own
    default = EngineOptions()
    for o in opts:
        owner = default if o.section is None else getattr(default, o.section)
        assert getattr(owner, o.name) == o.default, o.path


def test_the_docs_table_is_the_registry() -> None:
    doc = (ROOT / "docs" / "options.md").read_text()
    assert doc == markdown(), "docs/options.md is stale: python -m engine.options > docs/options.md"
    for o in options():
        assert len(re.findall(rf"^\| `{re.escape(o.path)}` \|", doc, flags=re.M)) == 1, o.path


def test_given_beats_environment_beats_default() -> None:
    env = {"FREETOKEN_OVERLAP_WIDTH": "3", "FREETOKEN_PLAN": "torch", "FREETOKEN_FUSED_OPS": "off",
           "FREETOKEN_NATIVE_PREFETCH": "0", "FREETOKEN_SPLIT_EXPERT": "auto"}
    got = EngineOptions.resolve({}, env)
    assert (got.overlap_width, got.gpu.plan, got.kernels.fused_ops, got.native.native_prefetch) == (3, "torch", False, 0)
    assert got.gpu.split_expert is None and got.kv_tokens == 65536
    given = EngineOptions.resolve({"overlap_width": 2, "plan": "fused", "fused_ops": True}, env)
    assert (given.overlap_width, given.gpu.plan, given.kernels.fused_ops) == (2, "fused", True)
    assert EngineOptions.resolve({}, {"FREETOKEN_OVERLAP_WIDTH": " "}).overlap_width == 1  # blank: unset
    with pytest.raises(ConfigError, match="FREETOKEN_PLAN='quick'"):
        EngineOptions.resolve({}, {"FREETOKEN_PLAN": "quick"})
    with pytest.raises(ConfigError, match="unknown engine option warp_speed"):
        EngineOptions.resolve({"warp_speed": 9}, {})


def test_flat_names_reach_every_section_and_are_validated() -> None:
    opts = EngineOptions.of(kv_tokens=512, adapt_ratio=False, fused_shared=True, native_threads=3)
    assert opts.kv_tokens == 512 and opts.gpu.adapt_ratio is False and opts.kernels.fused_shared
    assert opts.native_pool_threads == 3 and EngineOptions.of(threads=5).native_pool_threads == 5
    changed = opts.replace(kv_tokens=1024, plan="torch")
    assert changed.kv_tokens == 1024 and changed.gpu.plan == "torch" and changed.kernels == opts.kernels
    assert opts.kv_tokens == 512  # frozen: a copy
    with pytest.raises(ConfigError, match="kv_tokens must be >= 1"):
        opts.replace(kv_tokens=0)
    with pytest.raises(ConfigError, match="native_threads"):
        EngineOptions.of(native_threads=-1)
    with pytest.raises(ConfigError, match="unknown engine option"):
        opts.replace(speed=1)


def test_cli_flags_from_the_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    from freetoken_agent.argtypes import add_engine_arguments, engine_options

    p = argparse.ArgumentParser()
    add_engine_arguments(p, pools=True)
    assert all(v is None for v in vars(p.parse_args([])).values())  # nothing stored unless given
    monkeypatch.setenv("FREETOKEN_OVERLAP_DECODE", "1")
    assert engine_options(p.parse_args([])).overlap_decode is True
    assert engine_options(p.parse_args(["--no-overlap-decode"])).overlap_decode is False
    got = engine_options(p.parse_args(["--kv-tokens", "4096", "--no-cuda-graphs", "--dtype", "float32"]), device="cpu")
    assert (got.kv_tokens, got.cuda_graphs, got.dtype, got.max_running) == (4096, False, "float32", 8)
    assert engine_options(p.parse_args(["--kv-tokens", "9"]), kv_tokens=10).kv_tokens == 10  # the command's own
    with pytest.raises(SystemExit):
        p.parse_args(["--kv-tokens", "0"])
    helps = {a.dest: a.help for a in p._actions}
    assert "KV cache size" in helps["kv_tokens"] and "FREETOKEN_OVERLAP_DECODE" in helps["overlap_decode"]


def _reads_environment(path: Path) -> bool:
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "putenv"):
            return True
        if isinstance(node, ast.Name) and node.id in ("environ", "getenv"):
            return True
    return False


def test_one_module_reads_the_environment() -> None:
    readers = sorted(str(p.relative_to(ROOT)) for pkg in ("engine", "native") for p in (ROOT / pkg).rglob("*.py")
                     if _reads_environment(p))
    assert readers == ["engine/options.py", "native/build.py"]  # the build reads CXX, before any engine
    for src in (ROOT / "native" / "src").iterdir():
        assert "getenv" not in src.read_text(), src.name
