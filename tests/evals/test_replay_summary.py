"""The side-by-side table (evals/gpu/replay_summary.py) on result.json files a real `eval replay` wrote:
the CLI against the demo server on loopback, forced (`ours`) and with `--no-force` (`peer`, as
llama-server is run), two traces for `ours` and one for `peer` (the other cut, as a timeout leaves
it); every number of the printed table equals the result.json field it comes from."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pytest

from evals.gpu import replay_summary
from freetoken_agent.cli import main


def _trace(tmp: Path, name: str) -> Path:
    m1 = [{"role": "system", "content": "You answer briefly. " * 30}, {"role": "user", "content": f"Hi from {name}."}]
    m2 = [*m1, {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "And again?"}]
    reqs = [{"path": "/v1/chat/completions", "headers": {"x-session-affinity": f"summary-{name}"},
             "response": {"reasoning": "A short greeting will do here.", "tool_calls": [],
                          "content": "Hello, here is a reply of a dozen words or so."},
             "body": {"model": "x", "stream": True, "max_tokens": 16, "messages": m}} for m in (m1, m2)]
    p = tmp / f"{name}.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in reqs))
    return p


def _cells(md: str) -> dict[tuple[str, str], dict[str, str]]:
    lines = [ln for ln in md.splitlines() if ln.startswith("| ")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    out = {}
    for ln in lines[1:]:
        cells = [c.strip() for c in ln.strip("|").split("|")]
        out[(cells[0], cells[1])] = dict(zip(head, cells, strict=False))
    return out


def _num(cell: str) -> float | None:
    return None if cell == "-" else float(cell)


def test_table_equals_the_result_files(demo_server: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "res"
    a, b = _trace(tmp_path, "alpha"), _trace(tmp_path, "beta")
    for system, traces, force in (("ours", (a, b), []), ("peer", (a,), ["--no-force"])):
        for t in traces:
            assert main(["eval", "replay", str(t), "--base-url", demo_server, "--max-tokens", "8",
                         "--out", str(root / system / t.stem), *force]) == 0
    (root / "peer" / "cmd.txt").write_text("llama-server -m x.gguf\n")
    (root / "ours" / "gpu_mem.txt").write_text("500\n1700\n1600\n")
    capsys.readouterr()
    assert replay_summary.main([str(root), "--json", str(tmp_path / "rows.json")]) == 0
    md = capsys.readouterr().out
    cells = _cells(md)
    assert set(cells) == {("alpha", "ours"), ("alpha", "peer"), ("beta", "ours"), ("beta", "peer")}
    results: dict[tuple[str, str], dict[str, Any]] = {
        (t, s): json.loads((root / s / t / "result.json").read_text()) for t, s in cells if (root / s / t).is_dir()}
    assert results[("alpha", "peer")]["forced"] is False and results[("alpha", "ours")]["forced"] is True
    for (trace, system), res in results.items():
        run, row = res["runs"][0], cells[(trace, system)]
        assert run["run"] == trace and run["failed"] == 0
        ttfts = [t["ttft_ms"] for t in res["turns"] if t["status"] == 200 and t["ttft_ms"] is not None]
        assert len(ttfts) == 2
        assert int(row["requests"]) == run["requests"] and int(row["failed"]) == 0
        assert _num(row["worst_ttft_s"]) == round(run["worst_ttft_ms"] / 1000, 2)
        assert _num(row["mean_ttft_s"]) == round(run["mean_ttft_ms"] / 1000, 2)
        assert _num(row["median_ttft_s"]) == round(statistics.median(ttfts) / 1000, 2)
        assert _num(row["decode_tps"]) == run["mean_decode_tps"]
        assert _num(row["baseline_tps"]) == res["baseline_decode_tps"] > 0
        assert _num(row["decode_drop"]) == run["decode_drop"]
        assert (row["decode_drop"] == "-") == (run["decode_drop"] is None)
        assert run["decode_drop"] is not None or not res["forced"]  # forced replies: a decode rate
        assert _num(row["recomputed"]) == run["recomputed_tokens"]
    ours_w = results[("alpha", "ours")]["runs"][0]["worst_ttft_ms"]
    peer_w = results[("alpha", "peer")]["runs"][0]["worst_ttft_ms"]
    assert _num(cells[("alpha", "peer")]["worst_vs_ours"]) == round(round(peer_w / 1000, 2) / round(ours_w / 1000, 2), 2)
    assert cells[("alpha", "ours")]["gpu_peak_mib"] == "1200" and cells[("alpha", "peer")]["gpu_peak_mib"] == "-"
    assert cells[("beta", "peer")]["requests"] == "not finished (no result.json)"
    drop = results[("beta", "ours")]["runs"][0]["decode_drop"]
    assert f"- beta: ours worst {round(results[('beta', 'ours')]['runs'][0]['worst_ttft_ms'] / 1000, 2)} s" in md
    assert f"decode drop {drop} ({'within' if drop <= 0.08 else 'NOT within'} 8%), peer not finished" in md
    assert "- peer: `llama-server -m x.gguf`" in md
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert [(r["trace"], r["system"], r["finished"]) for r in rows] == [
        ("alpha", "ours", True), ("alpha", "peer", True), ("beta", "ours", True), ("beta", "peer", False)]


def test_a_broken_result_json_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "ours" / "alpha" / "result.json"
    bad.parent.mkdir(parents=True)
    bad.write_text('{"runs": [')  # a replay killed while writing
    with pytest.raises(SystemExit, match=r"alpha/result.json: not a readable result.json"):
        replay_summary.main([str(tmp_path)])


def test_late_work_lines_of_a_server_log(tmp_path: Path) -> None:
    log = tmp_path / "ours" / "serve.log"
    log.parent.mkdir()
    log.write_text("freetoken-agent: warm-up: 8 requests, 8038 prompt tokens in 91.8 s\n"
                   "freetoken-agent: compile after the warm-up: chunk_fwd_kernel_o (2.50 s)\n"
                   "INFO: 127.0.0.1 - POST /v1/messages 200\n"
                   "freetoken-agent: capture after the warm-up: decode 4 (0.31 s)\n"
                   "freetoken-agent: compile after the warm-up: recompute_w_u_fwd_kernel (6.55 s)\n")
    lines = replay_summary.late_work(log, top=2)
    assert lines[0] == "- ours after the warm-up: 1 captures, 0.3 s, 2 compiles, 9.1 s"
    assert lines[1:] == ["  - compile recompute_w_u_fwd_kernel: 6.55 s", "  - compile chunk_fwd_kernel_o: 2.50 s"]
    log.write_text("freetoken-agent: warm-up: 8 requests\n")
    assert replay_summary.late_work(log) == ["- ours: nothing compiled or captured after the warm-up"]
