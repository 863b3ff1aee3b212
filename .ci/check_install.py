"""Resolve the README's install commands against the public package index, as a new user's pip would.

Contract: `python .ci/check_install.py [--readme README.md] [--index-url URL]` reads every line of the
README's ```bash blocks that runs `pip install`, and for each such line gathers the requirements of
all its `pip install` steps (joined by `&&`) into one set: what the user's environment holds at the
end of that line. Each distinct set (a set whose requirements another set already holds, with at
least the same extras, is not resolved twice) goes through `pip install --dry-run --ignore-installed
--report` with `--index-url` (default: PyPI) as the only source: pip runs `--isolated` with
`PIP_CONFIG_FILE` set to the null device, so no configuration file, `PIP_*` variable, local wheel
store or extra index of the machine takes part. A step's own `--index-url` (PyPI's CPU builds of
torch) is replaced by that index: the same pins must hold there. TLS trust (`PIP_CERT`,
`SSL_CERT_FILE`, `REQUESTS_CA_BUNDLE`) is kept, since it names no package source.

Exit status 0 when every set resolves (the resolved versions of the pinned packages are printed),
1 when one does not (pip's conflict is printed), 2 when the README has no install command.
`install_lines(text)`, `requirement_sets(lines)` and `resolve(reqs, index_url, cwd)` are the parts;
tests/ci/test_check_install.py runs them against a local index.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

PYPI = "https://pypi.org/simple"
REPO = Path(__file__).resolve().parents[1]
# pip install options that take a value (the value is not a requirement)
_VALUE_OPTIONS = {"-i", "--index-url", "--extra-index-url", "-f", "--find-links", "-c", "--constraint",
                  "-r", "--requirement", "--target", "-t", "--prefix", "--root", "--platform",
                  "--python-version", "--implementation", "--abi", "--report", "--progress-bar", "--log",
                  "--timeout", "--retries", "--cert", "--client-cert", "--trusted-host", "--proxy", "--src",
                  "--upgrade-strategy", "--config-settings", "-C", "--no-binary", "--only-binary"}
_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?")


@dataclass(frozen=True)
class Requirement:
    """One requirement as pip receives it: `text` is passed on; `key` and `extras` compare sets."""

    text: str
    key: str
    extras: frozenset[str] = frozenset()
    editable: bool = False

    def args(self) -> list[str]:
        return ["-e", self.text] if self.editable else [self.text]


@dataclass
class InstallLine:
    """One README line: its text and its requirements, in order of appearance."""

    text: str
    requirements: list[Requirement] = field(default_factory=list)
    other_indexes: list[str] = field(default_factory=list)


def _requirement(text: str, editable: bool) -> Requirement:
    if editable or text.startswith((".", "/")):
        path, _, extras = text.partition("[")
        names = frozenset(e.strip() for e in extras.rstrip("]").split(",") if e.strip())
        return Requirement(text, f"path:{Path(path or '.').as_posix()}", names, editable)
    m = _NAME.match(text)
    if not m:
        raise ValueError(f"cannot read the requirement {text!r}")
    names = frozenset(e.strip().lower() for e in (m.group(2) or "[]")[1:-1].split(",") if e.strip())
    return Requirement(text, re.sub(r"[-_.]+", "-", m.group(1)).lower() + text[m.end():].strip(), names)


def _bash_lines(text: str) -> list[str]:
    lines, inside = [], False
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("```"):
            inside = not inside and stripped[3:].strip() in ("bash", "sh", "shell", "console")
            continue
        if inside and stripped and not stripped.startswith("#"):
            lines.append(stripped.split(" #", 1)[0].strip())
    return lines


def install_lines(readme_text: str) -> list[InstallLine]:
    """The README's bash lines that run `pip install`, each with the requirements of its steps."""
    out = []
    for line in _bash_lines(readme_text):
        if not re.search(r"\bpip3? install\b", line):
            continue
        item = InstallLine(line)
        for step in re.split(r"&&|;", line):
            words = shlex.split(step)
            at = next((i for i, w in enumerate(words[:-1]) if w.endswith(("pip", "pip3")) and words[i + 1] == "install"),
                      None)
            if at is None:
                continue
            args = iter(words[at + 2:])
            for word in args:
                if word in ("-e", "--editable"):
                    item.requirements.append(_requirement(next(args), editable=True))
                elif word in ("-i", "--index-url"):
                    item.other_indexes.append(next(args))
                elif word in _VALUE_OPTIONS:
                    next(args)
                elif word.startswith("-"):
                    continue
                else:
                    item.requirements.append(_requirement(word, editable=False))
        out.append(item)
    return out


