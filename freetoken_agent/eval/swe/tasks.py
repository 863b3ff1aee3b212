"""SWE tasks: loading (built-in, a directory, SWE-bench JSONL), fresh checkouts, and judging by tests.

Contract:
- An `Instance` is the SWE-bench instance shape: `instance_id`, `repo` (a local directory), optional
  `base_commit` (a commit of `repo` when it is a git repository), `problem_statement`, `patch` (the
  reference fix, a unified diff), optional `test_patch` (applied before judging), `FAIL_TO_PASS`
  and `PASS_TO_PASS` (pytest node ids, lists or JSON-encoded lists), and `edits`, the patch as exact
  (path, old text, new text) replacements (`edits_of(patch)`; old text "" creates the file).
- `load_tasks(spec)`: `builtin` (evals/swe/tasks), a directory of `<id>/task.json` + `<id>/repo/`
  (task.json holds `fix` replacements), or a JSONL file of instances. Bad input raises ValueError.
- `checkout(inst, dest)`: a fresh git repository at `dest` holding the task's files at the base
  commit, committed, so `git diff` shows exactly what the client changed.
- `judge(inst, work)`: applies `test_patch`, runs the task's tests with this Python's pytest in
  `work` and returns {success, tests: {id: passed}, output}: success when every FAIL_TO_PASS and
  PASS_TO_PASS test passes.
"""

from __future__ import annotations

import difflib
import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import evals

BUILTIN = Path(evals.__file__).resolve().parent / "swe" / "tasks"
Edit = tuple[str, str, str]


@dataclass(frozen=True)
class Instance:
    instance_id: str
    repo: Path
    problem_statement: str
    patch: str
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...] = ()
    base_commit: str | None = None
    test_patch: str | None = None
    edits: tuple[Edit, ...] = field(default=())

    @property
    def test_files(self) -> list[str]:
        return sorted({t.split("::")[0] for t in (*self.fail_to_pass, *self.pass_to_pass)})


def _ids(v: Any, where: str) -> tuple[str, ...]:
    if isinstance(v, str):
        v = json.loads(v) if v.strip() else []
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise ValueError(f"{where}: test ids must be a list of strings")
    return tuple(v)


def diff_of(repo: Path, edits: list[Edit]) -> str:
    """The unified diff (git style, a/ b/ prefixes) that `edits` make to the files of `repo`."""
    before: dict[str, str] = {}
    after: dict[str, str] = {}
    for path, old, new in edits:
        f = repo / path
        text = after.get(path, before.setdefault(path, f.read_text() if f.exists() else ""))
        if old and text.count(old) != 1:
            raise ValueError(f"{repo}: the fix's old text must occur exactly once in {path}")
        after[path] = text.replace(old, new, 1) if old else new
    out: list[str] = []
    for path in before:
        out += difflib.unified_diff(before[path].splitlines(True), after[path].splitlines(True),
                                    "/dev/null" if not before[path] else f"a/{path}", f"b/{path}")
    return "".join(out)


_HUNK = re.compile(r"^@@ -\d+(?:,\d+)? \+\d+(?:,\d+)? @@")


def edits_of(patch: str) -> tuple[Edit, ...]:
    """Each hunk of a unified diff as an exact replacement: (path, context + removed, context + added)."""
    edits: list[Edit] = []
    path: str | None = None
    old: list[str] = []
    new: list[str] = []
    in_hunk = False

    def flush() -> None:
        if path is not None and in_hunk:
            edits.append((path, "".join(old), "".join(new)))

    for line in patch.splitlines(True):
        if line.startswith("+++ "):
            flush()
            in_hunk = False
            name = line[4:].strip().split("\t")[0]
            path = name[2:] if name.startswith("b/") else name
        elif line.startswith("--- ") or line.startswith("diff ") or line.startswith("index "):
            continue
        elif _HUNK.match(line):
            flush()
            in_hunk, old, new = True, [], []
        elif in_hunk and line.startswith("\\"):
            continue
        elif in_hunk:
            tag, text = line[:1], line[1:]
            if tag in (" ", "-"):
                old.append(text)
            if tag in (" ", "+"):
                new.append(text)
    flush()
    if not edits:
        raise ValueError("the patch has no hunks")
    return tuple(edits)


def _from_dir(d: Path) -> Instance:
    meta = json.loads((d / "task.json").read_text())
    repo = d / "repo"
    fix = [(e["path"], e["old"], e["new"]) for e in meta["fix"]]
    return Instance(meta["instance_id"], repo, meta["problem_statement"], diff_of(repo, fix),
                    _ids(meta["FAIL_TO_PASS"], str(d)), _ids(meta.get("PASS_TO_PASS", []), str(d)),
                    edits=tuple(fix))


