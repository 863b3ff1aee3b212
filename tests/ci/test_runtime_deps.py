"""Every command works after the README's first command (`pip install torch` then `pip install -e .`):
each third-party package that the product's code imports (at the top of a module or inside a
function) is a runtime dependency in pyproject.toml, not only a test extra.

The imports are read from the source with `ast`; a module counts as declared when one of the
distributions in `[project].dependencies` provides it (its installed files). The GPU-only kernels'
imports are listed apart (triton comes with the CUDA build of torch, fla-core is optional: the
engine falls back to its torch ops without it), and so is pybind11, which `pip install` brings as
a build requirement for the native extension, and simde-py, whose headers only the AVX-512
emulation test build reads.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from functools import cache
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PRODUCT = ("freetoken_agent", "engine", "adapters", "native")
FIRST_PARTY = {*PRODUCT, "evals", "tests", "setup"}
APART = {"triton": "comes with torch's CUDA build", "fla": "fla-core, optional: the torch ops are the fallback",
         "pybind11": "a build requirement of the native extension (pyproject [build-system])",
         "simde_py": "SIMDe's headers, read only by `native/build.py --emulate-avx512` (a test build)"}


def _name(requirement: str) -> str:
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", requirement).group(0)).lower()  # type: ignore[union-attr]


@cache
def _provided(requirements: tuple[str, ...]) -> frozenset[str]:
    """The top-level modules the installed distributions of `requirements` provide."""
    modules: set[str] = set()
    for req in requirements:
        try:
            files = distribution(_name(req)).files or []
        except PackageNotFoundError:
            continue
        for f in files:
            top = f.parts[0]
            if top.endswith(".py"):
                modules.add(top[:-3])
            elif not top.endswith((".dist-info", ".data")) and top not in ("..", "bin"):
                modules.add(top)
    return frozenset(modules)


@cache
def _imports() -> dict[str, frozenset[str]]:
    """top-level module -> files of the product that import it."""
    found: dict[str, set[str]] = {}
    for folder in PRODUCT:
        for path in (REPO / folder).rglob("*.py"):
            tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    found.setdefault(name.split(".")[0], set()).add(str(path.relative_to(REPO)))
    return {k: frozenset(v) for k, v in found.items()}


def _third_party() -> dict[str, frozenset[str]]:
    return {m: f for m, f in _imports().items()
            if m not in sys.stdlib_module_names and m not in FIRST_PARTY and m not in APART and m != "__future__"}


def test_every_imported_package_is_a_runtime_dependency() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    provided = _provided(tuple(project["dependencies"]))
    missing = {m: sorted(f)[:3] for m, f in _third_party().items() if m not in provided}
    assert missing == {}, f"imported by the product but not in [project].dependencies: {missing}"


def test_the_test_extra_holds_no_runtime_package() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    runtime = {_name(r) for r in project["dependencies"]}
    test_only = [r for r in project["optional-dependencies"]["test"] if _name(r) not in runtime]
    imported = set(_third_party())
    in_test = {_name(r) for r in test_only if _provided((r,)) & imported}
    assert in_test == set(), f"the product imports these, but only the test extra installs them: {in_test}"
