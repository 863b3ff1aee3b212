"""Sanitising captured traffic before it is stored: no home paths, keys, tokens or machine ids.

Contract: `Sanitiser(roots, secrets)` rewrites every string inside a JSON value (dict keys too):
- each path in `roots` (longest first; the caller passes the throw-away dir, its realpath, the real
  home and the repository) becomes its placeholder (`/tmp/ftwork` by default), also where a client
  spells it as a slug with `-` for every non-alphanumeric character;
- each literal in `secrets`, and anything shaped like an API key (`sk-...`, `sk-ant-...`,
  `Bearer ...`), becomes `sk-redacted`;
- UUIDs and long hex ids (32+ hex digits: device ids, request ids) become stable placeholders
  (`00000000-0000-4000-8000-00000000000N`, same length and shape; the same id always maps to the
  same placeholder within one sanitiser), so session structure and prompt lengths stay realistic;
- the machine's host and user name become `host` / `user`.
`headers(h)` keeps only the headers in `KEEP_HEADERS` (auth headers are never kept).
"""

from __future__ import annotations

import getpass
import re
import socket
from typing import Any

KEEP_HEADERS = {"content-type", "anthropic-version", "anthropic-beta", "x-app", "openai-beta", "user-agent",
                "x-session-affinity", "x-session-id", "x-claude-code-session-id", "x-parent-session-id",
                "session_id", "session-id", "originator", "x-codex-window-id", "x-client-request-id"}
KEY_RE = re.compile(r"\b(?:sk-ant-[A-Za-z0-9_\-]{8,}|sk-[A-Za-z0-9_\-]{8,}|Bearer\s+[A-Za-z0-9_\-.=]{8,})")
UUID_RE = re.compile(r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b")
HEX_RE = re.compile(r"\b[0-9a-fA-F]{32,}\b")
PLACEHOLDER_UUID = "00000000-0000-4000-8000"  # + "-" + 12 digits
COMMON_WORDS = {"root", "user", "admin", "work", "home"}  # names too common to replace in prose


class Sanitiser:
    def __init__(self, roots: dict[str, str] | list[str], secrets: list[str] | None = None) -> None:
        if isinstance(roots, list):
            roots = {r: "/tmp/ftwork" for r in roots}
        pairs = [(r.rstrip("/"), p) for r, p in roots.items() if r and r.strip("/")]
        # Clients also spell a path as a slug: Claude Code turns every non-alphanumeric character
        # into "-" (/tmp/ft_x/work -> -tmp-ft-x-work).
        pairs += [(re.sub(r"[^A-Za-z0-9]", "-", r), re.sub(r"[^A-Za-z0-9]", "-", p)) for r, p in pairs]
        self.roots = sorted(pairs, key=lambda rp: -len(rp[0]))
        self.secrets = sorted((s for s in secrets or [] if len(s) >= 6), key=len, reverse=True)
        self.ids: dict[str, str] = {}
        self.names = [(n, p) for n, p in ((socket.gethostname(), "host"), (getpass.getuser(), "user"))
                      if len(n) >= 4 and n not in COMMON_WORDS]

    def _id(self, m: re.Match[str]) -> str:
        raw = m.group(0)
        key = raw.lower()
        if key not in self.ids:
            n = len(self.ids) + 1
            if "-" in raw:
                self.ids[key] = f"{PLACEHOLDER_UUID}-{n:012d}"
            else:
                self.ids[key] = f"{n:0{len(raw)}x}"
        return self.ids[key]

    def text(self, s: str) -> str:
        for root, placeholder in self.roots:
            s = s.replace(root, placeholder)
        for secret in self.secrets:
            s = s.replace(secret, "sk-redacted")
        s = KEY_RE.sub("sk-redacted", s)
        s = UUID_RE.sub(self._id, s)
        s = HEX_RE.sub(self._id, s)
        for name, placeholder in self.names:
            s = re.sub(rf"\b{re.escape(name)}\b", placeholder, s)
        return s

    def value(self, obj: Any) -> Any:
        if isinstance(obj, str):
            return self.text(obj)
        if isinstance(obj, list):
            return [self.value(x) for x in obj]
        if isinstance(obj, dict):
            return {self.text(k): self.value(v) for k, v in obj.items()}
        return obj

    def headers(self, headers: dict[str, str]) -> dict[str, str]:
        return {k: self.text(v) for k, v in sorted(headers.items()) if k.lower() in KEEP_HEADERS}
