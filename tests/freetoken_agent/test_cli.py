"""The command line as a user runs it: demo model, generate, and one-line errors on bad input.

Runs the real `python -m freetoken_agent` in a subprocess (the seeded-sampling and error cases call
its `main` in the test process, which is what that subprocess runs). Checks that `generate` streams the same
greedy tokens as `transformers` on the demo model, and that every broken-model or bad-argument
case exits non-zero with a single `error:` line naming the culprit and no traceback.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[2]
RunMain = Callable[..., subprocess.CompletedProcess[str]]


def run_cli(*args: str, cache: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "FREETOKEN_CACHE_DIR": str(cache), "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "freetoken_agent", *args], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=300)


@pytest.fixture
def run_main(cache: Path, capsys: pytest.CaptureFixture[str],
             monkeypatch: pytest.MonkeyPatch) -> RunMain:
    """`main(args)` in this process (no interpreter start per case): its exit status and what it wrote
    to stdout and stderr, as `run_cli` gives them; an exception it lets escape fails the test (the
    subprocess would print a traceback)."""
    from freetoken_agent.cli import main

    monkeypatch.setenv("FREETOKEN_CACHE_DIR", str(cache))

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        capsys.readouterr()
        try:
            code = main(list(args))
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(["freetoken-agent", *args], code, out, err)

    return run


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory, cache: Path) -> Path:
    out = tmp_path_factory.mktemp("demo") / "qwen3_moe"
    proc = run_cli("demo-model", str(out), "--arch", "qwen3_moe", cache=cache)
    assert proc.returncode == 0, proc.stderr
    return out


def _broken_copy(demo: Path, dst: Path) -> Path:
    shutil.copytree(demo, dst)
    return dst


def test_demo_model_layout_loads_in_transformers(demo: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo)
    model = AutoModelForCausalLM.from_pretrained(demo)
    assert model.config.model_type == "qwen3_moe"
    assert tok.convert_tokens_to_ids("<|im_end|>") in json.loads((demo / "config.json").read_text()).values()


def test_generate_streams_the_reference_greedy_tokens(demo: Path, cache: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    proc = run_cli("generate", "--model", str(demo), "--prompt", "def add(a, b):", "--raw", "--max-tokens", "12",
                   "--output-ids", cache=cache)
    assert proc.returncode == 0, proc.stderr
    ids = json.loads(proc.stdout.strip().splitlines()[-1])
    tok = AutoTokenizer.from_pretrained(demo)
    model = AutoModelForCausalLM.from_pretrained(demo)
    prompt = tok("def add(a, b):", return_tensors="pt").input_ids
    ref = model.generate(prompt, max_new_tokens=12, do_sample=False)[0, prompt.shape[1]:].tolist()  # type: ignore[misc]
    assert ids == ref
    assert proc.stdout.startswith(str(tok.decode(ids))[:5])


def test_generate_default_demo_uses_cached_copy(cache: Path) -> None:
    proc = run_cli("generate", "--prompt", "hello", "--max-tokens", "4", "--output-ids", cache=cache)
    assert proc.returncode == 0, proc.stderr
    assert 1 <= len(json.loads(proc.stdout.strip().splitlines()[-1])) <= 4
    assert (cache / "demo-qwen3_5_moe-v4" / "config.json").exists()


def test_sampling_is_seeded(demo: Path, run_main: RunMain) -> None:
    common = ("generate", "--model", str(demo), "--prompt", "x", "--max-tokens", "8", "--temperature", "1.0",
              "--output-ids")
    a = run_main(*common, "--seed", "1")
    b = run_main(*common, "--seed", "1")
    c = run_main(*common, "--seed", "2")
    assert a.returncode == b.returncode == c.returncode == 0, (a.stderr, c.stderr)
    last = lambda p: json.loads(p.stdout.strip().splitlines()[-1])  # noqa: E731
    assert last(a) == last(b)
    assert last(a) != last(c)


def _assert_one_line_error(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error:")
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_missing_safetensors(demo: Path, run_main: RunMain, tmp_path: Path) -> None:
    bad = _broken_copy(demo, tmp_path / "m")
    (bad / "model.safetensors").unlink()
    _assert_one_line_error(run_main("generate", "--model", str(bad), "--prompt", "hi"), "safetensors")


def test_truncated_safetensors(demo: Path, run_main: RunMain, tmp_path: Path) -> None:
    bad = _broken_copy(demo, tmp_path / "m")
    path = bad / "model.safetensors"
    with path.open("r+b") as f:
        f.truncate(path.stat().st_size // 2)
    _assert_one_line_error(run_main("generate", "--model", str(bad), "--prompt", "hi"),
                           "model.safetensors", "truncated")


def _rewrite(demo: Path, dst: Path, edit) -> Path:  # type: ignore[no-untyped-def]
    bad = _broken_copy(demo, dst)
    tensors = load_file(str(bad / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(bad / "model.safetensors"))
    return bad


def test_missing_tensor(demo: Path, run_main: RunMain, tmp_path: Path) -> None:
    name = "model.layers.1.self_attn.k_proj.weight"
    bad = _rewrite(demo, tmp_path / "m", lambda t: t.pop(name))
    _assert_one_line_error(run_main("generate", "--model", str(bad), "--prompt", "hi"), name)


def test_shape_mismatch(demo: Path, run_main: RunMain, tmp_path: Path) -> None:
    name = "model.layers.2.mlp.experts.3.up_proj.weight"
    bad = _rewrite(demo, tmp_path / "m", lambda t: t.__setitem__(name, torch.zeros(5, 7)))
    _assert_one_line_error(run_main("generate", "--model", str(bad), "--prompt", "hi"), name, "[5, 7]")


def test_unknown_model_type(demo: Path, run_main: RunMain, tmp_path: Path) -> None:
    bad = _broken_copy(demo, tmp_path / "m")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["model_type"] = "llama_moe_9000"
    (bad / "config.json").write_text(json.dumps(cfg))
    _assert_one_line_error(run_main("generate", "--model", str(bad), "--prompt", "hi"),
                           "model_type", "llama_moe_9000")


def test_missing_config_field(demo: Path, run_main: RunMain, tmp_path: Path) -> None:
    bad = _broken_copy(demo, tmp_path / "m")
    cfg = json.loads((bad / "config.json").read_text())
    del cfg["num_experts_per_tok"]
    (bad / "config.json").write_text(json.dumps(cfg))
    _assert_one_line_error(run_main("generate", "--model", str(bad), "--prompt", "hi"),
                           "num_experts_per_tok")


@pytest.mark.parametrize("args, needle", [
    (("--prompt", ""), "prompt"),
    (("--prompt", "hi", "--max-tokens", "0"), "--max-tokens"),
    (("--prompt", "hi", "--max-tokens", "-3"), "--max-tokens"),
    (("--prompt", "hi", "--temperature", "-1"), "--temperature"),
    (("--prompt", "hi", "--model", "/nonexistent/model"), "/nonexistent/model"),
])
def test_bad_arguments(demo: Path, run_main: RunMain, args: tuple[str, ...], needle: str) -> None:
    model = () if "--model" in args else ("--model", str(demo))
    _assert_one_line_error(run_main("generate", *model, *args), needle)


def test_generate_renders_like_the_server(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the chat template, the reply is split as the server splits it: the think block on
    stderr after `thinking:`, the answer on stdout, and no control token printed anywhere."""
    from adapters.parsers import ContentDelta, ReasoningDelta, create_parser, merge_events
    from freetoken_agent.models import resolve_model
    from freetoken_agent.tokenizer import ChatTokenizer

    proc = run_cli("generate", "--prompt", "hello there", "--max-tokens", "48", "--output-ids", "--device", "cpu",
                   cache=cache)
    assert proc.returncode == 0, proc.stderr
    *text, last = proc.stdout.rstrip("\n").split("\n")
    ids = json.loads(last)
    monkeypatch.setenv("FREETOKEN_CACHE_DIR", str(cache))
    tok = ChatTokenizer.from_dir(resolve_model("demo"))
    assert tok.token_to_id("</think>") in ids  # the demo closes its reasoning within 48 tokens
    parser = create_parser("qwen3_5", None, starts_in_reasoning=True)
    events = merge_events(parser.feed(tok.decode(ids, skip_special_tokens=True)) + parser.finish())
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    assert "\n".join(text) == content
    if reasoning:  # (the demo often closes its think block at once: then nothing goes to stderr)
        assert f"thinking: {reasoning}\n" in proc.stderr
    else:
        assert "thinking:" not in proc.stderr
    for control in ("<|im_end|>", "</think>", "<think>", "<|endoftext|>"):
        assert control not in proc.stdout and control not in proc.stderr
    assert "device: cpu" in proc.stderr
