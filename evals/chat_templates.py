"""The chat templates real checkpoints ship, fetched for the tests from a PyPI package that vendors them.

Contract: `reference_templates(cache)` returns {name: template source} for every name in
`TEMPLATES`, reading `cache` (default `.cache/templates` at the repository root, gitignored) and
filling it first when a file is missing or its SHA-256 differs: the sdist of
`llama-cpp-python==0.3.36` (PyPI, about 76 MB) is downloaded with pip into a temporary directory,
the named `.jinja` files of its vendored llama.cpp (`vendor/llama.cpp/models/templates/`, copies of
the checkpoints' own chat templates) are extracted, checked against their pinned SHA-256 and
written to `cache`; the sdist is deleted. A failed download or a changed file is a
`TemplateFetchError` naming the cause. Nothing here is part of the server; the templates are never
committed. `python -m evals.chat_templates [--cache DIR]` fills the cache (CI runs it before the
tests) and prints its path.
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

SDIST = "llama-cpp-python==0.3.36"
MEMBER_DIR = "vendor/llama.cpp/models/templates/"
DEFAULT_CACHE = Path(__file__).resolve().parent.parent / ".cache" / "templates"

# file name -> SHA-256 of the template in that sdist
TEMPLATES: dict[str, str] = {
    "GLM-4.6.jinja": "8804f445c761b9f259e3c1126a579d481a22ca09b2a3d32bcc4eb91bc36e0301",
    "GLM-4.7-Flash.jinja": "d63ad536c3c81880043e22ec7fd08db42b4d8fb7c89c7138bc562bfa25281375",
    "deepseek-ai-DeepSeek-V3.1.jinja": "d9f5f351b276cf9e81d009db08830db7d38e94927aecd09a7beb43e2aafee94e",
    "deepseek-ai-DeepSeek-V3.2.jinja": "8e5a13fcc4bdd4d943311fc59064b805770fdeddfccbd7f1c252cc16e8acaf3d",
    "Kimi-K2-Instruct.jinja": "1d396d5b128cdb9b2a4ef73434fa08d31c75604a11daa77bcb4b622d32dddd41",
    "moonshotai-Kimi-K2.jinja": "9fcc72b7c248a72020c81f70bb652f3094d18a750c93ca35dfcb3cf5fe23ff53",
    "Kimi-K2-Thinking.jinja": "2f6c593d50682612ccc3229f043ecd1bdeb5a32fdfe86ca2158203a61d885817",
    "Qwen3-Coder.jinja": "d287fb2edf144207f868ae1b282755dc19db2a3f1c5b3a3d57e9e5abffa98392",
    "Qwen-Qwen3-0.6B.jinja": "87a2728cb8dc9fe424d624542f6060ec05a1d285ebbec578bb078900e33396b5",
    "Qwen3.5-4B.jinja": "a4aee8afcf2e0711942cf848899be66016f8d14a889ff9ede07bca099c28f715",
    "openai-gpt-oss-120b.jinja": "a4c9919cbbd4acdd51ccffe22da049264b1b73e59055fa58811a99efbd7c8146",
}


class TemplateFetchError(RuntimeError):
    pass


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _cached(cache: Path) -> dict[str, str] | None:
    out = {}
    for name, digest in TEMPLATES.items():
        path = cache / name
        if not path.is_file() or _sha256(path.read_bytes()) != digest:
            return None
        out[name] = path.read_text(encoding="utf-8")
    return out


def _download(dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "-q", "-d", str(dest), SDIST]
    done = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(dest.glob("*.tar.gz"))
    if done.returncode or not found:
        raise TemplateFetchError(f"`{' '.join(cmd)}` failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}")
    return found[0]


def _extract(sdist: Path, cache: Path) -> None:
    wanted = set(TEMPLATES)
    cache.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist, "r:gz") as tar:
        for member in tar:
            head, _, name = member.name.rpartition("/")
            if name not in wanted or not (head + "/").endswith(MEMBER_DIR) or not member.isfile():
                continue
            handle = tar.extractfile(member)
            assert handle is not None
            data = handle.read()
            if _sha256(data) != TEMPLATES[name]:
                raise TemplateFetchError(f"{name} in {sdist.name} has SHA-256 {_sha256(data)}, expected "
                                         f"{TEMPLATES[name]}")
            (cache / name).write_bytes(data)
            wanted.discard(name)
    if wanted:
        raise TemplateFetchError(f"{sdist.name} lacks {', '.join(sorted(wanted))} under {MEMBER_DIR}")


def reference_templates(cache: Path = DEFAULT_CACHE, sdist: Path | None = None) -> dict[str, str]:
    """{file name: template source}, fetched into `cache` first if needed (from `sdist` when given)."""
    found = _cached(cache)
    if found is not None:
        return found
    if sdist is not None:
        _extract(sdist, cache)
    else:
        with tempfile.TemporaryDirectory(prefix="ft-sdist-") as tmp:
            _extract(_download(Path(tmp)), cache)
    found = _cached(cache)
    if found is None:
        raise TemplateFetchError(f"templates missing from {cache} after the fetch")
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="where the templates are kept")
    ap.add_argument("--sdist", type=Path, default=None, help=f"a local copy of the {SDIST} sdist (else pip)")
    args = ap.parse_args(argv)
    reference_templates(args.cache, args.sdist)
    print(args.cache)
    return 0


if __name__ == "__main__":
    sys.exit(main())
