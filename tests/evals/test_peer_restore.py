"""evals/peer/restore.sh on binaries built elsewhere: pieces reassembled and checked, and a binary
whose shared library this machine's loader cannot find gets a wrapper that finds it."""

from __future__ import annotations

import hashlib
import lzma
import os
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESTORE = REPO / "evals" / "peer" / "restore.sh"


def _cc() -> str:
    return shutil.which("cc") or shutil.which("gcc") or "cc"


def _export(binary: Path, out: Path, piece: int = 1000) -> None:
    """Write binary as build.sh --export does: xz, split in pieces, a sha256 list."""
    out.mkdir(parents=True)
    data = lzma.compress(binary.read_bytes())
    for i in range(0, len(data), piece):
        (out / f"{binary.name}.xz.part-{i // piece:02d}").write_bytes(data[i : i + piece])
    digest = hashlib.sha256(binary.read_bytes()).hexdigest()
    (out / "peer-bin.sha256").write_text(f"{digest}  {binary.name}\n")


def _build(tmp: Path) -> tuple[Path, Path]:
    """A tool linked against libans.so.1, the library then moved where the loader does not look."""
    (tmp / "l.c").write_text("int answer(void) { return 42; }\n")
    (tmp / "m.c").write_text(
        '#include <stdio.h>\nint answer(void);\nint main(int c, char** v) { printf("%d %d\\n", answer(), c); return 0; }\n'
    )
    cc = _cc()
    subprocess.run(
        [cc, "-shared", "-fPIC", "-o", "libans.so.1", "l.c", "-Wl,-soname,libans.so.1"], cwd=tmp, check=True
    )
    os.symlink("libans.so.1", tmp / "libans.so")
    subprocess.run([cc, "-o", "tool", "m.c", "-L.", "-lans"], cwd=tmp, check=True)
    lib = tmp / "lib"
    lib.mkdir()
    (tmp / "libans.so.1").rename(lib / "libans.so.1")
    (tmp / "libans.so").unlink()
    return tmp / "tool", lib


def _restore(pieces: Path, dest: Path, **env: str) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "PYTHON": "/nonexistent-python", **env}
    full.pop("LD_LIBRARY_PATH", None)
    return subprocess.run(
        ["bash", str(RESTORE), str(pieces), str(dest)], capture_output=True, text=True, env=full
    )


def test_wrapper_finds_the_library(tmp_path: Path) -> None:
    tool, lib = _build(tmp_path)
    _export(tool, tmp_path / "exp")
    dest = tmp_path / "bin"
    res = _restore(tmp_path / "exp", dest, PEER_LIB_DIRS=f"{tmp_path}/nowhere:{lib}")
    assert res.returncode == 0, res.stderr
    assert f"LD_LIBRARY_PATH={lib}" in res.stdout
    assert (dest / "tool.bin").read_bytes() == tool.read_bytes()
    run = subprocess.run(
        [str(dest / "tool"), "a", "b"],
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"},
    )
    assert run.stdout.split() == ["42", "3"]  # the real binary ran, with its arguments


def test_missing_library_fails_with_its_name(tmp_path: Path) -> None:
    tool, _ = _build(tmp_path)
    _export(tool, tmp_path / "exp")
    res = _restore(tmp_path / "exp", tmp_path / "bin", PEER_LIB_DIRS=str(tmp_path / "nowhere"))
    assert res.returncode != 0
    assert "libans.so.1" in res.stderr
    assert not (tmp_path / "bin" / "tool").exists()  # nothing a caller could mistake for a working binary


def test_self_contained_binary_is_not_wrapped(tmp_path: Path) -> None:
    (tmp_path / "s.c").write_text('#include <stdio.h>\nint main(void) { puts("ok"); return 0; }\n')
    subprocess.run([_cc(), "-o", "plain", "s.c"], cwd=tmp_path, check=True)
    _export(tmp_path / "plain", tmp_path / "exp")
    res = _restore(tmp_path / "exp", tmp_path / "bin")
    assert res.returncode == 0, res.stderr
    assert not (tmp_path / "bin" / "plain.bin").exists()
    assert (tmp_path / "bin" / "plain").read_bytes() == (tmp_path / "plain").read_bytes()


def test_checksum_mismatch_fails(tmp_path: Path) -> None:
    tool, _ = _build(tmp_path)
    _export(tool, tmp_path / "exp")
    (tmp_path / "exp" / "peer-bin.sha256").write_text(f"{'0' * 64}  tool\n")
    res = _restore(tmp_path / "exp", tmp_path / "bin")
    assert res.returncode != 0
    assert "sha256" in res.stderr
    assert not (tmp_path / "bin" / "tool").exists()
