"""The output parser a served model gets: its chat template's call markers, then its family."""

from __future__ import annotations

import pytest

from adapters.parsers import FAMILIES as PARSER_FAMILIES
from freetoken_agent.service.chat import FAMILIES, parser_family
from freetoken_agent.tokenizer.build import chat_template


@pytest.mark.parametrize(("template_family", "model_family", "parser"), [
    ("qwen3", "qwen3_moe", "qwen3"),
    ("qwen3_5", "qwen3_5_moe", "qwen3_5"),
    ("gpt_oss", "gpt_oss", "harmony"),
    # the GLM-4.7-Flash-shaped demo carries Qwen3's template: its output is read as Qwen3's
    ("qwen3", "glm4_moe_lite", "qwen3"),
    ("qwen3", "deepseek_v3", "qwen3"),
])
def test_shipped_templates(template_family: str, model_family: str, parser: str) -> None:
    assert parser_family(model_family, chat_template(template_family)) == parser  # type: ignore[arg-type]


@pytest.mark.parametrize(("snippet", "parser"), [
    ("{{ '<tool_call>' + name }}<arg_key>{{ k }}</arg_key><arg_value>{{ v }}</arg_value>", "glm4"),
    ("{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + name}}", "deepseek_v3"),
    ("{{'<|tool_calls_section_begin|><|tool_call_begin|>functions.' + name}}", "kimi_k2"),
    ("{{ '<' + '｜DSML｜' + 'invoke name=\"' + name + '\">' }}", "deepseek_v32"),
])
def test_a_checkpoint_template_names_its_format(snippet: str, parser: str) -> None:
    # a real GLM / DeepSeek / Kimi checkpoint ships its own template; the family alone would not say
    for family in ("glm4_moe", "glm4_moe_lite", "deepseek_v3"):
        assert parser_family(family, "{% for m in messages %}" + snippet + "{% endfor %}") == parser


def test_every_mapping_names_a_parser() -> None:
    assert set(FAMILIES.values()) <= set(PARSER_FAMILIES)
    assert parser_family("qwen3_moe", None) == "qwen3"
