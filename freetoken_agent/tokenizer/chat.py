"""Runtime tokenizer: encode/decode, chat-template rendering and streaming detokenisation.

Contract:
    * :class:`ChatTokenizer` loads a model directory holding ``tokenizer.json`` and
      ``tokenizer_config.json`` (chat template from ``chat_template.jinja``, else the config's
      ``chat_template``) with the ``tokenizers`` library and jinja2 only; it never imports
      ``transformers``.
    * ``encode(text)`` matches ``AutoTokenizer.encode(text, add_special_tokens=False)``: added tokens
      written in the text (``<|im_start|>``, ``<think>``, ...) are recognised as single tokens.
    * ``apply_chat_template`` renders the same string as ``AutoTokenizer.apply_chat_template`` for
      the same arguments (same sandboxed Jinja environment options, same ``tojson``, the config's
      named special tokens ``bos_token``, ``eos_token``, ... as variables); before rendering it
      copies the messages, fills ``reasoning_content`` (and ``thinking`` when absent, which
      gpt-oss's template reads) from ``reasoning_content``/``reasoning``/``thinking`` and decodes
      tool-call ``arguments`` given as a JSON-object string into a mapping.
    * :class:`StreamDecoder` turns a stream of ids into text pieces whose concatenation equals
      ``decode(all_ids)`` and never splits a UTF-8 character (byte-level BPE vocabularies).
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Literal, overload

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from freetoken_agent.tokenizer.byte_level import token_to_bytes

_REASONING_ALIASES = ("reasoning_content", "reasoning", "thinking")
# the named special tokens transformers passes to every chat template (its SPECIAL_TOKENS_ATTRIBUTES)
_NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_template(source: str) -> jinja2.Template:
    """Compile a chat template in a sandbox configured like transformers' renderer."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _token_content(value: Any) -> str | None:
    if isinstance(value, Mapping):
        return value.get("content")
    return value


def _normalise_message(message: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(message)
    reasoning = next((out[k] for k in _REASONING_ALIASES if out.get(k) is not None), None)
    if reasoning is not None:
        out.setdefault("thinking", reasoning)
        out["reasoning_content"] = reasoning
    calls = out.get("tool_calls")
    if calls:
        out["tool_calls"] = [_normalise_call(call) for call in calls]
    return out


def _normalise_call(call: Mapping[str, Any]) -> dict[str, Any]:
    call = dict(call)
    holder = dict(call["function"]) if isinstance(call.get("function"), Mapping) else call
    args = holder.get("arguments")
    if isinstance(args, str):
        try:
            decoded = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            decoded = None
        if isinstance(decoded, dict):
            holder["arguments"] = decoded
    if holder is not call:
        call["function"] = holder
    return call


class ChatTokenizer:
    """A ``tokenizers.Tokenizer`` plus the model's chat template."""

    def __init__(self, tokenizer: Tokenizer, config: Mapping[str, Any], chat_template: str | None) -> None:
        self.tokenizer = tokenizer
        self.config = dict(config)
        self.chat_template = chat_template
        self._template = compile_template(chat_template) if chat_template else None
        added = tokenizer.get_added_tokens_decoder()
        self.special_ids: dict[str, int] = {tok.content: i for i, tok in sorted(added.items())}
        self._added: dict[int, tuple[str, bool]] = {i: (tok.content, tok.special) for i, tok in added.items()}
        self._bytes_cache: dict[int, bytes] = {}
        eos = _token_content(self.config.get("eos_token"))
        pad = _token_content(self.config.get("pad_token"))
        self.eos_token: str | None = eos
        named = ((name, _token_content(self.config.get(name))) for name in _NAMED_TOKENS)
        self.named_tokens: dict[str, str] = {name: value for name, value in named if value is not None}
        self.eos_token_id: int | None = self.token_to_id(eos) if eos else None
        self.pad_token_id: int | None = self.token_to_id(pad) if pad else None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ChatTokenizer:
        """Load ``tokenizer.json``, ``tokenizer_config.json`` and the chat template from ``model_dir``."""
        model_dir = Path(model_dir)
        tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.exists() else {}
        jinja_path = model_dir / "chat_template.jinja"
        template: Any
        if jinja_path.exists():  # takes precedence over the config's copy, as in transformers
            template = jinja_path.read_text(encoding="utf-8")
        else:
            template = config.get("chat_template")
            if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
                template = next((t["template"] for t in template if t.get("name") == "default"), None)
        return cls(tokenizer, config, template)

    @property
    def vocab_size(self) -> int:
        """Number of tokens the tokenizer knows (added tokens included), not the padded model size."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.tokenizer.id_to_token(token_id)

    def is_special(self, token_id: int) -> bool:
        """True for added tokens marked special (dropped by ``skip_special_tokens``)."""
        entry = self._added.get(token_id)
        return entry is not None and entry[1]

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; added tokens written in the text are recognised."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """Raw bytes of one token (UTF-8 of the content for added tokens)."""
        cached = self._bytes_cache.get(token_id)
        if cached is not None:
            return cached
        if token_id in self._added:
            raw = self._added[token_id][0].encode("utf-8")
        else:
            token = self.tokenizer.id_to_token(token_id)
            if token is None:
                raise KeyError(f"unknown token id {token_id}")
            raw = token_to_bytes(token)
        self._bytes_cache[token_id] = raw
        return raw

    @overload
    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = ...,
        add_generation_prompt: bool = ...,
        enable_thinking: bool = ...,
        tokenize: Literal[False] = ...,
        **kwargs: Any,
    ) -> str: ...

    @overload
    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = ...,
        add_generation_prompt: bool = ...,
        enable_thinking: bool = ...,
        *,
        tokenize: Literal[True],
        **kwargs: Any,
    ) -> list[int]: ...

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        enable_thinking: bool = True,
        tokenize: bool = False,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render ``messages`` (and ``tools``) with the chat template; token ids if ``tokenize``."""
        if self._template is None:
            raise ValueError("this tokenizer has no chat template")
        text = self._template.render(
            messages=[_normalise_message(m) for m in messages],
            tools=[dict(t) for t in tools] if tools else None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            enable_thinking=enable_thinking,
            **{**self.named_tokens, **kwargs},
        )
        return self.encode(text) if tokenize else text

    def stream_decoder(self, skip_special_tokens: bool = False) -> StreamDecoder:
        return StreamDecoder(self, skip_special_tokens=skip_special_tokens)


class StreamDecoder:
    """Incremental detokeniser: ``feed`` (alias ``push``) ids one at a time, ``flush`` at the end.

    Text is released only up to the last complete UTF-8 character; an incomplete tail is held
    back until later bytes complete it, and ``flush`` turns a still-incomplete tail into U+FFFD
    (as ``decode`` does).
    """

    def __init__(self, tokenizer: ChatTokenizer, skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty)."""
        if self._skip_special and self._tokenizer.is_special(token_id):
            return ""
        try:
            raw = self._tokenizer.token_bytes(token_id)
        except KeyError:
            return ""  # a padding row of the embedding: the model's vocab is larger than the tokenizer's
        return self._utf8.decode(raw)

    push = feed  # alias used by the CLI's streaming loop

    def feed_many(self, ids: Iterable[int]) -> str:
        return "".join(self.feed(i) for i in ids)

    def flush(self) -> str:
        """End of stream: return whatever is held back and reset."""
        tail = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return tail