def _covers(big: list[Requirement], small: list[Requirement]) -> bool:
    return all(any(b.key == s.key and b.extras >= s.extras for b in big) for s in small)


def requirement_sets(lines: list[InstallLine]) -> list[InstallLine]:
    """The lines whose requirement sets must be resolved: each distinct set once, none that another
    line's set already holds."""
    keep: list[InstallLine] = []
    for i, line in enumerate(lines):
        held = any(j != i and _covers(other.requirements, line.requirements)
                   and (j < i or not _covers(line.requirements, other.requirements))
                   for j, other in enumerate(lines))
        if line.requirements and not held:
            keep.append(line)
    return keep


def _clean_env(home: str) -> dict[str, str]:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": home, "PIP_CONFIG_FILE": os.devnull,
           "LANG": "C.UTF-8", "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}
    cert = next((os.environ[k] for k in ("PIP_CERT", "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE") if os.environ.get(k)), None)
    if cert:
        env["PIP_CERT"] = cert  # build-dependency installs run pip again, without --isolated
    return env


@dataclass
class Resolution:
    ok: bool
    versions: dict[str, str]
    output: str


def resolve(reqs: list[Requirement], index_url: str = PYPI, cwd: Path = REPO,
            python: str = sys.executable, timeout: float = 1200) -> Resolution:
    """`pip install --dry-run --report` of `reqs` from `index_url` alone, with no machine configuration."""
    with tempfile.TemporaryDirectory(prefix="ft-resolve-") as tmp:
        report = Path(tmp) / "report.json"
        env = _clean_env(tmp)
        cmd = [python, "-m", "pip", "--isolated", "install", "--dry-run", "--ignore-installed", "--quiet",
               "--report", str(report), "--index-url", index_url]
        if env.get("PIP_CERT"):
            cmd += ["--cert", env["PIP_CERT"]]
        for r in reqs:
            cmd += r.args()
        try:
            run = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return Resolution(False, {}, f"pip did not finish in {timeout:.0f} s")
        output = (run.stdout + run.stderr).strip()
        if run.returncode != 0 or not report.exists():
            return Resolution(False, {}, output)
        data = json.loads(report.read_text())
        versions = {item["metadata"]["name"].lower(): item["metadata"]["version"] for item in data.get("install", [])}
        return Resolution(True, versions, output)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--readme", type=Path, default=REPO / "README.md")
    ap.add_argument("--index-url", default=PYPI, help=f"the only package source (default {PYPI})")
    ap.add_argument("--python", default=sys.executable, help="the interpreter whose pip resolves (default: this one)")
    args = ap.parse_args(argv)
    lines = install_lines(args.readme.read_text(encoding="utf-8"))
    if not lines:
        print(f"error: {args.readme}: no `pip install` line in its bash blocks", file=sys.stderr)
        return 2
    failed = 0
    for line in requirement_sets(lines):
        reqs = " ".join(r.text for r in line.requirements)
        note = f" (its {', '.join(line.other_indexes)} replaced by {args.index_url})" if line.other_indexes else ""
        print(f"resolving {reqs}{note} ...", flush=True)
        result = resolve(line.requirements, args.index_url, args.readme.resolve().parent, args.python)
        if result.ok:
            pinned = [r.key.split("=")[0].split("[")[0] for r in line.requirements if not r.key.startswith("path:")]
            shown = {k: v for k, v in result.versions.items() if k in {*pinned, "torch", "triton", "transformers"}}
            print(f"  ok: {len(result.versions)} packages; " + ", ".join(f"{k} {v}" for k, v in sorted(shown.items())))
        else:
            failed += 1
            print(f"  FAILED: the README line `{line.text}` does not resolve from {args.index_url} alone:")
            print("\n".join("    " + ln for ln in result.output.splitlines()[-25:]))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
