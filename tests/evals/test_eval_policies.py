"""`freetoken-agent eval ... --anchor-policy A,B`: the workload once per policy, each on a fresh
server the eval starts with `serve --anchor-policy P`, compared in one report. A recorded trace
through the real CLI and two real demo servers on loopback: each run's numbers are its own
server's, the servers really ran the two policies (their `/v1/sessions`, their startup lines, and
where they placed their anchors), and the comparison table and plot are written. The parser's
refusals (with --base-url, an unknown name, twice through --serve-args) and the progress step that
names the policy."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from freetoken_agent.cli import main
from freetoken_agent.eval.cli import _named

REPO = Path(__file__).resolve().parents[2]
POLICIES = ["semantic", "positional"]
# the only anchor kinds the positional policy plans: every 8192 tokens, the prompt's and the reply's end
POSITIONAL_KINDS = {"positional", "prompt_end", "message_end"}
TOKEN_KEYS = ("prompt_tokens", "reused_tokens", "recomputed_tokens", "truly_new_tokens")


def _sum(turns: list[dict[str, Any]], key: str) -> int:
    return sum(t[key] for t in turns)


def test_replay_compares_anchor_policies(tmp_path: Path) -> None:
    recorded = json.loads((REPO / "evals/traces/data/opencode.json").read_text())
    recorded["requests"] = recorded["requests"][:3]  # the title side request, the first main step, its follow-up
    trace = tmp_path / "opencode.json"
    trace.write_text(json.dumps(recorded))
    out = tmp_path / "out"
    assert main(["eval", "replay", str(trace), "--anchor-policy", ",".join(POLICIES),
                 "--serve-args", "--kv-tokens 32768", "--out", str(out)]) == 0
    result = json.loads((out / "result.json").read_text())
    assert result["eval"] == "replay" and result["anchor_policies"] == POLICIES
    runs = result["policies"]
    assert [r["anchor_policy"] for r in runs] == POLICIES
    assert len({r["base_url"] for r in runs}) == 2  # a server per policy
    for policy, r in zip(POLICIES, runs, strict=True):
        # the server itself says which policy it ran: /v1/sessions and its startup line
        assert r["server_anchor_policy"] == policy
        assert f"anchor policy {policy}," in Path(r["server_log"]).read_text()
        turns = r["turns"]
        assert [t["status"] for t in turns] == [200] * 3
        assert all(t["server_session"] for t in turns)  # the token numbers are the server's /v1/sessions
        # a fresh server: nothing of the other policy's run is cached, so the first requests reuse nothing
        assert turns[0]["reused_tokens"] == 0 and turns[1]["reused_tokens"] == 0
        assert turns[2]["reused_tokens"] > turns[2]["recomputed_tokens"] > 0
        # the run's and the comparison's totals are the sums of this policy's own rows
        (run,) = r["runs"]
        row = next(c for c in result["comparison"] if c["anchor_policy"] == policy)
        for key in TOKEN_KEYS:
            assert run[key] == row[key] == _sum(turns, key), (policy, key)
        assert row["succeeded"] == row["of"] == row["requests"] == 3 and row["failed"] == 0
        assert row["worst_ttft_ms"] == max(t["ttft_ms"] for t in turns)
        assert row["baseline_decode_tps"] == r["baseline_decode_tps"] > 0
        assert row["decode_drop"] == round(1 - row["mean_decode_tps"] / row["baseline_decode_tps"], 3)
        assert row["server_checkpoints"] and row["server_checkpoints"] > 0
    # where the two servers placed their anchors differs: the semantic one at message boundaries
    semantic, positional = (set(r["server_anchor_kinds"]) for r in runs)
    assert positional and positional <= POSITIONAL_KINDS
    assert {"system_end", "tool_result_start"} <= semantic
    md = (out / "report.md").read_text()
    table = md[md.index("## Comparison"):md.index("## anchor policy semantic")]
    assert "| semantic | semantic | 3/3 | 3 | 0 |" in table
    assert "| positional | positional | 3/3 | 3 | 0 |" in table
    assert md.index("## anchor policy semantic") < md.index("## anchor policy positional")
    assert md.count("### Turns") == 2
    for name in ("policies.png", *(f"{kind}-{p}.png" for kind in ("ttft", "tokens") for p in POLICIES)):
        with Image.open(out / name) as img:
            assert img.format == "PNG"
            img.verify()


@pytest.mark.parametrize(("argv", "says"), [
    (["--anchor-policy", "semantic", "--base-url", "http://127.0.0.1:9"], "cannot go with --base-url"),
    (["--base-url", "http://127.0.0.1:9", "--anchor-policy", "semantic,positional"], "cannot go with --base-url"),
    (["--anchor-policy", "semantic,bogus"], "unknown anchor policy 'bogus' (known: semantic, positional, user-only)"),
    (["--anchor-policy", "semantic,semantic"], "anchor policy named twice: semantic"),
    (["--anchor-policy", "positional", "--serve-args", "--kv-tokens 4096 --anchor-policy semantic"],
     "inside --serve-args"),
    (["--serve-args=--anchor-policy=semantic", "--anchor-policy", "positional"], "inside --serve-args"),
])
@pytest.mark.parametrize("command", [["replay", "t.json"], ["swe"], ["openclaw"]])
def test_parser_refuses(command: list[str], argv: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["eval", *command, *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and says in err, err


def test_parser_reads_the_policies() -> None:
    from freetoken_agent.cli import build_parser

    args = build_parser().parse_args(["eval", "swe", "--anchor-policy", "user-only, semantic"])
    assert args.anchor_policies == ["user-only", "semantic"]
    assert build_parser().parse_args(["eval", "swe"]).anchor_policies is None
    # a policy inside --serve-args alone stays what it was: the server's flag
    args = build_parser().parse_args(["eval", "replay", "t.json", "--serve-args", "--anchor-policy positional"])
    assert args.anchor_policies is None and args.serve_args == "--anchor-policy positional"


def test_progress_step_names_the_policy() -> None:
    calls: list[tuple[Any, ...]] = []

    def record(*a: Any) -> None:
        calls.append(a)

    assert _named(record, "semantic", 0, 1) is record  # one policy: the workload's own steps
    named = _named(record, "positional", 1, 2)
    named(3, 13, "calc-divide")
    named(13, 13)
    assert calls == [(3, 13, "positional (2/2): calc-divide"), (13, 13, "positional (2/2)")]
