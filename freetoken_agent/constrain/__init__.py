"""Constrained decoding of tool calls (OpenAI `tool_choice` "required" and named functions).

Contract: `tool_call_constraint(tokenizer, family, tools, choice, eos_token_ids)` returns
`(forced_prefix, constraint)`; append the prefix to the rendered prompt and pass the constraint to
`Engine.submit(..., constraint=...)`: the output is then guaranteed to be well-formed tool calls
in the family's format, ended by EOS (unless `max_tokens` cuts it short). `build_grammar` gives
the tokenizer-free grammar (`ToolCallGrammar.classify(text)` checks a text by hand). Details in
`tool_choice.py` (API), `grammar.py` (the language), `schema.py` (what of a JSON schema is
enforced) and `dfa.py` (token-level matching and its cost).
"""

from freetoken_agent.constrain.dfa import ToolCallConstraint
from freetoken_agent.constrain.grammar import ToolCallGrammar
from freetoken_agent.constrain.tool_choice import build_grammar, tool_call_constraint

__all__ = ["ToolCallConstraint", "ToolCallGrammar", "build_grammar", "tool_call_constraint"]
