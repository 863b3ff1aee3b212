"""What an echoed ~1k-token Edit call costs on the hybrid demo model, per client profile and echo kind.

Usage:

    PYTHONPATH=. /work/venv/bin/python -m evals.traces.echoes [--model DIR] [--cold] [--json]

Contract: for each client profile (claude-code, opencode, openclaw, codex, generic) and each echo
kind, runs two requests of one session through the session manager and the engine (Qwen3.5-MoE
demo: Gated DeltaNet + attention, so a prefix resumes only from a recurrent-state checkpoint):
the first ends in a forced reply (reasoning, then an Edit call of ~1k tokens, then `<|im_end|>`,
as a model ends its turn); the second echoes that reply the way the kind says and adds the tool's
result. Kinds: `exact`; `claude-code` (`"replace_all": false` added first: Claude Code's real
echo); `ids` (call id rewritten, as Codex and OpenClaw do); `appended` (`"replace_all": false`
added last), `reordered` (argument keys in another order), `whitespace` (arguments re-serialised
as a JSON string with other whitespace); `late-change` (the last argument's final line
rewritten: no reconciliation can apply, the argument-boundary anchors must). Per case:
- truly new: tokens of the second prompt after its longest common prefix with the first request's
  prompt + reply, where the echo is rendered as the engine generated it whenever it is
  semantically that reply (so a pure re-serialisation adds nothing new);
- recomputed: the engine's `ReuseInfo.recomputed_tokens`; `baseline`: the same with echo
  reconciliation and argument_end anchors off (the manager's plain normalisation);
- ok: recomputed <= 1.1 x truly new + one turn header (`<|im_start|>user\n`);
- with `--cold`: the logits of the second request (4 steps) against a cold engine's prefill of the
  same prompt, max relative difference.
`run(model_dir, cold)` is the Python entry point; returns one dict per case.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from freetoken_agent.service.types import ChatMessage, ChatRequest, ToolCall
from freetoken_agent.sessions.anchors import AnchorPolicy
from freetoken_agent.sessions.echo import common_prefix
from freetoken_agent.sessions.manager import SessionManager
from freetoken_agent.sessions.normalise import normalise as plain_normalise
from freetoken_agent.tokenizer import ChatTokenizer

ACCEPT = 1.1
PROFILES = {"claude-code": {"user-agent": "claude-cli/2.1.332 (external, cli)", "x-claude-code-session-id": "s-cc"},
            "opencode": {"user-agent": "opencode/1.18.33", "x-session-affinity": "s-oc"},
            "openclaw": {"session_id": "s-ow"},
            "codex": {"originator": "codex_exec", "session-id": "s-cx"},
            "generic": {"x-session-id": "s-g"}}
KINDS = ["exact", "claude-code", "ids", "appended", "reordered", "whitespace", "late-change"]
EDIT = {"type": "function", "function": {"name": "Edit", "description": "Replace text in a file",
                                         "parameters": {"type": "object", "properties": {
                                             "file_path": {"type": "string"}, "old_string": {"type": "string"},
                                             "new_string": {"type": "string"}, "replace_all": {"type": "boolean"}},
                                             "required": ["file_path", "old_string", "new_string"]}}}


def edit_arguments(lines: int = 24) -> dict[str, Any]:
    """Old/new text of a function rewritten line by line: ~1k tokens for 24 lines."""
    old = "".join(f"    total_{i} = compute_value(items[{i}], scale={i % 7}) + offset\n" for i in range(lines))
    new = "".join(f"    total_{i} = compute_value(items[{i}], scale={i % 7}, exact=True) + offset\n" for i in range(lines))
    return {"file_path": "/work/project/calc.py", "old_string": old, "new_string": new}


def echo_of(kind: str, call: ToolCall) -> ChatMessage:
    args = dict(call.arguments) if isinstance(call.arguments, dict) else {}
    cid = call.id
    if kind == "claude-code":
        args = {"replace_all": False, **args}
    elif kind == "ids":
        cid = call.id.replace("_", "")
    elif kind == "appended":
        args = {**args, "replace_all": False}
    elif kind == "reordered":
        args = dict(reversed(list(args.items())))
    elif kind == "late-change":
        args["new_string"] = args["new_string"][:-1] + "  # done\n"
    arguments: dict[str, Any] | str = args
    if kind == "whitespace":
        arguments = json.dumps(args, indent=2)
    return ChatMessage(role="assistant", reasoning="I will rewrite the totals.",
                       tool_calls=[ToolCall(id=cid, name=call.name, arguments=arguments)])


def _render(tok: ChatTokenizer, req: ChatRequest) -> list[int]:
    text = tok.apply_chat_template([m.to_template() for m in req.messages], tools=req.tools or None,
                                   add_generation_prompt=True, enable_thinking=True, tokenize=False)
    assert isinstance(text, str)
    return tok.encode(text)


SAME_FOR = {"claude-code": {"claude-code"}, "appended": {"claude-code"}}  # kinds semantically equal only there


def first_request(engine: Any, tok: ChatTokenizer, profile: str, reconcile: bool, lines: int = 24) -> dict[str, Any]:
    """The session's first request, its reply forced and decoded (so decode anchors fire)."""
    from engine.sampling import SamplingParams

    engine.reset_cache()
    mgr = SessionManager(tok, AnchorPolicy.SEMANTIC, engine=engine)
    call = ToolCall(id="call_1f72", name="Edit", arguments=edit_arguments(lines))
    first = [ChatMessage(role="system", content="You are a coding agent."),
             ChatMessage(role="user", content="Make every total exact in calc.py.")]
    req1 = mgr.normalise(ChatRequest(messages=first, tools=[EDIT], headers=PROFILES[profile]))
    ids1 = _render(tok, req1)
    plan1 = mgr.plan(req1, ids1)
    generated = ChatMessage(role="assistant", reasoning="I will rewrite the totals.", tool_calls=[call])
    full = _render(tok, replace(req1, messages=[*first, generated]))
    assert full[:len(ids1)] == ids1
    end = tok.token_to_id("<|im_end|>")
    assert end is not None
    reply = full[len(ids1):]
    reply = reply[:reply.index(end) + 1]  # the model's turn ends on <|im_end|>
    decode = [d for d in plan1.decode_anchors if reconcile or d.kind != "argument_end"]
    h1 = engine.submit(ids1, SamplingParams(max_tokens=len(reply) + 1), anchors=plan1.anchors, decode_anchors=decode,
                       session=plan1.engine_session, forced_output=reply)
    h1.result(timeout=1200)
    mgr.record(plan1, ids1, list(h1.output_ids), h1, None, "stop")
    return {"mgr": mgr, "first": first, "call": call, "generated": generated, "cached": ids1 + list(h1.output_ids),
            "reply": reply}


