"""A tiny stand-in for the Hugging Face Hub on loopback, for `pull` tests: enough of its HTTP API
for `huggingface_hub.snapshot_download` (repo info, file tree, HEAD / GET of `resolve/` with Range).

Contract: `FakeHub(repos)` serves `repos` ({repo_id: {path: bytes}}) at revision `main` (commit
`COMMIT`) on 127.0.0.1; `start()` returns its base URL (for `HF_ENDPOINT`), `stop()` ends it.
`requests` lists (method, path, Range header) of every request. With `drop_after=N`, the first GET
of a file larger than N bytes sends N bytes and closes the connection (a broken download); a GET of
a path in `fail` answers 500. Unknown repositories and revisions answer 404 with the Hub's
`X-Error-Code` header.
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote, urlsplit

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    def __init__(self, repos: dict[str, dict[str, bytes]], drop_after: int | None = None) -> None:
        self.repos, self.drop_after = repos, drop_after
        self.fail: set[str] = set()
        self.requests: list[tuple[str, str, str | None]] = []
        self._dropped: set[str] = set()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                return None

            def do_HEAD(self) -> None:
                hub._handle(self, head=True)

            def do_GET(self) -> None:
                hub._handle(self, head=False)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def start(self) -> str:
        self._thread.start()
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    # -- the API ----------------------------------------------------------------------------------

    def _send(self, h: BaseHTTPRequestHandler, status: int, body: bytes, headers: dict[str, str],
              head: bool = False) -> None:
        h.send_response(status)
        for k, v in headers.items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if not head:
            h.wfile.write(body)

    def _json(self, h: BaseHTTPRequestHandler, value: Any, status: int = 200, error: str | None = None) -> None:
        headers = {"Content-Type": "application/json"}
        if error:
            headers["X-Error-Code"] = error
        self._send(h, status, json.dumps(value).encode(), headers)

    def _repo(self, parts: list[str]) -> tuple[str, list[str]]:
        return "/".join(parts[:2]), parts[2:]

    def _handle(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        url = urlsplit(h.path)
        self.requests.append((h.command, url.path, h.headers.get("Range")))
        parts = [unquote(p) for p in url.path.strip("/").split("/")]
        if parts[:2] == ["api", "models"]:
            repo, rest = self._repo(parts[2:])
            files = self.repos.get(repo)
            if files is None:
                return self._json(h, {"error": "Repository not found"}, 404, "RepoNotFound")
            if len(rest) >= 2 and rest[1] not in ("main", COMMIT):
                return self._json(h, {"error": "Invalid rev id"}, 404, "RevisionNotFound")
            if rest[:1] == ["tree"]:
                return self._json(h, [{"type": "file", "path": p, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                                      for p, b in files.items()])
            return self._json(h, {"id": repo, "modelId": repo, "sha": COMMIT, "private": False,
                                  "siblings": [{"rfilename": p} for p in files]})
        repo, rest = self._repo(parts)
        files = self.repos.get(repo)
        if files is None or len(rest) < 3 or rest[0] != "resolve":
            return self._json(h, {"error": "Repository not found"}, 404, "RepoNotFound")
        if rest[1] not in ("main", COMMIT):
            return self._json(h, {"error": "Invalid rev id"}, 404, "RevisionNotFound")
        name = "/".join(rest[2:])
        if name not in files:
            return self._json(h, {"error": "Entry not found"}, 404, "EntryNotFound")
        if name in self.fail and not head:
            return self._json(h, {"error": "Internal Error"}, 500)
        data = files[name]
        start = 0
        rng = h.headers.get("Range")
        if rng and rng.startswith("bytes="):
            start = int(rng[6:].split("-")[0])
        body = data[start:]
        headers = {"ETag": f'"{hashlib.sha1(data).hexdigest()}"', "X-Repo-Commit": COMMIT,
                   "Content-Type": "application/octet-stream", "Accept-Ranges": "bytes"}
        status = 206 if start else 200
        if start:
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        if head or self.drop_after is None or len(body) <= self.drop_after or name in self._dropped:
            return self._send(h, status, body, headers, head)
        self._dropped.add(name)  # a broken transfer: part of the bytes, then the connection closes
        h.send_response(status)
        for k, v in headers.items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body[:self.drop_after])
        h.wfile.flush()
        h.close_connection = True