def _from_json(obj: dict[str, Any], where: str, base: Path) -> Instance:
    try:
        repo = Path(obj["repo"])
        repo = repo if repo.is_absolute() else base / repo
        if not repo.is_dir():
            raise ValueError(f"{where}: repo {repo} is not a local directory")
        return Instance(str(obj["instance_id"]), repo, str(obj["problem_statement"]), str(obj["patch"]),
                        _ids(obj["FAIL_TO_PASS"], where), _ids(obj.get("PASS_TO_PASS", []), where),
                        obj.get("base_commit") or None, obj.get("test_patch") or None, edits_of(str(obj["patch"])))
    except KeyError as e:
        raise ValueError(f"{where}: missing field {e}") from e


def load_tasks(spec: str, only: list[str] | None = None) -> list[Instance]:
    if spec == "builtin":
        spec = str(BUILTIN)
    p = Path(spec)
    if p.is_dir():
        tasks = [_from_dir(d) for d in sorted(p.iterdir()) if (d / "task.json").is_file()]
    elif p.is_file():
        tasks = []
        for n, line in enumerate(p.read_text().splitlines(), 1):
            if line.strip():
                try:
                    obj = json.loads(line)
                except ValueError as e:
                    raise ValueError(f"{p}:{n}: not JSON ({e})") from e
                tasks.append(_from_json(obj, f"{p}:{n}", p.parent))
    else:
        raise ValueError(f"no tasks at {spec} (builtin, a directory or a JSONL file)")
    if only:
        unknown = set(only) - {t.instance_id for t in tasks}
        if unknown:
            raise ValueError(f"unknown instance ids: {', '.join(sorted(unknown))}")
        tasks = [t for t in tasks if t.instance_id in only]
    if not tasks:
        raise ValueError(f"no tasks in {spec}")
    return tasks


def _git(work: Path, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {"GIT_AUTHOR_NAME": "eval", "GIT_AUTHOR_EMAIL": "eval@localhost", "GIT_COMMITTER_NAME": "eval",
           "GIT_COMMITTER_EMAIL": "eval@localhost", "PATH": "/usr/bin:/bin:/usr/local/bin", "HOME": str(work)}
    return subprocess.run(["git", *args], cwd=work, input=stdin, capture_output=True, text=True, env=env)


def checkout(inst: Instance, dest: Path) -> Path:
    if inst.base_commit:
        r = subprocess.run(["git", "clone", "-q", str(inst.repo), str(dest)], capture_output=True, text=True)
        if r.returncode != 0:
            raise ValueError(f"{inst.instance_id}: cannot clone {inst.repo}: {r.stderr.strip()}")
        if _git(dest, "checkout", "-q", inst.base_commit).returncode != 0:
            raise ValueError(f"{inst.instance_id}: no commit {inst.base_commit} in {inst.repo}")
        shutil.rmtree(dest / ".git")
    else:
        shutil.copytree(inst.repo, dest, ignore=shutil.ignore_patterns(".git", "__pycache__"))
    _git(dest, "init", "-q")
    _git(dest, "add", "-A")
    _git(dest, "commit", "-q", "-m", "base")
    return dest


def test_command(inst: Instance, all_tests: bool = False) -> str:
    files = "" if all_tests else " " + " ".join(inst.test_files)
    return f"{sys.executable} -m pytest -q -p no:cacheprovider{files}"


_RESULT = re.compile(r"^(PASSED|FAILED|ERROR) (\S+)", re.M)


def judge(inst: Instance, work: Path, timeout: float = 300) -> dict[str, Any]:
    if inst.test_patch:
        r = _git(work, "apply", "-", stdin=inst.test_patch)
        if r.returncode != 0:
            return {"success": False, "tests": {}, "output": f"test_patch does not apply: {r.stderr}"}
    ids = [*inst.fail_to_pass, *inst.pass_to_pass]
    try:
        r = subprocess.run([sys.executable, "-m", "pytest", "-rA", "-q", "-p", "no:cacheprovider", *ids], cwd=work,
                           capture_output=True, text=True, timeout=timeout)
        out = r.stdout + r.stderr
    except subprocess.TimeoutExpired:
        return {"success": False, "tests": {}, "output": f"tests ran over {timeout}s"}
    status = {m.group(2): m.group(1) == "PASSED" for m in _RESULT.finditer(out)}
    tests = {t: status.get(t, False) for t in ids}
    return {"success": all(tests.values()), "tests": tests, "output": out[-3000:]}