def second_request(engine: Any, tok: ChatTokenizer, s: dict[str, Any], profile: str, kind: str,
                   reconcile: bool) -> dict[str, Any]:
    """The echo of `kind` plus the tool result, on the cache the first request left. It is not
    recorded and checkpoints nothing past what the first request cached, so every kind meets the
    same cache."""
    from engine.sampling import SamplingParams

    mgr, first, call = s["mgr"], s["first"], s["call"]
    result = ChatMessage(role="tool", content="The file /work/project/calc.py has been updated.", tool_call_id=call.id)
    req2 = ChatRequest(messages=[*first, echo_of(kind, call), result], tools=[EDIT], headers=PROFILES[profile])
    norm = mgr.normalise(req2) if reconcile else plain_normalise(req2)
    ids2 = _render(tok, norm)
    plan2 = mgr.plan(norm, ids2)
    ideal = ids2
    if kind in ("exact", "ids", "reordered", "whitespace") or profile in SAME_FOR.get(kind, ()):
        ideal = _render(tok, replace(req2, messages=[*first, s["generated"], result]))
    truly_new = len(ideal) - common_prefix(ideal, s["cached"])
    anchors = [a for a in plan2.anchors if a.position <= len(s["cached"])]
    h2 = engine.submit(ids2, SamplingParams(max_tokens=4, ignore_eos=True), capture_logits=True, anchors=anchors,
                       session=plan2.engine_session)
    h2.result(timeout=1200)
    header = len(tok.encode("<|im_start|>user\n"))
    recomputed = int(h2.reuse.recomputed_tokens)
    div = plan2.divergence
    return {"profile": profile, "kind": kind, "call_tokens": len(s["reply"]), "prompt": len(ids2),
            "truly_new": truly_new, "recomputed": recomputed, "ok": recomputed <= ACCEPT * truly_new + header,
            "checkpoint": h2.reuse.checkpoint_kind, "cause": div.cause if div else None, "echo": plan2.echo,
            "ids": ids2, "logits": [t.clone() for t in h2.logits]}


