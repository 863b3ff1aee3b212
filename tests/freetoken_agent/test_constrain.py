"""Constrained tool calls: the grammar on hand-written text, the token-level constraint on a real
Qwen tokenizer, and end to end on the random demo models of both families.

Contracts checked: valid calls are accepted and malformed ones refused (bad JSON, names outside the
tool set, keys outside a closed schema, missing required keys, wrong JSON kinds, `</parameter>`
inside an XML value); every reachable state can still finish; EOS only after a complete call;
special tokens never inside strings; and a constrained random model always writes a call that
the format's parser (and `adapters.parsers`, when present) reads back, ending with EOS, while the
same model unconstrained does not.
"""

from __future__ import annotations

import inspect
import json
import random
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.engine import Engine
from engine.sampling import SamplingParams
from freetoken_agent.constrain import ToolCallGrammar, build_grammar, tool_call_constraint
from freetoken_agent.tokenizer import ChatTokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather forecast for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "days": {"type": "integer"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
ALARM = {
    "type": "function",
    "function": {
        "name": "set_alarm",
        "description": "Switch the alarm.",
        "parameters": {
            "type": "object",
            "properties": {"on": {"type": "boolean"}, "minutes": {"type": "integer"}},
            "required": ["on"],
            "additionalProperties": False,
        },
    },
}
RICH = {
    "type": "function",
    "function": {
        "name": "edit",
        "parameters": {
            "type": "object",
            "properties": {
                "path": {"type": "string"},
                "ratio": {"type": "number"},
                "lines": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
                "opts": {"type": "object", "properties": {"force": {"type": "boolean"}}, "required": ["force"]},
                "note": {"type": ["string", "null"]},
            },
            "required": ["path"],
        },
    },
}
FREE = {"type": "function", "function": {"name": "free", "parameters": {"type": "object"}}}
TOOLS = [WEATHER, ALARM, RICH, FREE]
E2E_TOOLS = [WEATHER, ALARM]


def named(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


def q3(name: str, args: str) -> str:
    return f'{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


def x(name: str, *params: tuple[str, str]) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
    return f"<function={name}>\n{body}</function>\n</tool_call>"


# ---------------------------------------------------------------------- format checkers

def _schema_of(tools: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return next(t["function"]["parameters"] for t in tools if t["function"]["name"] == name)


def _types(schema: dict[str, Any]) -> set[str]:
    t = schema.get("type")
    return {t} if isinstance(t, str) else set(t or ())


def check_value(value: Any, schema: dict[str, Any], where: str) -> None:
    types = _types(schema)
    if "enum" in schema:
        assert value in schema["enum"], f"{where}: {value!r} not in enum"
    kinds = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list,
             "object": dict, "null": type(None)}
    if types:
        assert any(isinstance(value, kinds[t]) and not (t in ("integer", "number") and isinstance(value, bool))
                   for t in types), f"{where}: {value!r} is not {types}"
    if isinstance(value, str) and "maxLength" in schema:
        assert len(value) <= schema["maxLength"], f"{where}: too long"
    if isinstance(value, dict):
        check_args(value, schema, where)
    if isinstance(value, list):
        assert len(value) <= schema.get("maxItems", len(value))
        for i, item in enumerate(value):
            check_value(item, schema.get("items", {}), f"{where}[{i}]")


def check_args(args: Any, schema: dict[str, Any], where: str = "arguments") -> None:
    assert isinstance(args, dict), f"{where} is not an object"
    props = schema.get("properties") or {}
    if props and schema.get("additionalProperties") is not True:
        assert set(args) <= set(props) | set(schema.get("required", ())), f"{where}: keys {set(args)}"
    assert set(schema.get("required", ())) <= set(args), f"{where}: required keys missing"
    for key, value in args.items():
        if key in props:
            check_value(value, props[key], f"{where}.{key}")


_Q3_CALL = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.S)
_X_CALL = re.compile(r"<tool_call>\n<function=([^<>\n]+)>\n")


def parse_calls(family: str, text: str, tools: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """The calls of `text` (the whole assistant output), checked against `tools`; AssertionError if bad."""
    calls: list[tuple[str, dict[str, Any]]] = []
    pos = 0
    while True:
        if family == "qwen3":
            m = _Q3_CALL.match(text, pos)
            assert m, f"no tool call at {pos}: {text[pos:]!r}"
            body = json.loads(m.group(1))
            assert isinstance(body, dict) and set(body) == {"name", "arguments"}, body
            name, args = body["name"], body["arguments"]
            pos = m.end()
        else:
            m = _X_CALL.match(text, pos)
            assert m, f"no tool call at {pos}: {text[pos:]!r}"
            name, args, pos = m.group(1), {}, m.end()
            while text.startswith("<parameter=", pos):
                end = text.index(">\n", pos)
                key = text[pos + len("<parameter="):end]
                close = text.index("</parameter>", end + 2)
                raw = text[end + 2:close]
                assert raw == "" or raw.endswith("\n"), f"value of {key} not closed by a newline"
                value: Any = raw[:-1] if raw else raw
                props = (_schema_of(tools, name).get("properties") or {}) if name in _names(tools) else {}
                types = _types(props.get(key, {}))
                if types and "string" not in types:
                    value = json.loads(value)
                assert key not in args, f"repeated parameter {key}"
                args[key] = value
                pos = close + len("</parameter>")
                assert text.startswith("\n", pos)
                pos += 1
            assert text.startswith("</function>\n</tool_call>", pos), text[pos:]
            pos += len("</function>\n</tool_call>")
        assert name in _names(tools), f"unknown function {name!r}"
        check_args(args, _schema_of(tools, name))
        calls.append((name, args))
        if pos == len(text):
            return calls
        assert text.startswith("\n", pos), text[pos:]
        pos += 1


def _names(tools: list[dict[str, Any]]) -> list[str]:
    return [t["function"]["name"] for t in tools]


def check_with_adapter_parser(family: str, text: str, tools: list[dict[str, Any]],
                              calls: list[tuple[str, dict[str, Any]]]) -> None:
    try:
        from adapters.parsers import ContentDelta, create_parser
    except ImportError:  # the adapters' parsers are optional here
        return
    kwargs = {"starts_in_reasoning": False} if "starts_in_reasoning" in inspect.signature(create_parser).parameters else {}
    parser = create_parser(family, tools, **kwargs)
    events = [*parser.feed(text), *parser.finish()]
    assert not [e for e in events if isinstance(e, ContentDelta) and e.text.strip()], events
    got = [(c.name, json.loads(c.arguments)) for c in parser.tool_calls]
    assert got == calls


# ---------------------------------------------------------------------- grammar on text

def classify(family: str, text: str, choice: Any = "required", tools: list[dict[str, Any]] = TOOLS,
             **kw: Any) -> str:
    return build_grammar(family, tools, choice, **kw).classify(text)


@pytest.mark.parametrize("text", [
    q3("get_weather", '{"city": "Paris"}'),
    q3("get_weather", '{"city": "Paris", "days": 3, "unit": "celsius"}'),
    q3("get_weather", '{"unit":"fahrenheit","city":"\\u00e9\\n\\"q\\"","days":-0}'),
    q3("get_weather", '{ "city" : "\\ud83d\\ude00" }'),
    q3("get_weather", '{"city": "Zürich 東京"}'),
    q3("set_alarm", '{"on": true, "minutes": 15}'),
    q3("edit", '{"path": "a/b.py", "ratio": -1.5e-3, "lines": [1, 2, 3], "opts": {"force": false}, "note": null}'),
    q3("edit", '{"path": "", "ratio": 0.25, "lines": [], "note": "x"}'),
    q3("free", '{"anything": {"deep": [1, "two", {"3": [true, false, null]}]}, "e": 1E+2}'),
    q3("free", "{}"),
    q3("set_alarm", '{"on": false}') + "\n<tool_call>\n" + q3("get_weather", '{"city": "Oslo"}'),
])
def test_qwen3_accepts_valid_calls(text: str) -> None:
    assert classify("qwen3", text) == "complete"
    parse_calls("qwen3", "<tool_call>\n" + text, TOOLS)


@pytest.mark.parametrize("text", [
    q3("get_weather", '{"town": "Paris"}'),                         # key outside the schema
    q3("set_alarm", '{"on": true, "extra": 1}'),                     # additionalProperties false
    q3("get_weather", '{"days": 3}'),                                # required "city" missing
    q3("get_weather", '{"city": "Paris", "city": "Rome"}'),          # repeated key
    q3("delete_all", '{}'),                                          # name outside the tool set
    q3("get_weathe", '{"city": "x"}'),
    q3("get_weather", '{"city": 3}'),                                # wrong kind
    q3("get_weather", '{"city": "x", "days": 2.5}'),                 # integer expected
    q3("get_weather", '{"city": "x", "unit": "kelvin"}'),            # not in enum
    q3("get_weather", '{"city": "far too long a city"}'),            # maxLength
    q3("edit", '{"path": "p", "lines": [1, 2, 3, 4]}'),              # maxItems
    q3("edit", '{"path": "p", "opts": {}}'),                         # nested required
    q3("free", '{"a": 01}'),                                         # bad JSON below
    q3("free", '{"a": 1.}'),
    q3("free", '{"a": .5}'),
    q3("free", '{"a": [1, 2,]}'),
    q3("free", '{"a": 1,}'),
    q3("free", '{"a" 1}'),
    q3("free", "{'a': 1}"),
    q3("free", '{"a": tru}'),
    q3("free", '{"a": "line\nbreak"}'),
    q3("free", '{"a": "\\x"}'),
    q3("free", '{"a": "\\ud800"}'),                                  # lone surrogate
    q3("free", '{"a": NaN}'),
    q3("free", "[]"),                                                # arguments must be an object
    q3("free", '{"a":   1}'),                                        # whitespace run over the cap
    q3("free", '{"a": 1234567890123456789012}'),                     # over 20 digits
    '{"name": "free", "arguments": {}}</tool_call>',
    '{"name":"free", "arguments": {}}\n</tool_call>',
])
def test_qwen3_rejects_malformed_calls(text: str) -> None:
    assert classify("qwen3", text) == "invalid"


def test_qwen3_partial_and_after_completion() -> None:
    g = build_grammar("qwen3", TOOLS, "required")
    assert g.classify('{"name": "get_weather", "arguments": {"city": "Pa') == "partial"
    assert g.classify('{"name": "ge') == "partial"
    done = q3("free", "{}")
    assert g.classify(done + "\n<tool_call>\n") == "partial"
    assert g.classify(done + "\n") == "partial"
    assert g.classify(done + " ") == "invalid"
    assert g.classify(done + "\nHello") == "invalid"
    single = build_grammar("qwen3", TOOLS, "required", parallel_tool_calls=False)
    assert single.classify(done) == "complete"
    assert single.classify(done + "\n") == "invalid"


def test_named_choice_qwen3() -> None:
    g = build_grammar("qwen3", TOOLS, named("set_alarm"))
    assert g.forced_prefix == '<tool_call>\n{"name": "set_alarm", "arguments":'
    assert g.classify(' {"on": true}}\n</tool_call>') == "complete"
    assert g.classify('{"on": true}}\n</tool_call>') == "complete"
    assert g.classify(' {"city": "x"}}\n</tool_call>') == "invalid"
    assert g.classify(' {"on": true}}\n</tool_call>\n<tool_call>\n' + q3("set_alarm", '{"on": false}')) == "complete"
    assert g.classify(' {"on": true}}\n</tool_call>\n<tool_call>\n' + q3("free", "{}")) == "invalid"


@pytest.mark.parametrize("text", [
    x("get_weather", ("city", "Paris")),
    x("get_weather", ("unit", "celsius"), ("city", "Zürich"), ("days", "3")),
    x("get_weather", ("city", "")),
    "<function=get_weather>\n<parameter=city>\n</parameter>\n</function>\n</tool_call>",
    x("set_alarm", ("on", "true"), ("minutes", "5")),
    x("edit", ("path", "a <b> </function> </tool_call>\nline 2"), ("lines", "[1, 2]"),
      ("opts", '{"force": true}'), ("ratio", "2.5"), ("note", "null")),
    x("free", ("anything", "x"), ("other", "y\n")),
    x("free"),
    x("set_alarm", ("on", "false")) + "\n<tool_call>\n" + x("free"),
])
def test_qwen3_5_accepts_valid_calls(text: str) -> None:
    assert classify("qwen3_5", text) == "complete"
    parse_calls("qwen3_5", "<tool_call>\n" + text, TOOLS)


@pytest.mark.parametrize("text", [
    x("get_weather", ("town", "Paris")),                             # parameter outside the schema
    x("set_alarm", ("on", "true"), ("extra", "1")),
    x("get_weather", ("days", "3")),                                 # required "city" missing
    x("get_weather", ("city", "a"), ("city", "b")),                  # repeated parameter
    x("delete_all"),                                                 # name outside the tool set
    x("get_weather", ("city", "x"), ("days", "three")),              # integer expected
    x("get_weather", ("city", "x"), ("unit", "kelvin")),             # not in enum
    x("get_weather", ("city", "much too long a name")),              # maxLength
    x("set_alarm", ("on", "True")),                                  # JSON boolean expected
    x("set_alarm", ("on", " true")),                                 # JSON value right after the newline
    x("set_alarm", ("on", "true"), ("minutes", "1" * 21)),           # over 20 digits
    x("edit", ("path", "p"), ("opts", "{'force': 1}")),              # bad JSON value
    x("free", ("a b", "x")),                                         # key with a space
    "<function=get_weather>\n<parameter=city>\nParis</parameter>\n</function>\n</tool_call>",
    "<function=get_weather>\n<parameter=city>\nP</parameter>aris\n</parameter>\n</function>\n</tool_call>",
    "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function></tool_call>",
    "<function=get_weather>\n<parameter=city>\nParis\n</parameter></function>\n</tool_call>",
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
])
def test_qwen3_5_rejects_malformed_calls(text: str) -> None:
    assert classify("qwen3_5", text) == "invalid"


def test_named_choice_qwen3_5() -> None:
    g = build_grammar("qwen3_5", TOOLS, named("get_weather"))
    assert g.forced_prefix == "<tool_call>\n<function=get_weather>\n"
    assert g.classify("<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>") == "complete"
    assert g.classify("</function>\n</tool_call>") == "invalid"  # "city" is required
    assert g.classify("<parameter=on>\ntrue\n</parameter>\n") == "invalid"


@pytest.mark.parametrize(("tools", "choice", "message"), [
    ([], "required", "non-empty"),
    (None, named("x"), "non-empty"),
    ([WEATHER], named("set_alarm"), "not among the tools"),
    ([WEATHER], "auto", "not enforced"),
    ([WEATHER], {"type": "function"}, "tool_choice must be"),
    ([WEATHER, WEATHER], "required", "duplicate"),
])
def test_bad_requests_raise(tools: Any, choice: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_grammar("qwen3", tools, choice)
    with pytest.raises(ValueError, match="unknown tool-call family"):
        build_grammar("llama", [WEATHER], "required")


_PREFERRED = b'"]}>\n<'
_ORDER = list(_PREFERRED) + [b for b in range(256) if b not in _PREFERRED]


def _completion(g: ToolCallGrammar, state: Any, limit: int = 50_000) -> bytes | None:
    """Depth-first search over bytes (closing characters first) for a text that completes `state`."""
    seen: set[Any] = set()
    stack: list[tuple[Any, bytes]] = [(state, b"")]
    while stack and len(seen) < limit:
        cur, path = stack.pop()
        if cur in seen:
            continue
        seen.add(cur)
        if g.is_final(cur):
            return path
        if len(path) >= 400:
            continue
        for b in reversed(_ORDER):
            nxt = g.step(cur, b)
            if nxt is not None and nxt not in seen:
                stack.append((nxt, path + bytes((b,))))
    return None


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_every_reached_state_can_finish(family: str) -> None:
    """Random walks through the grammar: each state has a next byte and a path to completion."""
    rng = random.Random(7)
    for choice in ("required", named("edit")):
        g = build_grammar(family, TOOLS, choice)
        for _ in range(4):
            state = g.initial
            for i in range(150):
                options = [b for b in range(256) if g.step(state, b) is not None]
                assert options or g.is_final(state), state
                if not options:
                    break
                # Favour ASCII so that walks leave strings and reach structure now and then.
                ascii_ = [b for b in options if b < 0x80]
                state = g.step(state, rng.choice(ascii_ if ascii_ and rng.random() < 0.9 else options))
                if i % 25 == 0:
                    tail = _completion(g, state)
                    assert tail is not None, state
                    assert g.is_final(g.run(state, tail))


# ---------------------------------------------------------------------- demo models

@pytest.fixture(scope="module")
def models(demo_model: Callable[[str], Path]) -> Iterator[dict[str, tuple[Path, ChatTokenizer, Engine]]]:
    out: dict[str, tuple[Path, ChatTokenizer, Engine]] = {}
    try:
        for arch, family in (("qwen3_moe", "qwen3"), ("qwen3_5_moe", "qwen3_5")):
            path = demo_model(arch)
            out[family] = (path, ChatTokenizer.from_dir(path), Engine(path))
        yield out
    finally:
        for _, _, engine in out.values():
            engine.close()


MESSAGES = [{"role": "user", "content": "What is the weather in Paris, and set an alarm."}]


def _prompt(tok: ChatTokenizer, prefix: str) -> list[int]:
    text = tok.apply_chat_template(MESSAGES, tools=E2E_TOOLS, add_generation_prompt=True, enable_thinking=False)
    return tok.encode(text + prefix)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_token_level_rules(models: dict[str, Any], family: str) -> None:
    _, tok, engine = models[family]
    eos = list(engine.cfg.eos_token_ids)
    prefix, c = tool_call_constraint(tok, family, TOOLS, "required", eos)
    assert prefix == "<tool_call>\n"
    text = (q3("get_weather", '{"city": "Zürich 東京"}') if family == "qwen3"
            else x("get_weather", ("city", "Zürich 東京")))
    ids = tok.encode(text)
    assert any(tok.is_special(i) or i in tok.special_ids.values() for i in ids)  # </tool_call> as one token
    for i in ids:
        assert all(not c.allowed(e) for e in eos)
        assert c.allowed(i), tok.decode([i])
        c.advance(i)
    assert c.is_complete and all(c.allowed(e) for e in eos)
    open_call = tok.special_ids["<tool_call>"]
    assert not c.allowed(open_call)  # the separating newline comes first
    newline = tok.encode("\n")[0]
    assert c.allowed(newline)
    c.advance(newline)
    assert c.allowed(open_call) and not c.allowed(eos[0])
    assert not c.allowed(engine.cfg.vocab_size - 1)  # a padded row of the head, beyond the vocabulary
    with pytest.raises(ValueError):
        c.advance(tok.encode("x")[0])

    # Inside a string / free value: partial UTF-8 tokens yes, special tokens no.
    _, c = tool_call_constraint(tok, family, TOOLS, named("edit"), eos)
    head = ' {"path": "' if family == "qwen3" else "<parameter=path>\n"
    for i in tok.encode(head):
        c.advance(i)
    lead = next(i for i in range(256) if tok.token_bytes(i) == b"\xe6")  # first byte of a CJK character
    assert c.allowed(lead) and not c.allowed(open_call) and not c.allowed(eos[0])
    c.advance(lead)
    assert not c.allowed(tok.encode("a")[0])  # a continuation byte must follow
    assert c.allowed(next(i for i in range(256) if tok.token_bytes(i) == b"\x9d"))


def test_allowed_cost(models: dict[str, Any]) -> None:
    _, tok, engine = models["qwen3_5"]
    _, c = tool_call_constraint(tok, "qwen3_5", TOOLS, "required", engine.cfg.eos_token_ids)
    ids = random.Random(0).sample(range(tok.vocab_size), 20_000)
    for i in ids:  # first pass fills the token table and the DFA rows
        c.allowed(i)
    start = time.perf_counter()
    for i in ids:
        c.allowed(i)
    per_call = (time.perf_counter() - start) / len(ids)
    assert per_call < 50e-6, f"{per_call * 1e6:.1f} us per allowed() call"


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_constrained_demo_model_writes_valid_calls(models: dict[str, Any], family: str) -> None:
    _, tok, engine = models[family]
    eos = set(engine.cfg.eos_token_ids)
    # A random model finds few allowed tokens among its top scores, so each constrained step costs
    # the sampler a long scan: three short runs per family keep the test quick.
    runs = [("required", None, False), (named("get_weather"), 1, False), ("required", 2, True)]
    handles = []
    for choice, seed, parallel in runs:
        prefix, c = tool_call_constraint(tok, family, E2E_TOOLS, choice, list(eos), parallel_tool_calls=parallel)
        # 300 tokens cover the longest call these schemas allow even at one byte a token; a run
        # with parallel calls may go on writing calls, so it is only checked as far as it got.
        limit = 100 if parallel else 300
        params = (SamplingParams(max_tokens=limit) if seed is None
                  else SamplingParams(max_tokens=limit, temperature=1.0, seed=seed))
        handles.append((choice, prefix, c, engine.submit(_prompt(tok, prefix), params, constraint=c)))
    for choice, prefix, c, handle in handles:
        out = handle.result()
        ended = bool(out) and out[-1] in eos
        text = prefix + tok.decode(out[:-1] if ended else out)
        if not c.grammar.parallel:
            assert ended, f"no EOS within max_tokens: {text!r}"
        if not ended:  # a parallel run may still be writing calls at max_tokens: a valid prefix then
            assert c.grammar.classify(text[len(prefix):]) == "partial"
            continue
        calls = parse_calls(family, text, E2E_TOOLS)
        if choice != "required":
            assert {name for name, _ in calls} == {choice["function"]["name"]}
        if not c.grammar.parallel:
            assert len(calls) == 1
        check_with_adapter_parser(family, text, E2E_TOOLS, calls)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_unconstrained_demo_model_writes_no_valid_call(models: dict[str, Any], family: str) -> None:
    """Without the constraint the same random model writes no call: the constraint does the work."""
    _, tok, engine = models[family]
    runs = [(build_grammar(family, E2E_TOOLS, "required"), SamplingParams(max_tokens=16)),
            (build_grammar(family, E2E_TOOLS, named("get_weather")),
             SamplingParams(max_tokens=16, temperature=1.0, seed=5))]
    handles = [(g, engine.submit(_prompt(tok, g.forced_prefix), params)) for g, params in runs]
    for g, handle in handles:
        text = tok.decode(handle.result())
        assert g.classify(text) == "invalid", text
        with pytest.raises((AssertionError, ValueError)):
            parse_calls(family, g.forced_prefix + text, E2E_TOOLS)
