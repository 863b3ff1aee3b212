"""Incremental parsers that split a model's generated text into reasoning, content and tool calls.

Contract: `create_parser(family, tools, ...)` returns a fresh `OutputParser` for one request.
Feed it the generated text in any pieces (`feed`), then call `finish`; it returns
`ParseEvent`s (`ReasoningDelta`, `ContentDelta`, `ToolCallStart`, `ToolCallArgsDelta`,
`ToolCallEnd`). It never raises on any text, and the events of any split of a text, merged per
kind (`merge_events`), equal those of the whole text (call ids aside, which are random).

Families: "qwen3" (Qwen3 MoE; JSON tool calls `<tool_call>\\n{"name": ..., "arguments": ...}\\n
</tool_call>`) and "qwen3_5" (Qwen3.5 / Qwen3.6; XML tool calls `<tool_call>\\n<function=NAME>\\n
<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>`, values typed by the tools'
JSON schemas). Both families read both call forms (Qwen3-Coder is a Qwen3 MoE with XML calls):
the body's first non-whitespace character picks the form. "glm4" (GLM-4.5 / 4.6 / 4.7,
GLM-4.7-Flash; `<think>` reasoning, tool calls `<tool_call>NAME<arg_key>KEY</arg_key><arg_value>
VALUE</arg_value>...</tool_call>`, values typed by the schemas as in the XML form:
`adapters.parsers.glm`). "deepseek_v3" (DeepSeek-V3 / V3.1: `<think>` reasoning, calls between
`<｜tool▁call▁begin｜>` and `<｜tool▁call▁end｜>` with JSON arguments, section markers dropped:
`adapters.parsers.deepseek`). "kimi_k2" (Kimi-K2: `<|tool_call_begin|>functions.NAME:INDEX
<|tool_call_argument_begin|>ARGS<|tool_call_end|>` within `<|tool_calls_section_begin|>` ...
`<|tool_calls_section_end|>`, markers dropped). "deepseek_v32" (DeepSeek-V3.2: `<think>` reasoning,
DSML calls `<｜DSML｜invoke name="NAME">` with `<｜DSML｜parameter name="KEY" string="true|false">`
values, the `function_calls` markers dropped: `adapters.parsers.dsml`). "harmony" (gpt-oss): channels and
`to=functions.NAME` calls, see `adapters.parsers.harmony` (the Qwen rules below are not its rules).

Rules:
- Reasoning (`parse_reasoning=True`): with `starts_in_reasoning` the text starts inside the think
  block (the prompt ended with `<think>\\n`: Qwen3.5 with thinking on, Qwen3 thinking models);
  otherwise a `<think>` that is the first non-whitespace text opens it. It ends at the first
  `</think>`, or at the end of generation. Reasoning text is stripped of leading and trailing
  whitespace. Nothing inside it is parsed. With `parse_reasoning=False` there is no reasoning:
  all text, think tags included, is content and `starts_in_reasoning` is ignored.
- Tool calls are parsed in content only, and only when `tools` is a non-empty list and
  `parse_tool_calls` is on; otherwise `<tool_call>` is plain content. Calls to functions not in
  `tools` are still returned. `ToolCallStart` comes as soon as the name is known (JSON form: the
  object opens with `{"name": "<string>"`; otherwise when the block completes; XML form: at the
  `>` of `<function=NAME>`). The `ToolCallArgsDelta`s of a call concatenate to its
  `ToolCallEnd.arguments`, compact JSON (`json.dumps(value, ensure_ascii=False, separators=(",",
  ":"))`). JSON form: one delta when the block completes. XML form: streamed as it settles (a
  string value chunk by chunk, other values whole at their `</parameter>`, `}` at the end; a
  parameter the model repeats appears twice, JSON readers keep the last). Call ids are
  `id_prefix` + 24 random hex digits, unique within the parser.
- A malformed block is content with its original text (see `adapters.parsers.stream`): bad JSON,
  a missing name, an unknown structure, a block unterminated at `finish`. If its call was already
  announced, it is abandoned: no `ToolCallEnd`, absent from `tool_calls`, index not reused.
- Whitespace (`str.isspace`): reasoning is `strip()`ped (the `\\n` after `<think>` and the
  newlines before `</think>` go). Content is cut into segments at the start of content (start of
  generation or just after `</think>`), at each completed tool-call block and at the end of
  generation; every segment is `strip()`ped, so the blank lines after `</think>`, leading
  whitespace, whitespace-only text between / around calls and trailing whitespace vanish. A
  malformed or abandoned block is ordinary content text inside its segment: the whitespace
  around it is kept, and its own text is verbatim.
"""

