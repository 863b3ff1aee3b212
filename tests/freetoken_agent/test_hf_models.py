"""Hugging Face ids: `--model OWNER/NAME` from the local Hugging Face cache without network, and
`freetoken-agent pull` against a stand-in Hub on loopback (`hub_server.FakeHub`, via HF_ENDPOINT).

The cache of the resolution tests is laid out here the way huggingface_hub lays it out
(`models--OWNER--NAME/refs/main`, `snapshots/COMMIT/`), with HF_HUB_OFFLINE=1; `generate` then runs
the demo model found there end to end.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.freetoken_agent.hub_server import COMMIT, FakeHub

REPO = Path(__file__).resolve().parents[2]
BIG = bytes(range(256)) * (11 * 4096)  # 11 MiB: more than one of the hub client's 10 MiB read chunks


def _cli(*args: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    full.update(PYTHONPATH=str(REPO), HF_HUB_DISABLE_TELEMETRY="1", **env)
    return subprocess.run([sys.executable, "-m", "freetoken_agent", *args], capture_output=True, text=True,
                          env=full, cwd=REPO, timeout=timeout)


def _one_line_error(proc: subprocess.CompletedProcess[str], *needles: str) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()  # the hub client's own progress lines may come first
    errors = [ln for ln in lines if ln.startswith("error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0] and "Traceback" not in proc.stderr, proc.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


def lay_out_cache(cache: Path, repo_id: str, files: dict[str, Path | bytes]) -> Path:
    """A Hugging Face cache entry for `repo_id` at `main`: blobs, the snapshot's links, refs/main."""
    root = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = root / "snapshots" / COMMIT
    (root / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(COMMIT)
    for name, content in files.items():
        data = content.read_bytes() if isinstance(content, Path) else content
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    return snapshot


@pytest.fixture(scope="module")
def demo(demo_model: Callable[[str], Path]) -> Path:
    return demo_model("qwen3_moe")


def test_generate_finds_an_id_in_the_cache_offline(demo: Path, tmp_path: Path) -> None:
    cache = tmp_path / "hub"
    snapshot = lay_out_cache(cache, "Qwen/Qwen3-Tiny-A1B", {p.name: p for p in demo.iterdir()})
    proc = _cli("generate", "--model", "Qwen/Qwen3-Tiny-A1B", "--prompt", "hi", "--raw", "--max-tokens", "3",
                "--output-ids", env={"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1",
                                     "FREETOKEN_CACHE_DIR": str(tmp_path / "ft")})
    assert proc.returncode == 0, proc.stderr
    assert len(json.loads(proc.stdout.strip().splitlines()[-1])) == 3
    from freetoken_agent.models import resolve_hf_id

    os.environ.pop("HF_HUB_OFFLINE", None)
    import huggingface_hub.constants as hub

    old = hub.HF_HUB_CACHE
    hub.HF_HUB_CACHE = str(cache)
    try:
        assert resolve_hf_id("Qwen/Qwen3-Tiny-A1B").resolve() == snapshot.resolve()
    finally:
        hub.HF_HUB_CACHE = old


def test_a_missing_id_says_how_to_pull_it(tmp_path: Path) -> None:
    env = {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    _one_line_error(_cli("serve", "--model", "Qwen/Qwen3-30B-A3B", "--device", "cpu", env=env),
                    "Qwen/Qwen3-30B-A3B", "freetoken-agent pull Qwen/Qwen3-30B-A3B", str(tmp_path / "hub"))
    _one_line_error(_cli("generate", "--model", "./no/such/dir", "--prompt", "x", "--device", "cpu", env=env),
                    "no/such/dir", "not found")


def test_a_cached_repo_without_a_tokenizer_names_the_file(tmp_path: Path) -> None:
    cache = tmp_path / "hub"
    snapshot = lay_out_cache(cache, "Owner/NoTok", {"config.json": b'{"model_type": "qwen3_moe"}'})
    _one_line_error(_cli("generate", "--model", "Owner/NoTok", "--prompt", "x", "--device", "cpu",
                         env={"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}),
                    str(snapshot / "tokenizer.json"), "missing")


FILES = {"config.json": b'{"model_type": "qwen3_moe"}', "tokenizer.json": b"{}", "model.safetensors": BIG,
         "gguf/model-Q4_K_M.gguf": b"Q4" * 500, "model-Q8_0.gguf": b"Q8" * 500}


@pytest.fixture
def hub() -> Iterator[FakeHub]:
    server = FakeHub({"Owner/Name": FILES}, drop_after=len(BIG) - 4096)
    server.url = server.start()  # type: ignore[attr-defined]
    try:
        yield server
    finally:
        server.stop()


def _hub_env(hub: FakeHub, cache: Path) -> dict[str, str]:
    return {"HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(cache)}  # type: ignore[attr-defined]


def test_pull_downloads_into_the_cache_resuming_a_broken_transfer(hub: FakeHub, tmp_path: Path) -> None:
    cache = tmp_path / "hub"
    proc = _cli("pull", "Owner/Name", env=_hub_env(hub, cache))
    assert proc.returncode == 0, proc.stderr
    snapshot = Path(proc.stdout.strip().splitlines()[-1].split(": ", 1)[1])
    assert snapshot == cache / "models--Owner--Name" / "snapshots" / COMMIT
    assert {str(p.relative_to(snapshot)) for p in snapshot.rglob("*") if p.is_file()} == set(FILES)
    for name, data in FILES.items():
        assert (snapshot / name).read_bytes() == data, name
    ranges = [r for m, p, r in hub.requests if m == "GET" and p.endswith("/model.safetensors")]
    assert ranges[0] is None and ranges[1] is not None and ranges[1].startswith("bytes=")
    assert int(ranges[1][6:].split("-")[0]) > 0  # the retry asked for the rest, not the whole file
    assert "serve --model Owner/Name" in proc.stderr
    # the same id now resolves offline: the stand-in's tokenizer.json ("{}") is the first thing it cannot read
    out = _cli("generate", "--model", "Owner/Name", "--prompt", "x", "--device", "cpu",
               env={"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"})
    _one_line_error(out, str(snapshot / "tokenizer.json"), "cannot be read")


def test_pull_include_takes_one_quant_and_the_side_files(hub: FakeHub, tmp_path: Path) -> None:
    proc = _cli("pull", "Owner/Name", "--include", "*Q4_K_M*", env=_hub_env(hub, tmp_path / "hub"))
    assert proc.returncode == 0, proc.stderr
    snapshot = Path(proc.stdout.strip().splitlines()[-1].split(": ", 1)[1])
    got = {str(p.relative_to(snapshot)) for p in snapshot.rglob("*") if p.is_file()}
    assert got == {"gguf/model-Q4_K_M.gguf", "config.json", "tokenizer.json"}


def test_a_failed_pull_keeps_what_it_got_and_the_next_run_fetches_the_rest(hub: FakeHub, tmp_path: Path) -> None:
    cache = tmp_path / "hub"
    hub.fail = {"model-Q8_0.gguf"}
    _one_line_error(_cli("pull", "Owner/Name", env=_hub_env(hub, cache)), "Owner/Name", "run it again")
    hub.fail = set()
    hub.requests.clear()
    proc = _cli("pull", "Owner/Name", env=_hub_env(hub, cache))
    assert proc.returncode == 0, proc.stderr
    fetched = {p.split("/resolve/")[1].split("/", 1)[1] for m, p, _ in hub.requests if m == "GET" and "/resolve/" in p}
    assert "model-Q8_0.gguf" in fetched and "model.safetensors" not in fetched


@pytest.mark.parametrize(("args", "needles"), [
    (("Owner/Nope",), ("Owner/Nope", "no such repository")),
    (("Owner/Name", "--revision", "v9"), ("revision v9", "no such revision")),
    (("Owner/Name", "--include", "*Q5_K*"), ("no file matches", "*Q5_K*")),
    (("not-an-id",), ("not-an-id", "OWNER/NAME")),
])
def test_pull_errors_are_one_line(hub: FakeHub, tmp_path: Path, args: tuple[str, ...], needles: tuple[str, ...]) -> None:
    _one_line_error(_cli("pull", *args, env=_hub_env(hub, tmp_path / "hub")), *needles)
    assert not any(p.is_file() for p in (tmp_path / "hub").rglob("*")) or args[0] == "Owner/Name"


def test_pull_with_the_hub_offline_is_one_line(tmp_path: Path) -> None:
    _one_line_error(_cli("pull", "Owner/Name", env={"HF_HUB_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"}),
                    "HF_HUB_OFFLINE")

