"""Tokenizer and chat-template layer for Qwen model families.

Contract:
    * ``write_tokenizer(out_dir, family)`` builds HF-compatible tokenizer files from the real Qwen
      vocabularies (``family`` is ``"qwen3"`` or ``"qwen3_5"``) and returns a ``TokenizerInfo``.
    * ``ChatTokenizer.from_dir(model_dir)`` is the runtime wrapper (no ``transformers`` import):
      encode/decode, ``apply_chat_template`` and ``StreamDecoder`` for incremental detokenisation.
"""

from freetoken_agent.tokenizer.build import Family, TokenizerInfo, write_tokenizer
from freetoken_agent.tokenizer.chat import ChatTokenizer, StreamDecoder

__all__ = ["ChatTokenizer", "Family", "StreamDecoder", "TokenizerInfo", "write_tokenizer"]
