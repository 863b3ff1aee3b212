"""`.ci/check_install.py`: the README's install lines are read as pip reads them, and a conflict among
their requirements fails the check, with no configuration of this machine taking part.

The resolutions run against a package index written here (tiny wheels on disk, `file://`), so the
test needs no network; CI runs the same script against PyPI itself (`.ci/run`).
"""

from __future__ import annotations

import importlib.util
import sys
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_install", REPO / ".ci" / "check_install.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


ci = _load()


def _wheel(wheels: Path, name: str, version: str, requires: tuple[str, ...] = ()) -> None:
    dist = f"{name.replace('-', '_')}-{version}"
    path = wheels / f"{dist}-py3-none-any.whl"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{dist}.dist-info/METADATA", meta)
        z.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}.dist-info/RECORD", "")


def _index(root: Path, packages: dict[str, list[tuple[str, tuple[str, ...]]]]) -> str:
    """A PEP 503 index under `root` holding `packages` (name -> [(version, requires)]); its URL."""
    wheels = root / "wheels"
    wheels.mkdir(parents=True)
    for name, versions in packages.items():
        links = []
        for version, requires in versions:
            _wheel(wheels, name, version, requires)
            file = f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
            links.append(f'<a href="../../wheels/{file}">{file}</a>')
        page = root / "simple" / name
        page.mkdir(parents=True)
        (page / "index.html").write_text("<html><body>" + "".join(links) + "</body></html>")
    (root / "simple" / "index.html").write_text(
        "<html><body>" + "".join(f'<a href="{n}/">{n}</a>' for n in packages) + "</body></html>")
    return (root / "simple").as_uri()


README = """# demo

```bash
# 1. serve
python3 -m venv .venv && .venv/bin/pip install ft-a==1.0 && .venv/bin/pip install -q ft-b==2.0 && run
# 2. tests
python3 -m venv .venv && .venv/bin/pip install ft-a==1.0 && .venv/bin/pip install -e '.[test]'
```

```bash
.venv/bin/pip install ft-a==1.0 --index-url https://example.invalid/cpu  # the CPU build
```

```python
pip install not-a-shell-line
```
"""


def test_install_lines_read_each_step_of_each_bash_line() -> None:
    lines = ci.install_lines(README)
    assert [[r.text for r in line.requirements] for line in lines] == [
        ["ft-a==1.0", "ft-b==2.0"], ["ft-a==1.0", ".[test]"], ["ft-a==1.0"]]
    assert [r.editable for r in lines[1].requirements] == [False, True]
    assert lines[1].requirements[1].extras == {"test"}
    assert lines[2].other_indexes == ["https://example.invalid/cpu"]
    # the CPU line's set is held by the others; the two commands differ, so both are resolved
    assert [line.text for line in ci.requirement_sets(lines)] == [lines[0].text, lines[1].text]


def test_a_set_held_by_another_with_more_extras_is_resolved_once() -> None:
    text = "```bash\npip install x==1 -e .\npip install x==1 -e '.[test]'\npip install -e '.[test]' x==1\n```\n"
    lines = ci.install_lines(text)
    assert [line.text for line in ci.requirement_sets(lines)] == [lines[1].text]


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _index(tmp_path_factory.mktemp("index"), {
        "ft-a": [("1.0", ("ft-b==1.0",))],
        "ft-b": [("1.0", ()), ("2.0", ())],
    })


def test_resolve_reports_versions_and_fails_on_a_conflict(index: str, tmp_path: Path) -> None:
    good = ci.resolve([ci._requirement("ft-a==1.0", False)], index, tmp_path)
    assert good.ok, good.output
    assert good.versions == {"ft-a": "1.0", "ft-b": "1.0"}
    bad = ci.resolve([ci._requirement("ft-a==1.0", False), ci._requirement("ft-b==2.0", False)], index, tmp_path)
    assert not bad.ok
    assert "ft-b" in bad.output and "conflict" in bad.output.lower()


def test_the_machines_pip_configuration_takes_no_part(index: str, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    other = _index(tmp_path / "other", {"ft-c": [("1.0", ())]})
    conf = tmp_path / "pip.conf"
    conf.write_text(f"[global]\nextra-index-url = {other}\n")
    for name, value in (("PIP_EXTRA_INDEX_URL", other), ("PIP_FIND_LINKS", str(tmp_path / "other" / "wheels")),
                        ("PIP_CONFIG_FILE", str(conf)), ("PIP_INDEX_URL", other)):
        monkeypatch.setenv(name, value)
    assert not ci.resolve([ci._requirement("ft-c==1.0", False)], index, tmp_path).ok
    assert ci.resolve([ci._requirement("ft-c==1.0", False)], other, tmp_path).ok


def test_main_fails_on_the_conflicting_line(index: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("```bash\npip install ft-a==1.0 && pip install ft-b==2.0\n```\n")
    assert ci.main(["--readme", str(readme), "--index-url", index]) == 1
    assert "FAILED" in capsys.readouterr().out
    readme.write_text("```bash\npip install ft-a==1.0 && pip install ft-b==1.0\n```\n")
    assert ci.main(["--readme", str(readme), "--index-url", index]) == 0
    assert "ft-a 1.0, ft-b 1.0" in capsys.readouterr().out
    readme.write_text("no commands\n")
    assert ci.main(["--readme", str(readme), "--index-url", index]) == 2


def test_ci_runs_the_readme_test_command() -> None:
    readme_test = next(line.text for line in ci.install_lines((REPO / "README.md").read_text())
                       if "pytest" in line.text)
    ci_run = (REPO / ".ci" / "run").read_text()
    assert readme_test in ci_run
    assert ".ci/check_install.py" in ci_run
