"""The HTTP/1.1 transport under the app: uvicorn's h11 server with connection-level limits.

Contract: `serve(app, state, host, port, log_level, shutdown_grace)` runs the app until SIGTERM or
SIGINT. Per connection (`GuardedH11`): a request head (request line and headers) must arrive
within `HEADER_TIMEOUT_S` of the connection opening or of the previous response, however slowly
its bytes trickle in, else the connection is closed; a head larger than `MAX_HEAD_BYTES` is
answered `431 Request Header Fields Too Large` (the rest of what the client sends is read and
dropped, boundedly, so it reads the answer instead of a reset); an idle keep-alive connection is
closed after `KEEP_ALIVE_S`. At most `MAX_CONCURRENCY` connections and tasks (uvicorn answers 503
past it). On SIGTERM the listener closes, new POSTs get a 503, running generations go on for
`shutdown_grace` seconds, then each open stream ends with its protocol's error event
(adapters/common.py `Drain`), and the process exits.
"""

from __future__ import annotations

import asyncio
import logging
from types import FrameType
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from adapters.state import AppState

HEADER_TIMEOUT_S = 10.0
KEEP_ALIVE_S = 5.0
MAX_HEAD_BYTES = 64 * 1024
MAX_CONCURRENCY = 512
DISCARD_BYTES, DISCARD_S = 4 << 20, 5.0
log = logging.getLogger("freetoken.server")


class GuardedH11(H11Protocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_bytes = 0
        self._discarding = 0  # > 0: bytes dropped after a 431

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._discarding:
            self._discarding += len(data)
            if self._discarding > DISCARD_BYTES:
                self.transport.close()
            return
        if self.conn.their_state is h11.IDLE:
            self._head_bytes += len(data)
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE and self.conn.their_state is not h11.ERROR:
            self._disarm_head_timer()  # the head is complete: the request runs
            self._head_bytes = 0

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_head_timer()

    def send_400_response(self, msg: str) -> None:
        if self._head_bytes <= MAX_HEAD_BYTES:
            super().send_400_response(msg)
            return
        body = f"request head larger than {MAX_HEAD_BYTES} bytes".encode()
        self.transport.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: text/plain; "
                             b"charset=utf-8\r\nconnection: close\r\ncontent-length: "
                             + str(len(body)).encode() + b"\r\n\r\n" + body)
        self._discarding = 1
        self.loop.call_later(DISCARD_S, self.transport.close)

    def _arm_head_timer(self) -> None:
        self._disarm_head_timer()
        self._head_bytes = 0
        self._head_timer = self.loop.call_later(HEADER_TIMEOUT_S, self._head_timeout)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self.cycle is None or self.cycle.response_complete:
            self.transport.close()


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: AppState, grace: float) -> None:
        super().__init__(config)
        self.state, self.grace = state, grace

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.state.drain.started():
            log.warning("shutting down: running generations get %.1f s to finish", self.grace)
        self.state.drain.begin(self.grace)
        super().handle_exit(sig, frame)


def serve(app: Any, state: AppState, host: str, port: int, log_level: str, shutdown_grace: float) -> None:
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, http=GuardedH11,
                            timeout_keep_alive=int(KEEP_ALIVE_S), limit_concurrency=MAX_CONCURRENCY,
                            h11_max_incomplete_event_size=MAX_HEAD_BYTES,
                            timeout_graceful_shutdown=int(shutdown_grace + 3))
    DrainingServer(config, state, shutdown_grace).run()
