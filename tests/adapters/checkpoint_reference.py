"""The reference side of the checkpoint-template tests: transformers' rendering of a conversation
with a checkpoint's template, and the reply a model trained on that template writes.

Contract: `load_templates()` is `evals.chat_templates.reference_templates()` or a test failure
naming the cause. `reference(...)` renders with transformers 5.23's `render_jinja_template` and the
named special tokens `apply_chat_template` passes. `expected_reply(template, family, name,
thinking)` is (the prompt, the reply as the template writes it after that prompt, cut at the first
end-of-reply token, and the (reasoning, content, calls) a parser must recover from it): with
thinking off the reply carries no reasoning; where the template does not write a reply's reasoning
but its prompt opens it (DeepSeek-V3.1), the reply is the reasoning, `</think>`, then the rest.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from checkpoint_corpus import CONVERSATIONS, TOOLS, Family, for_family
from jinja2.sandbox import SandboxedEnvironment
from transformers.utils.chat_template_utils import render_jinja_template

from evals.chat_templates import TemplateFetchError, reference_templates
from freetoken_agent.service.chat import opens_reasoning

Want = tuple[str, str, list[tuple[str, Any]]]


def load_templates() -> dict[str, str]:
    try:
        return reference_templates()
    except TemplateFetchError as e:
        pytest.fail(f"the checkpoints' chat templates could not be fetched (python -m evals.chat_templates): {e}")


MUTATING = {"Kimi-K2-Instruct.jinja", "Kimi-K2-Thinking.jinja"}  # list.append: refused by the sandbox


def reference(template: str, family: Family, messages: list[dict[str, Any]], gen: bool, thinking: bool) -> str:
    kwargs: dict[str, Any] = {"enable_thinking": thinking, **family.specials}
    rendered: Any = render_jinja_template([messages], tools=list(TOOLS), chat_template=template,
                                          add_generation_prompt=gen, **kwargs)  # (texts, generation indices)
    return str(rendered[0][0])


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


def expected_reply(template: str, family: Family, name: str, thinking: bool) -> tuple[str, str, Want]:
    messages = for_family(CONVERSATIONS[name], family)
    if not thinking:  # no reasoning is generated with thinking off
        messages = [*messages[:-1], {k: v for k, v in messages[-1].items() if k != "reasoning_content"}]
    target = messages[-1]
    prompt, reply = reply_text(template, family, messages, thinking)
    reasoning = target.get("reasoning_content") or ""
    if reasoning and reasoning not in reply:  # the template does not write this reply's reasoning
        reasoning = ""
        if opens_reasoning(prompt):  # ... but its prompt opens it: the model writes it, then </think>
            reply = target["reasoning_content"] + "</think>" + reply.removeprefix("</think>")
            reasoning = target["reasoning_content"]
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in target.get("tool_calls", [])]
    return prompt, reply, (reasoning, target["content"].strip(), calls)
