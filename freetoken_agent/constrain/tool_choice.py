"""OpenAI `tool_choice` "required" / named function, enforced by constrained decoding.

Contract:
    `tool_call_constraint(tokenizer, family, tools, choice, eos_token_ids)` returns
    `(forced_prefix, constraint)`. The caller appends `forced_prefix` to the rendered prompt (after
    the assistant generation prompt, thinking disabled) and submits with `constraint`; the
    generated text is then, whatever the model's scores, the rest of one or more well-formed tool
    calls in the family's format (see `grammar.py`), and an EOS id is allowed only after a
    complete call (and then, apart from `\\n<tool_call>\\n` starting another call, nothing else).
    The full assistant text is `forced_prefix + decode(generated ids)`.

    * `family`: "qwen3" (JSON calls) or "qwen3_5" (XML calls); the arch names "qwen3_moe" /
      "qwen3_5_moe" are accepted too.
    * `tools`: OpenAI function tools `[{"type": "function", "function": {"name", "parameters"}}]`
      (a bare `{"name", "parameters"}` is accepted as well; entries of another `type` are
      skipped).
    * `choice`: "required" (any of the tools), or `{"type": "function", "function": {"name": X}}`
      (also `{"type": "function", "name": X}`): every call is to X.
    * Forced prefixes: "required" -> `"<tool_call>\\n"`; named qwen3 ->
      `'<tool_call>\\n{"name": "X", "arguments":'` (no trailing space: the model writes ` {` as
      the usual single token); named qwen3_5 -> `"<tool_call>\\n<function=X>\\n"`.
    * `parallel_tool_calls=False` ends the output after the first call; `max_whitespace` (default 2) caps
      each run of JSON whitespace between tokens.
    * ValueError (with a message fit for an API error) for: no function tools, a named function
      not among them, duplicate names, a "auto"/"none"/unknown choice, a qwen3_5 function name
      that the XML form cannot carry, no EOS id.

    Compiled grammars (and their lazily built DFAs) are cached per (family, tools, choice, options),
    so repeated requests with the same tool set reuse each other's work.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from freetoken_agent.constrain.dfa import ToolCallConstraint, token_table
from freetoken_agent.constrain.grammar import DEFAULT_MAX_WS, Family, ToolCallGrammar
from freetoken_agent.tokenizer import ChatTokenizer

_FAMILIES: dict[str, Family] = {"qwen3": "qwen3", "qwen3_moe": "qwen3", "qwen3_5": "qwen3_5",
                                "qwen3_5_moe": "qwen3_5"}
_CACHE_SIZE = 64
_cache: OrderedDict[str, ToolCallGrammar] = OrderedDict()
_cache_lock = threading.Lock()


def _functions(tools: Sequence[Mapping[str, Any]] | None) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    seen: set[str] = set()
    for i, tool in enumerate(tools or ()):
        if not isinstance(tool, Mapping):
            raise ValueError(f"tools[{i}] must be an object")
        if tool.get("type", "function") != "function":
            continue
        fn = tool.get("function", tool)
        name = fn.get("name") if isinstance(fn, Mapping) else None
        if not isinstance(name, str) or not name:
            raise ValueError(f"tools[{i}].function.name must be a non-empty string")
        if name in seen:
            raise ValueError(f"tools: duplicate function name {name!r}")
        seen.add(name)
        out.append((name, fn.get("parameters")))
    if not out:
        raise ValueError("tool_choice 'required' or a named function needs a non-empty list of function tools")
    return out


def _chosen_name(choice: str | Mapping[str, Any]) -> str | None:
    if isinstance(choice, str):
        if choice == "required":
            return None
        raise ValueError(f"tool_choice {choice!r} is not enforced by a constraint (only 'required' or a "
                         "named function)")
    if isinstance(choice, Mapping) and choice.get("type", "function") == "function":
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else choice.get("name")
        if isinstance(name, str) and name:
            return name
    raise ValueError('tool_choice must be "required" or {"type": "function", "function": {"name": ...}}')


def build_grammar(family: str, tools: Sequence[Mapping[str, Any]], choice: str | Mapping[str, Any], *,
                  parallel_tool_calls: bool = True, max_whitespace: int = DEFAULT_MAX_WS) -> ToolCallGrammar:
    """The (cached) grammar of a request; tokenizer-independent. Raises ValueError as documented."""
    fam = _FAMILIES.get(family)
    if fam is None:
        raise ValueError(f"unknown tool-call family {family!r} (expected one of {', '.join(_FAMILIES)})")
    functions = _functions(tools)
    names = [n for n, _ in functions]
    chosen = _chosen_name(choice)
    if chosen is not None and chosen not in names:
        raise ValueError(f"tool_choice names function {chosen!r}, which is not among the tools "
                         f"({', '.join(names)})")
    if fam == "qwen3_5":
        bad = [n for n in names if any(c in n for c in "<>\n\r")]
        if chosen in bad or (chosen is None and len(bad) == len(names)):
            culprit = chosen if chosen in bad else bad[0]
            raise ValueError(f"function name {culprit!r} cannot be written in the XML tool-call format")
    try:
        key = json.dumps([fam, functions, chosen, parallel_tool_calls, max_whitespace], sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"tools are not JSON-serialisable: {exc}") from None
    with _cache_lock:
        grammar = _cache.get(key)
        if grammar is not None:
            _cache.move_to_end(key)
            return grammar
    if chosen is not None:
        callable_tools = [names.index(chosen)]
    else:
        callable_tools = [i for i, n in enumerate(names) if fam == "qwen3" or not any(c in n for c in "<>\n\r")]
    grammar = ToolCallGrammar(fam, names, [p for _, p in functions], callable_tools,
                              named=None if chosen is None else names.index(chosen),
                              parallel=parallel_tool_calls, max_ws=max_whitespace)
    with _cache_lock:
        grammar = _cache.setdefault(key, grammar)
        while len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
    return grammar


def tool_call_constraint(tokenizer: ChatTokenizer, family: str, tools: Sequence[Mapping[str, Any]],
                         choice: str | Mapping[str, Any], eos_token_ids: Sequence[int], *,
                         parallel_tool_calls: bool = True,
                         max_whitespace: int = DEFAULT_MAX_WS) -> tuple[str, ToolCallConstraint]:
    """`(forced_prefix, constraint)` enforcing `choice` over `tools` (see the module docstring)."""
    grammar = build_grammar(family, tools, choice, parallel_tool_calls=parallel_tool_calls,
                            max_whitespace=max_whitespace)
    eos = [int(t) for t in eos_token_ids]
    if not eos and tokenizer.eos_token_id is not None:
        eos = [tokenizer.eos_token_id]
    if not eos:
        raise ValueError("a tool-call constraint needs at least one EOS token id")
    return grammar.forced_prefix, ToolCallConstraint(grammar, token_table(tokenizer), eos)
