"""Multi-turn tool conversations and the checkpoints' chat templates they are rendered with.

`FAMILIES` names each checkpoint template (fetched by `evals.chat_templates`), the model family that
ships it, the named special tokens of its `tokenizer_config.json` (what transformers passes to the
template) and its end-of-reply tokens. `CONVERSATIONS` are Hugging Face-form chats (tool-call
arguments as mappings, reasoning in `reasoning_content`) whose last message is the assistant reply
a model would generate; `openai_body` turns one into an OpenAI Chat Completions request (arguments
as JSON strings, as clients send them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

QWEN = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
GLM = {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}
DEEPSEEK = {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>",
            "pad_token": "<｜end▁of▁sentence｜>"}
KIMI = {"bos_token": "[BOS]", "eos_token": "[EOS]", "unk_token": "[UNK]", "pad_token": "[PAD]"}
GPT_OSS = {"bos_token": "<|startoftext|>", "eos_token": "<|return|>", "pad_token": "<|endoftext|>"}


@dataclass(frozen=True)
class Family:
    template: str  # file name in evals.chat_templates.TEMPLATES
    model_type: str  # config.json model_type of the checkpoints shipping it
    specials: dict[str, str]
    stops: tuple[str, ...]  # tokens that end a reply (not passed to the parser)
    one_call: bool = False  # gpt-oss: one call per message, and a call turn has reasoning or content, not both


FAMILIES: tuple[Family, ...] = (
    Family("Qwen-Qwen3-0.6B.jinja", "qwen3_moe", QWEN, ("<|im_end|>",)),  # Qwen3-30B-A3B ships this template
    Family("Qwen-Qwen3-0.6B.jinja", "qwen3_next", QWEN, ("<|im_end|>",)),  # Qwen3-Next: the same chat format
    Family("Qwen3-Coder.jinja", "qwen3_moe", QWEN, ("<|im_end|>",)),
    Family("Qwen3.5-4B.jinja", "qwen3_5_moe", QWEN, ("<|im_end|>",)),  # Qwen3.5 / Qwen3.6 MoE
    Family("GLM-4.6.jinja", "glm4_moe", GLM, ("<|endoftext|>", "<|user|>", "<|observation|>")),
    Family("GLM-4.7-Flash.jinja", "glm4_moe_lite", GLM, ("<|endoftext|>", "<|user|>", "<|observation|>")),
    Family("deepseek-ai-DeepSeek-V3.1.jinja", "deepseek_v3", DEEPSEEK, ("<｜end▁of▁sentence｜>",)),
    # llama.cpp's template for V3.2 (the checkpoint ships a Python encoder instead): DSML calls
    Family("deepseek-ai-DeepSeek-V3.2.jinja", "deepseek_v3", DEEPSEEK, ("<｜end▁of▁sentence｜>",)),
    Family("moonshotai-Kimi-K2.jinja", "kimi_k2", KIMI, ("<|im_end|>",)),
    Family("Kimi-K2-Instruct.jinja", "kimi_k2", KIMI, ("<|im_end|>",)),
    Family("Kimi-K2-Thinking.jinja", "kimi_k2", KIMI, ("<|im_end|>",)),
    Family("openai-gpt-oss-120b.jinja", "gpt_oss", GPT_OSS, ("<|return|>", "<|call|>"), one_call=True),
)


def _fn(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    params = {"type": "object", "properties": properties, "required": required}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": params}}


TOOLS: list[dict[str, Any]] = [
    _fn("read_file", "Read a text file.", {"path": {"type": "string"}, "offset": {"type": "integer"},
                                           "limit": {"type": "integer"}}, ["path"]),
    _fn("edit_file", "Apply edits to a file.", {
        "path": {"type": "string"},
        "edits": {"type": "array", "items": {"type": "object", "properties": {"old": {"type": "string"},
                                                                             "new": {"type": "string"}}}},
        "dry_run": {"type": "boolean"}, "ratio": {"type": "number"}}, ["path", "edits"]),
    _fn("search", "Search the repository.", {
        "query": {"type": "string"},
        "options": {"type": "object", "properties": {"case": {"type": "boolean"}, "max": {"type": "integer"},
                                                     "globs": {"type": "array", "items": {"type": "string"}}}}},
        ["query"]),
    _fn("run_tests", "Run the test suite.", {}, []),
]


def call(cid: str, name: str, args: dict[str, Any]) -> dict[str, Any]:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


def assistant(content: str, reasoning: str | None = None, calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    m: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning is not None:
        m["reasoning_content"] = reasoning
    if calls:
        m["tool_calls"] = calls
    return m


def tool(cid: str, content: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": cid, "content": content}


SYSTEM = {"role": "system", "content": "You are a careful coding agent. Answer in the user's language."}
ASK = {"role": "user", "content": "Fix the crash in src/naïve_ü.py — it fails on 'ß' ✓"}
READ = call("call_1", "read_file", {"path": "src/naïve_ü.py", "offset": 0, "limit": 200})
EDIT = call("call_2", "edit_file", {"path": "src/naïve_ü.py", "edits": [
    {"old": "x = s.upper()", "new": "x = s.casefold()  # 'ß' → 'ss'"}, {"old": "n = 1", "new": "n = -2.5e-3"}],
    "dry_run": False, "ratio": 0.75})
SEARCH = call("call_3", "search", {"query": "upper(", "options": {"case": True, "max": 3,
                                                                   "globs": ["*.py", "src/**/*.py"]}})
RUN = call("call_4", "run_tests", {})
HISTORY = [
    SYSTEM, ASK,
    assistant("I'll read the file first.", "Start with the file.", [READ]),
    tool("call_1", "def f(s):\n    x = s.upper()\n    n = 1\n    return x, n\n"),
    assistant("Two changes and a search.", "upper() maps 'ß' oddly; also fix n.", [EDIT, SEARCH]),
    tool("call_2", '{"applied": 2, "ok": true}'),
    tool("call_3", "src/naïve_ü.py:2: x = s.upper()"),
    assistant("Fixed: `casefold()` instead of `upper()`, and n is now -2.5e-3.", "Both edits applied."),
    {"role": "user", "content": "Now run the tests, please. 谢谢"},
]

# name -> conversation; the last message is the reply under test
CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "first-call": [SYSTEM, ASK, assistant("I'll read the file first.", "Start with the file.", [READ])],
    "parallel-calls-after-tool": [*HISTORY[:4], HISTORY[4]],
    "answer-after-tools": [*HISTORY[:7], HISTORY[7]],
    "call-in-follow-up": [*HISTORY, assistant("", "Run the suite.", [RUN])],
    "answer-in-follow-up": [*HISTORY, assistant("", "Run the suite.", [RUN]), tool("call_4", "12 passed, 0 failed"),
                            assistant("All 12 tests pass. ✓", "Green.")],
}


def for_family(messages: list[dict[str, Any]], family: Family) -> list[dict[str, Any]]:
    """The conversation as that family's template takes it (gpt-oss: one call per turn, and a call turn
    carries its reasoning, not a preamble)."""
    if not family.one_call:
        return messages
    out = []
    for m in messages:
        if m.get("tool_calls"):
            m = {**m, "content": "", "tool_calls": m["tool_calls"][:1]}
        out.append(m)
    return out


def openai_body(messages: list[dict[str, Any]], thinking: bool) -> dict[str, Any]:
    """The OpenAI Chat Completions request a client sends for `messages` (string arguments)."""
    wire = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [{**c, "function": {"name": c["function"]["name"], "arguments": json.dumps(
                c["function"]["arguments"], ensure_ascii=False, separators=(",", ":"))}} for c in m["tool_calls"]]
            m["content"] = m["content"] or None
        wire.append(m)
    return {"model": "m", "messages": wire, "tools": TOOLS, "chat_template_kwargs": {"enable_thinking": thinking}}
