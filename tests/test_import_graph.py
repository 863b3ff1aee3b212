"""The import graph of the packages, read from the source (every import statement: module level,
inside functions, under TYPE_CHECKING): no module of engine/, adapters/ or freetoken_agent/ takes
part in an import cycle, and engine/ imports nothing of freetoken_agent/, adapters/ or evals/ (it
sees token ids and budgets only). The checker itself is checked on a small tree with a cycle and an
upward import."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "adapters", "freetoken_agent", "native", "evals")
ABOVE_ENGINE = ("freetoken_agent", "adapters", "evals")


def _modules(root: Path) -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (root / pkg).rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _imported(name: str, path: Path, tree: ast.Module) -> set[str]:
    """Every dotted name the module imports (for `from a import b`: a and a.b)."""
    names = set()
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            mod = ".".join([*base, node.module] if node.module else base)
            names.add(mod)
            names.update(f"{mod}.{a.name}" for a in node.names)
    return names


def import_graph(root: Path) -> tuple[dict[str, set[str]], set[str]]:
    """(module -> the project modules it imports, every top-level package name imported)."""
    mods = _modules(root)
    graph, tops = {}, set()
    for name, path in mods.items():
        targets = set()
        for imported in _imported(name, path, ast.parse(path.read_text())):
            tops.add(f"{name} -> {imported}")
            while imported and imported not in mods:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                targets.add(imported)
        graph[name] = targets
    return graph, tops


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def upward(root: Path) -> list[str]:
    """engine/ modules' imports of the packages above it."""
    _, edges = import_graph(root)
    out = []
    for edge in sorted(edges):
        src, dst = edge.split(" -> ")
        if src.split(".")[0] == "engine" and dst.split(".")[0] in ABOVE_ENGINE:
            out.append(edge)
    return out


def test_no_import_cycle() -> None:
    graph, _ = import_graph(ROOT)
    ours = {m: t for m, t in graph.items() if m.split(".")[0] in ("engine", "adapters", "freetoken_agent")}
    assert len(ours) > 100  # the packages were found
    assert cycles(ours) == []


def test_engine_imports_nothing_above_it() -> None:
    assert upward(ROOT) == []


def test_the_checker_finds_a_cycle_and_an_upward_import(tmp_path: Path) -> None:
    files = {
        "engine/__init__.py": "",
        "engine/a.py": "from engine.b import x\n",
        "engine/b.py": "def f():\n    from engine import a\n",
        "engine/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from freetoken_agent.x import y\n",
        "freetoken_agent/__init__.py": "",
        "freetoken_agent/x.py": "from engine.c import z\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    graph, _ = import_graph(tmp_path)
    assert cycles(graph) == [["engine.a", "engine.b"], ["engine.c", "freetoken_agent.x"]]
    assert upward(tmp_path) == ["engine.c -> freetoken_agent.x", "engine.c -> freetoken_agent.x.y"]
