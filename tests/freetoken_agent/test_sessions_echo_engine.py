"""Echoed tool calls on the hybrid demo model (Gated DeltaNet + attention): an echo the manager
reconciles resumes right after the generated reply, one it cannot resumes at the last argument
boundary, and in both cases the logits equal a cold prefill of the same prompt
(evals/traces/echoes.py at a smaller call size; the ~1k-token table is in docs/sessions.md)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from evals.traces.echoes import run


@pytest.fixture(scope="module")
def rows(demo_model: Callable[[str], Path]) -> dict[tuple[str, str], dict]:
    model = demo_model("qwen3_5_moe")
    out = run(model, cold=True, profiles=["claude-code", "generic"], kinds=["claude-code", "appended", "reordered"],
              baseline=["claude-code"], lines=3)
    return {(r["profile"], r["kind"]): r for r in out}


def test_reconciled_echoes_cost_only_the_new_turn(rows) -> None:
    for key in [("claude-code", "claude-code"), ("claude-code", "appended"), ("claude-code", "reordered"),
                ("generic", "reordered")]:
        r = rows[key]
        assert r["echo"]["reconciled"] and r["cause"] == "appended", r
        assert r["checkpoint"] == "message_end" and r["recomputed"] == r["truly_new"], r
    # without reconciliation the call itself is recomputed
    assert rows[("claude-code", "claude-code")]["baseline"] > rows[("claude-code", "claude-code")]["call_tokens"] // 2


def test_unreconciled_late_key_resumes_at_the_argument_boundary(rows) -> None:
    r = rows[("generic", "appended")]  # a key the generic profile does not know, added last
    assert not r["echo"]["reconciled"] and r["echo"]["differed"] == "call 0 argument replace_all"
    assert r["checkpoint"] == "argument_end" and r["ok"], r
    # Claude Code's replace_all first: the call differs at its first argument, so that is all truly new
    assert rows[("generic", "claude-code")]["ok"]


def test_logits_after_reuse_equal_cold_prefill(rows) -> None:
    for r in rows.values():
        assert r["logits_max_rel_diff"] < 1e-4, r
