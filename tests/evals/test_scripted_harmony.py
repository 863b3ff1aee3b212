"""`eval --scripted --family gpt_oss`: a scripted reply is written as gpt-oss writes harmony (the
messages openai-harmony renders, ending as the model ends them), the server's harmony parser reads
back exactly the reply, and a tool-call reply echoed by a client re-renders through the chat
template to the same text, so the next prompt extends the cached one."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import openai_harmony as oh
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "adapters"))
from harmony_reference import harmony_encoding

from adapters.parsers import ContentDelta, ReasoningDelta, ToolCallEnd, create_parser, merge_events
from evals.traces.script import Call, Reply, render
from freetoken_agent.tokenizer.build import chat_template
from freetoken_agent.tokenizer.chat import compile_template

TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in ("read", "bash")]
REPLIES = [
    Reply(reasoning="I should look at calc.py first.", calls=[Call("read", {"filePath": "/w/calc.py"})]),
    Reply(reasoning="Two at once.", content="Let me check.",
          calls=[Call("bash", {"command": "cat a.py", "workdir": "/w"}), Call("read", {"filePath": "/w/ü.py"})]),
    Reply(reasoning="The work is done; I can report back.", content="Fixed calc.py; the tests pass."),
    Reply(content="No reasoning at all."),
]


def reference(reply: Reply) -> str:
    """openai-harmony's rendering of the reply's messages, after `<|start|>assistant`."""
    enc = harmony_encoding()
    msgs = []
    if reply.reasoning:
        msgs.append(oh.Message.from_role_and_content(oh.Role.ASSISTANT, reply.reasoning).with_channel("analysis"))
    if reply.calls:
        if reply.content:
            msgs.append(oh.Message.from_role_and_content(oh.Role.ASSISTANT, reply.content).with_channel("commentary"))
        msgs += [oh.Message.from_role_and_content(oh.Role.ASSISTANT, json.dumps(c.arguments, ensure_ascii=False,
                                                                                separators=(",", ":")))
                 .with_channel("commentary").with_recipient(f"functions.{c.name}")
                 .with_content_type("<|constrain|>json") for c in reply.calls]
    else:
        msgs.append(oh.Message.from_role_and_content(oh.Role.ASSISTANT, reply.content).with_channel("final"))
    text = "".join(enc.decode(enc.render(m)) for m in msgs).removeprefix("<|start|>assistant")
    return text.removesuffix("<|end|>") + "<|return|>" if not reply.calls else text


@pytest.mark.parametrize("reply", REPLIES, ids=range(len(REPLIES)))
def test_harmony_reply_is_what_openai_harmony_renders(reply: Reply) -> None:
    assert render(reply, "gpt_oss", thinking=True) == reference(reply)


@pytest.mark.parametrize("reply", REPLIES, ids=range(len(REPLIES)))
def test_server_parser_reads_the_reply_back(reply: Reply) -> None:
    parser = create_parser("harmony", TOOLS)
    events = merge_events([*parser.feed(render(reply, "gpt_oss", thinking=True)), *parser.finish()])
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    calls = [(e.name, json.loads(e.arguments)) for e in events if isinstance(e, ToolCallEnd)]
    assert (reasoning, content, calls) == (reply.reasoning, reply.content,
                                           [(c.name, c.arguments) for c in reply.calls])


@pytest.mark.parametrize("reply", [r for r in REPLIES if r.calls], ids=["one-call", "preamble-two-calls"])
def test_echoed_tool_call_renders_the_same_text(reply: Reply) -> None:
    calls: list[dict[str, Any]] = [
        {"id": f"c{i}", "type": "function",
         "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False, separators=(",", ":"))}}
        for i, c in enumerate(reply.calls)]
    messages = [{"role": "user", "content": "fix it"},
                {"role": "assistant", "content": reply.content, "reasoning_content": reply.reasoning,
                 "tool_calls": calls}]
    template = compile_template(chat_template("gpt_oss"))
    prompt = template.render(messages=messages[:1], tools=TOOLS, add_generation_prompt=True)
    echoed = template.render(messages=messages, tools=TOOLS, add_generation_prompt=False)
    assert echoed == prompt + render(reply, "gpt_oss", thinking=True)