def run(model_dir: Path, cold: bool = False, profiles: list[str] | None = None,
        kinds: list[str] | None = None, baseline: list[str] | None = None, lines: int = 24) -> list[dict[str, Any]]:
    """`baseline`: the profiles also measured without reconciliation and argument anchors; `lines`:
    the size of the Edit call (24: ~1k tokens)."""
    from engine.engine import Engine
    from engine.options import EngineOptions
    from engine.sampling import SamplingParams

    tok = ChatTokenizer.from_dir(model_dir)
    opts = EngineOptions(dtype="float32", checkpoint_slots=64)
    rows = []
    with Engine(str(model_dir), opts) as engine:
        for profile in profiles or list(PROFILES):
            s = first_request(engine, tok, profile, reconcile=True, lines=lines)
            batch = [second_request(engine, tok, s, profile, kind, True) for kind in kinds or KINDS]
            if profile in (baseline or ()):
                s = first_request(engine, tok, profile, reconcile=False, lines=lines)
                for row in batch:
                    row["baseline"] = second_request(engine, tok, s, profile, row["kind"], False)["recomputed"]
            rows += batch
    if cold:
        with Engine(str(model_dir), opts) as engine:
            for row in rows:
                engine.reset_cache()
                h = engine.submit(row["ids"], SamplingParams(max_tokens=4, ignore_eos=True), capture_logits=True)
                h.result(timeout=1200)
                row["logits_max_rel_diff"] = max(float((g - w).abs().max() / w.abs().max())
                                                 for g, w in zip(row["logits"], h.logits, strict=True))
    for row in rows:
        row.pop("ids"), row.pop("logits")
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    out = ["| profile | echo | call tokens | truly new | recomputed | baseline | ok | served by | echo outcome | logits rel. diff |",
           "|---|---|---:|---:|---:|---:|---|---|---|---:|"]
    for r in rows:
        e = r["echo"] or {}
        outcome = "reconciled" + (" (rewritten)" if e.get("rewritten") else "") if e.get("reconciled") \
            else f"differed: {e.get('differed')}"
        diff = r.get("logits_max_rel_diff")
        out.append(f"| {r['profile']} | {r['kind']} | {r['call_tokens']} | {r['truly_new']} | {r['recomputed']} | "
                   f"{r.get('baseline', '-')} | {'yes' if r['ok'] else 'NO'} | {r['checkpoint']} | {outcome} | "
                   f"{'-' if diff is None else f'{diff:.1e}'} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="a qwen3_5_moe model dir (default: write the demo)")
    ap.add_argument("--cold", action="store_true", help="compare logits with a cold prefill")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from freetoken_agent.demo import write_demo_model

            model = write_demo_model(Path(tmp) / "demo", arch="qwen3_5_moe")
        rows = run(model, cold=args.cold, baseline=["claude-code"])
    print(json.dumps(copy.deepcopy(rows), indent=1) if args.json else table(rows))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