from __future__ import annotations

from typing import Any

from adapters.parsers import deepseek, dsml
from adapters.parsers.base import OutputParser
from adapters.parsers.events import (
    ContentDelta,
    ParseEvent,
    ReasoningDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    merge_events,
)
from adapters.parsers.glm import GlmCallScanner
from adapters.parsers.harmony import HarmonyOutputParser
from adapters.parsers.stream import TOOL_CALL_OPEN, ChooseScanner, QwenOutputParser, qwen_scanner
from adapters.parsers.tagged_args import ParamTypes

# family -> (the tag that opens a call block, how its body is read, tags dropped from content)
_SYNTAX: dict[str, tuple[str, ChooseScanner, tuple[str, ...]]] = {
    "qwen3": (TOOL_CALL_OPEN, qwen_scanner, ()),
    "qwen3_5": (TOOL_CALL_OPEN, qwen_scanner, ()),
    "glm4": (TOOL_CALL_OPEN, lambda types, first: GlmCallScanner(types), ()),
    "deepseek_v3": (deepseek.CALL_OPEN, lambda types, first: deepseek.DeepSeekCallScanner(), deepseek.SECTION_TAGS),
    "kimi_k2": (deepseek.KIMI_CALL_OPEN, lambda types, first: deepseek.KimiCallScanner(), deepseek.KIMI_SECTION_TAGS),
    "deepseek_v32": (dsml.INVOKE_OPEN, lambda types, first: dsml.DsmlCallScanner(types), dsml.SECTION_TAGS),
}
FAMILIES: tuple[str, ...] = (*_SYNTAX, "harmony")


from adapters.parsers.settled import SettledParser  # noqa: E402


def create_parser(
    family: str,
    tools: list[dict[str, Any]] | None = None,
    *,
    starts_in_reasoning: bool = False,
    parse_reasoning: bool = True,
    parse_tool_calls: bool = True,
    id_prefix: str = "call_",
    settle_tool_calls: bool = True,
) -> OutputParser:
    """A new parser for one request's output. Raises ValueError for an unknown family. With
    `settle_tool_calls` (the default) a call is announced only when complete (`SettledParser`)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown parser family {family!r}; known: {', '.join(FAMILIES)}")
    if family == "harmony":  # calls are announced whole: nothing to settle
        return HarmonyOutputParser(parse_reasoning=parse_reasoning, parse_tool_calls=parse_tool_calls and bool(tools),
                                   id_prefix=id_prefix)
    parser = QwenOutputParser(
        types=ParamTypes(tools),
        starts_in_reasoning=starts_in_reasoning,
        parse_reasoning=parse_reasoning,
        parse_tool_calls=parse_tool_calls and bool(tools),
        id_prefix=id_prefix,
        open_tag=_SYNTAX[family][0],
        choose=_SYNTAX[family][1],
        drop_tags=_SYNTAX[family][2],
    )
    return SettledParser(parser) if settle_tool_calls else parser


__all__ = [
    "FAMILIES",
    "ContentDelta",
    "OutputParser",
    "ParseEvent",
    "ReasoningDelta",
    "ToolCallArgsDelta",
    "ToolCallEnd",
    "ToolCallStart",
    "create_parser",
    "merge_events",
]
