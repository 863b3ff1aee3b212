"""OpenAI `tool_choice` "required" / named function for the harmony format (gpt-oss), by prefix.

Contract: `harmony_call_prefix(tools, choice)` is the text appended after the generation prompt
(`<|start|>assistant`) so that the reply is a tool call: a named function (or the only function
of "required") gets its whole header, `<|channel|>commentary to=functions.NAME <|constrain|>json
<|message|>`, and the model writes the JSON arguments; "required" over several functions opens
the header up to `to=functions.` and the model writes the name. The arguments are not
grammar-constrained here (the Qwen formats' constraint does not speak harmony): output that is not
a JSON object comes back as text, as the parser's contract says. ValueError (an API error's
message) for the cases `tool_choice.build_grammar` rejects: no function tools, a named function
not among them, duplicate names, a choice that is not "required" or a named function.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from freetoken_agent.constrain.tool_choice import _chosen_name, _functions


def harmony_call_prefix(tools: Sequence[Mapping[str, Any]] | None, choice: str | Mapping[str, Any]) -> str:
    names = [name for name, _ in _functions(tools)]
    chosen = _chosen_name(choice)
    if chosen is not None and chosen not in names:
        raise ValueError(f"tool_choice names function {chosen!r}, which is not among the tools ({', '.join(names)})")
    if chosen is None and len(names) == 1:
        chosen = names[0]
    if chosen is None:
        return "<|channel|>commentary to=functions."
    return f"<|channel|>commentary to=functions.{chosen} <|constrain|>json<|message|>"
