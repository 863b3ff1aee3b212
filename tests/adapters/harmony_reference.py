"""openai-harmony as an offline reference: its o200k_base ranks come from the installed
`bpe-openai` package (checked against tiktoken's published SHA-256) instead of a download."""

from __future__ import annotations

import gzip
import hashlib
import os
from functools import cache
from importlib import resources
from pathlib import Path
from tempfile import mkdtemp
from typing import Any

O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"


def o200k_rank_file() -> bytes:
    data = gzip.decompress((resources.files("bpe_openai") / "data" / "o200k_base.tiktoken.gz").read_bytes())
    assert hashlib.sha256(data).hexdigest() == O200K_SHA256
    return data


@cache
def harmony_encoding() -> Any:
    """openai-harmony's gpt-oss encoding, loaded from a local copy of the ranks."""
    import openai_harmony as oh

    folder = Path(mkdtemp(prefix="harmony-ranks-"))
    (folder / "o200k_base.tiktoken").write_bytes(o200k_rank_file())
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(folder)  # read by openai-harmony only, at load
    return oh.load_harmony_encoding(oh.HarmonyEncodingName.HARMONY_GPT_OSS)
