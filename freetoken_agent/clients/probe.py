"""Ask a running freetoken-agent server what it serves, so a client's config matches it.

Contract: `served_model(base_url, api_key=None, timeout=2.0)` GETs `{base_url}/v1/models` and
returns a `ServedModel` (the first model's id, context window and output limit), or raises
`ProbeError` (a `ValueError`) with a one-line reason when nothing answers, the key is refused or
the answer is not a model list. Standard library only; no other I/O.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


class ProbeError(ValueError):
    """The server did not say what it serves; the message says why."""


@dataclass(frozen=True)
class ServedModel:
    id: str
    context_window: int
    max_output_tokens: int | None


def served_model(base_url: str, api_key: str | None = None, timeout: float = 2.0) -> ServedModel:
    import urllib.error
    import urllib.request  # here, not at the top: the command line's --help imports this module

    url = base_url.rstrip("/").removesuffix("/v1") + "/v1/models"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout) as r:
            body = json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise ProbeError(f"{url} answered HTTP {e.code}") from None
    except (urllib.error.URLError, OSError) as e:
        raise ProbeError(f"no server answered at {url} ({getattr(e, 'reason', e)})") from None
    except ValueError:
        raise ProbeError(f"{url} did not answer JSON") from None
    try:
        card = body["data"][0]
        window = int(card.get("context_window") or card["context_length"])
        out = card.get("max_output_tokens") or card.get("max_tokens")
        return ServedModel(str(card["id"]), window, int(out) if out else None)
    except (KeyError, IndexError, TypeError, ValueError):
        raise ProbeError(f"{url} did not answer a model list") from None
