"""`evals.chat_templates`: the named templates are taken from the sdist's vendored llama.cpp, checked
against their pinned SHA-256 and cached; a changed or missing file is a clear error."""

from __future__ import annotations

import hashlib
import io
import tarfile
from pathlib import Path

import pytest

from evals import chat_templates as ct


def sdist(path: Path, files: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_extract_check_and_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    good = b"{{ messages[0].content }}\n"
    monkeypatch.setattr(ct, "TEMPLATES", {"A.jinja": hashlib.sha256(good).hexdigest()})
    pkg = "llama_cpp_python-0.3.36/"
    src = sdist(tmp_path / "s.tar.gz", {pkg + ct.MEMBER_DIR + "A.jinja": good,
                                       pkg + "other/A.jinja": b"not this one"})
    cache = tmp_path / "cache"
    assert ct.reference_templates(cache, src) == {"A.jinja": good.decode()}
    src.unlink()  # cached now: the sdist is not needed again
    assert ct.reference_templates(cache) == {"A.jinja": good.decode()}

    bad = sdist(tmp_path / "b.tar.gz", {pkg + ct.MEMBER_DIR + "A.jinja": b"changed"})
    with pytest.raises(ct.TemplateFetchError, match="SHA-256"):
        ct.reference_templates(tmp_path / "c2", bad)
    empty = sdist(tmp_path / "e.tar.gz", {pkg + "README.md": b"x"})
    with pytest.raises(ct.TemplateFetchError, match=r"lacks A\.jinja"):
        ct.reference_templates(tmp_path / "c3", empty)


def test_real_templates_are_pinned() -> None:
    assert len(ct.TEMPLATES) == 11 and all(len(h) == 64 for h in ct.TEMPLATES.values())
