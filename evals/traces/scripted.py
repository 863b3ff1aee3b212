"""Scripted backend for trace capture: a recording proxy that forces each model reply from a script.

Contract: `ScriptedProxy(upstream, script, family)` is a `RecordingProxy` (same listening, forwarding
and recording) that, for every model request (POST to `/messages`, `/chat/completions` or
`/responses`, not `count_tokens`), normalises the body with the server's own protocol adapter,
asks `script.reply(req)` for the turn, renders it in the model family's format and forwards the
body with `freetoken_forced_output` set. The exchange keeps the client's original body
(`ex.client_body`), the reply (`ex.reply`, JSON-able) and the forced text (`ex.forced`), so a trace
stores what the client sent, not what the proxy added. A body the adapter refuses is forwarded
untouched (the server then answers the client's error itself).

Benchmark only: the model's own sampling is replaced, so this measures the client and the cache,
never the model's quality. `python -m evals.traces.scripted --upstream URL --workdir DIR` runs it by
hand (capture.py starts it itself).
"""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler
from typing import Any

from adapters import anthropic_messages, openai_chat, openai_responses
from adapters.common import FORCED_OUTPUT_FIELD, ApiError
from evals.clients.proxy import Exchange, RecordingProxy
from evals.traces.script import Script, render
from freetoken_agent.service import ChatRequest

MODEL_PATHS = {"/messages": anthropic_messages.to_chat_request,
               "/chat/completions": openai_chat.to_chat_request,
               "/responses": openai_responses.to_chat_request}


def normalise(path: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> ChatRequest | None:
    """The `ChatRequest` the server would build for this model request, or None (not one / refused)."""
    route = path.split("?")[0]
    for suffix, parse in MODEL_PATHS.items():
        if route.endswith(suffix):
            try:
                return parse(body, headers or {})
            except ApiError:
                return None
    return None


def thinking_on(req: ChatRequest) -> bool:
    """As `ChatService.render` decides: a forced tool choice turns thinking off."""
    forced = req.tool_choice == "required" or isinstance(req.tool_choice, dict)
    return req.enable_thinking and not forced


class ScriptedProxy(RecordingProxy):
    def __init__(self, upstream: str, script: Script, family: str, port: int = 0) -> None:
        super().__init__(upstream, port)
        self.script, self.family = script, family

    def _forward(self, h: BaseHTTPRequestHandler, ex: Exchange) -> None:
        body = ex.body_json() if ex.method == "POST" else None
        req = normalise(ex.path, body, ex.req_headers) if isinstance(body, dict) else None
        if req is not None and not isinstance(req.tool_choice, dict) and req.tool_choice != "required":
            assert isinstance(body, dict)  # normalise() ran on it
            reply = self.script.reply(req)
            forced = render(reply, self.family, thinking_on(req))
            ex.client_body = body  # type: ignore[attr-defined]
            ex.reply = reply.to_json()  # type: ignore[attr-defined]
            ex.forced = forced  # type: ignore[attr-defined]
            ex.req_body = json.dumps({**body, FORCED_OUTPUT_FIELD: forced}, ensure_ascii=False).encode()
        super()._forward(h, ex)


def main(argv: list[str] | None = None) -> int:
    """Run the scripted backend by hand: point any client at the printed URL."""
    import argparse
    import time

    ap = argparse.ArgumentParser(description="scripted recording proxy in front of a freetoken-agent server")
    ap.add_argument("--upstream", required=True, help="the server's base URL, e.g. http://127.0.0.1:8000")
    ap.add_argument("--workdir", required=True, help="the client's work dir (tool calls use absolute paths in it)")
    ap.add_argument("--family", choices=["qwen3_5", "qwen3"], default="qwen3_5")
    ap.add_argument("--variant", choices=["prune"], default=None)
    ap.add_argument("--port", type=int, default=0)
    args = ap.parse_args(argv)
    proxy = ScriptedProxy(args.upstream, Script(args.workdir, args.family, args.variant), args.family,
                          args.port).start()
    print(f"scripted backend on {proxy.url} -> {args.upstream}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        proxy.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
