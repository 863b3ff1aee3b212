"""The whole server path with the checkpoints' own chat templates, in process.

A real engine on the Qwen3-MoE demo model serves, through the real `create_app` (Starlette's
TestClient), a `ChatService` whose tokenizer carries a checkpoint's template (GLM-4.6,
GLM-4.7-Flash, DeepSeek-V3.1, DeepSeek-V3.2, Kimi-K2, gpt-oss, Qwen3 as Qwen3-Next ships it). The
reply is forced (`freetoken_forced_output`) to the text a model trained on that template writes
(`checkpoint_reference.expected_reply`), so the test proves that the service picks the template's
parser and reasoning start from its own rendering, and that OpenAI Chat Completions (whole and
streamed), Anthropic Messages and OpenAI Responses return that reply's reasoning, text and tool
calls.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from checkpoint_corpus import CONVERSATIONS, FAMILIES, Family, for_family, openai_body
from checkpoint_reference import expected_reply, load_templates
from fastapi.testclient import TestClient

from adapters.common import FORCED_OUTPUT_FIELD
from adapters.guard import LOOPBACK_HOSTS, Limits
from adapters.server import create_app
from adapters.state import AppState
from engine.engine import Engine
from engine.options import EngineOptions
from freetoken_agent.service import ChatService
from freetoken_agent.tokenizer import ChatTokenizer

KV = 8192
SERVED = ["GLM-4.6.jinja", "GLM-4.7-Flash.jinja", "deepseek-ai-DeepSeek-V3.1.jinja", "deepseek-ai-DeepSeek-V3.2.jinja",
          "moonshotai-Kimi-K2.jinja", "openai-gpt-oss-120b.jinja"]
SERVED_FAMILIES = [f for f in FAMILIES
                   if f.template in SERVED or (f.template == "Qwen-Qwen3-0.6B.jinja" and f.model_type == "qwen3_next")]
EVERY_PROTOCOL = ("GLM-4.7-Flash.jinja", "openai-gpt-oss-120b.jinja")


@pytest.fixture(scope="module")
def templates() -> dict[str, str]:
    return load_templates()


@pytest.fixture(scope="module")
def model(demo_model: Callable[[str], Path]) -> Path:
    return demo_model("qwen3_moe")


@pytest.fixture(scope="module")
def base(model: Path) -> ChatTokenizer:
    return ChatTokenizer.from_dir(model)


@pytest.fixture(scope="module")
def engine(model: Path) -> Iterator[Engine]:
    with Engine(model, EngineOptions(dtype="float32", kv_tokens=KV, max_running=2, prefill_chunk=512)) as eng:
        yield eng


def client_for(engine: Engine, base: ChatTokenizer, template: str, family: Family) -> TestClient:
    tok = ChatTokenizer(base.tokenizer, {**base.config, **family.specials}, template)
    service = ChatService(engine, tok, "m", KV, 2048)
    limits = Limits(allowed_hosts=(*LOOPBACK_HOSTS, "testserver"))
    return TestClient(create_app(AppState(service=service, model_name="m", limits=limits)))


def openai_reply(message: dict[str, Any]) -> tuple[str, str, list[tuple[str, Any]]]:
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls") or []]
    return message.get("reasoning_content") or "", message.get("content") or "", calls


def streamed_reply(body: str) -> tuple[str, str, list[tuple[str, Any]]]:
    reasoning, content, calls = "", "", {}  # type: ignore[var-annotated]
    for line in body.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        for choice in json.loads(line[6:]).get("choices", []):
            delta = choice.get("delta") or {}
            reasoning += delta.get("reasoning_content") or ""
            content += delta.get("content") or ""
            for c in delta.get("tool_calls") or []:
                name, args = calls.get(c["index"], ("", ""))
                fn = c.get("function") or {}
                calls[c["index"]] = (name + (fn.get("name") or ""), args + (fn.get("arguments") or ""))
    return reasoning, content, [(n, json.loads(a)) for _, (n, a) in sorted(calls.items())]


def anthropic_body(messages: list[dict[str, Any]], thinking: bool) -> dict[str, Any]:
    """The Anthropic Messages request for a conversation (system apart, tool results as user blocks)."""
    out: list[dict[str, Any]] = []
    for m in messages[1:]:
        if m["role"] == "user":
            out.append({"role": "user", "content": m["content"]})
        elif m["role"] == "tool":
            block = {"type": "tool_result", "tool_use_id": m["tool_call_id"], "content": m["content"]}
            if out and out[-1]["role"] == "user" and isinstance(out[-1]["content"], list):
                out[-1]["content"].append(block)
            else:
                out.append({"role": "user", "content": [block]})
        else:
            blocks: list[dict[str, Any]] = []
            if m.get("reasoning_content"):
                blocks.append({"type": "thinking", "thinking": m["reasoning_content"], "signature": "x"})
            if m["content"]:
                blocks.append({"type": "text", "text": m["content"]})
            blocks += [{"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                        "input": c["function"]["arguments"]} for c in m.get("tool_calls", [])]
            out.append({"role": "assistant", "content": blocks})
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in openai_body([], thinking)["tools"]]
    body: dict[str, Any] = {"model": "m", "max_tokens": 2048, "system": messages[0]["content"], "messages": out,
                            "tools": tools}
    if thinking:
        body["thinking"] = {"type": "enabled", "budget_tokens": 1024}
    return body


def responses_reply(response: dict[str, Any]) -> tuple[str, str, list[tuple[str, Any]]]:
    items = response["output"]
    return ("".join(p["text"] for i in items if i["type"] == "reasoning" for p in i.get("content") or []),
            "".join(p["text"] for i in items if i["type"] == "message" for p in i["content"]),
            [(i["name"], json.loads(i["arguments"])) for i in items if i["type"] == "function_call"])


def anthropic_reply(message: dict[str, Any]) -> tuple[str, str, list[tuple[str, Any]]]:
    blocks = message["content"]
    return ("".join(b["thinking"] for b in blocks if b["type"] == "thinking"),
            "".join(b["text"] for b in blocks if b["type"] == "text"),
            [(b["name"], b["input"]) for b in blocks if b["type"] == "tool_use"])


@pytest.mark.parametrize("family", SERVED_FAMILIES, ids=[f"{f.template}-{f.model_type}" for f in SERVED_FAMILIES])
def test_served_reply_equals_the_templates(engine: Engine, base: ChatTokenizer, templates: dict[str, str],
                                           family: Family) -> None:
    """Streamed Chat Completions for every template; the whole reply, Anthropic Messages and Responses
    too for GLM-4.7-Flash (its prompt opens the reasoning) and gpt-oss (harmony channels)."""
    template, name = templates[family.template], "first-call"
    _, reply, want = expected_reply(template, family, name, True)
    client = client_for(engine, base, template, family)
    history = for_family(CONVERSATIONS[name], family)[:-1]
    body = {**openai_body(history, True), FORCED_OUTPUT_FIELD: reply, "max_tokens": 2048, "stream": True}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert streamed_reply(r.text) == want
    if family.template not in EVERY_PROTOCOL:
        return
    r = client.post("/v1/chat/completions", json={**body, "stream": False})
    assert r.status_code == 200, r.text
    assert openai_reply(r.json()["choices"][0]["message"]) == want
    r = client.post("/v1/messages", json={**anthropic_body(history, True), FORCED_OUTPUT_FIELD: reply})
    assert r.status_code == 200, r.text
    assert anthropic_reply(r.json()) == want
    assert [m["role"] for m in history] == ["system", "user"]  # the first call: no history to map
    tools = [{"type": "function", **t["function"]} for t in body["tools"]]
    r = client.post("/v1/responses", json={"model": "m", "instructions": history[0]["content"], "tools": tools,
                                           "input": [{"role": "user", "content": history[1]["content"]}],
                                           "reasoning": {"effort": "medium"}, FORCED_OUTPUT_FIELD: reply})
    assert r.status_code == 200, r.text
    assert responses_reply(r.json()) == want
