"""Recording reverse proxy for the real-client runner.

Contract: `RecordingProxy(upstream).start()` listens on 127.0.0.1 (a free port unless given) and
forwards every request to `upstream` over HTTP/1.1, streaming the response through unchanged (chunked
when the upstream sends no length). Each request and its response (first 4 MiB) are appended to
`exchanges` as an `Exchange`; `mark()` / `since(index)` give the ones after a point. `stop()` shuts it
down. Errors while forwarding are stored on the exchange (`error`), never raised.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
              "transfer-encoding", "upgrade", "host", "content-length"}


@dataclass
class Exchange:
    """One request through the proxy and what the server answered."""

    start: float
    method: str
    path: str
    req_headers: dict[str, str]
    req_body: bytes
    status: int = 0
    resp_headers: dict[str, str] = field(default_factory=dict)
    resp_body: bytes = b""
    duration: float = 0.0
    error: str | None = None

    @property
    def content_type(self) -> str:
        return self.resp_headers.get("content-type", "")

    def body_json(self) -> Any:
        try:
            return json.loads(self.req_body)
        except ValueError:
            return None


class RecordingProxy:
    """A threaded HTTP/1.1 reverse proxy that records every exchange, streaming responses through."""

    MAX_RECORDED = 4 * 1024 * 1024

    def __init__(self, upstream: str, port: int = 0) -> None:
        u = urllib.parse.urlsplit(upstream)
        self.up_host, self.up_port = u.hostname or "127.0.0.1", u.port or 80
        self.up_prefix = u.path.rstrip("/")
        self.exchanges: list[Exchange] = []
        self.lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _handle(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length) if length else b""
                if self.headers.get("transfer-encoding", "").lower() == "chunked":
                    body = self._read_chunked()
                ex = Exchange(time.time(), self.command, self.path,
                              {k.lower(): v for k, v in self.headers.items()}, body)
                with proxy.lock:
                    proxy.exchanges.append(ex)
                t0 = time.monotonic()
                try:
                    proxy._forward(self, ex)
                except Exception as e:  # the client went away, or the server did
                    ex.error = f"{type(e).__name__}: {e}"
                    self.close_connection = True
                finally:
                    ex.duration = time.monotonic() - t0

            def _read_chunked(self) -> bytes:
                out = b""
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                    if size == 0:
                        self.rfile.readline()
                        return out
                    out += self.rfile.read(size)
                    self.rfile.readline()

            do_GET = do_POST = do_HEAD = do_PUT = do_DELETE = do_OPTIONS = do_PATCH = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _forward(self, h: BaseHTTPRequestHandler, ex: Exchange) -> None:
        conn = http.client.HTTPConnection(self.up_host, self.up_port, timeout=900)
        headers = {k: v for k, v in h.headers.items() if k.lower() not in HOP_BY_HOP}
        headers["Host"] = f"{self.up_host}:{self.up_port}"
        if ex.req_body or ex.method in ("POST", "PUT", "PATCH"):
            headers["Content-Length"] = str(len(ex.req_body))
        conn.request(ex.method, self.up_prefix + ex.path, body=ex.req_body or None, headers=headers)
        resp = conn.getresponse()
        ex.status = resp.status
        ex.resp_headers = {k.lower(): v for k, v in resp.getheaders()}
        h.send_response_only(resp.status, resp.reason)
        for k, v in resp.getheaders():
            if k.lower() not in HOP_BY_HOP:
                h.send_header(k, v)
        length = resp.getheader("content-length")
        if ex.method == "HEAD" or resp.status in (204, 304):
            h.send_header("Content-Length", length or "0")
            h.end_headers()
            resp.read()
            conn.close()
            return
        chunked = length is None
        h.send_header("Transfer-Encoding", "chunked") if chunked else h.send_header("Content-Length", str(length))
        h.end_headers()
        h.wfile.flush()
        recorded = bytearray()
        while True:
            data = resp.read1(65536)
            if not data:
                break
            if len(recorded) < self.MAX_RECORDED:
                recorded += data
            if chunked:
                h.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            else:
                h.wfile.write(data)
            h.wfile.flush()
        if chunked:
            h.wfile.write(b"0\r\n\r\n")
            h.wfile.flush()
        ex.resp_body = bytes(recorded)
        conn.close()

    def start(self) -> RecordingProxy:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def since(self, index: int) -> list[Exchange]:
        with self.lock:
            return list(self.exchanges[index:])

    def mark(self) -> int:
        with self.lock:
            return len(self.exchanges)
