"""The server a coding-agent client is pointed at, and the constants every client's config shares.

Contract: `ClientTarget(base_url, model, api_key, context_window, max_output_tokens)` validates
and normalises its fields on construction (raising `ValueError` with a one-line message): the base
URL becomes the server root without a trailing `/` or `/v1`. `openai_base_url` is that root plus
`/v1`; `key` is the API key, or the placeholder `"freetoken"` when none is set. `DEFAULTS` holds the
default context window and output limit. No I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

PROVIDER_ID = "freetoken"
PROVIDER_NAME = "FreeToken (local)"
PLACEHOLDER_API_KEY = "freetoken"  # sent when no key is configured; the local server ignores it
REQUEST_TIMEOUT_MS = 3_000_000  # 50 min for a whole request: long prefills of large contexts
CHUNK_TIMEOUT_MS = 600_000  # 10 min between streamed chunks

DEFAULTS = {"context_window": 32768, "max_output_tokens": 8192}


@dataclass(frozen=True)
class ClientTarget:
    """The server a client is pointed at.

    `base_url` is the server root: a trailing `/` or `/v1` is removed (Claude Code wants the
    root, the OpenAI-style clients get `base_url + "/v1"`). `api_key=None` means the placeholder
    `"freetoken"` is sent. `max_output_tokens` must be smaller than `context_window`.
    """

    base_url: str = "http://127.0.0.1:8000"
    model: str = "freetoken-demo"
    api_key: str | None = None
    context_window: int = DEFAULTS["context_window"]
    max_output_tokens: int = DEFAULTS["max_output_tokens"]

    def __post_init__(self) -> None:
        url = self.base_url.strip().rstrip("/")
        url = url.removesuffix("/v1").rstrip("/")
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc or parts.query or parts.fragment:
            raise ValueError(f"base URL must look like http://HOST:PORT, got {self.base_url!r}")
        object.__setattr__(self, "base_url", url)
        if not self.model or any(c.isspace() for c in self.model):
            raise ValueError(f"model name must be non-empty without spaces, got {self.model!r}")
        if self.api_key is not None and (not self.api_key or any(c.isspace() for c in self.api_key)):
            raise ValueError("API key must be non-empty without spaces")
        for name in ("context_window", "max_output_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_output_tokens >= self.context_window:
            raise ValueError(f"max output tokens ({self.max_output_tokens}) must be smaller than "
                             f"the context window ({self.context_window})")

    @property
    def openai_base_url(self) -> str:
        return self.base_url + "/v1"

    @property
    def key(self) -> str:
        return self.api_key or PLACEHOLDER_API_KEY
