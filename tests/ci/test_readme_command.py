"""The README's test command is what CI runs (`.ci/run`), and it type-checks and lints before the tests."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _command(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if "pytest" in ln and ln.strip().startswith("python3 -m venv")]
    assert len(lines) == 1, lines
    return lines[0]


def test_ci_runs_the_readme_test_command() -> None:
    readme = _command((REPO / "README.md").read_text())
    ci = _command((REPO / ".ci/run").read_text())
    assert readme == ci
    for step in ("ruff check .", "mypy", "pytest -q"):
        assert step in readme, step
