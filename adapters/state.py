"""Per-app state shared by the protocol routers: the chat service, names, auth, metrics.

Contract: `AppState.start(req)` starts (or joins) a generation and counts it; every generation's
tokens and timings reach the Prometheus metrics once, when it ends (also when aborted); `check_model(name)` refuses a model the
server does not serve (404); `read_json(request)` parses the body off the event loop and returns
it as an object, or raises a 400 for invalid JSON, `NaN`/`Infinity`, nesting deeper than
`MAX_DEPTH` or a lone surrogate anywhere (strings the tokenizer could not take). Rendering and
tokenising a prompt run off the event loop too (`await state.start(req)`), so a huge request
never stalls `/health` or other streams.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi import Request
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from adapters.common import ApiError, Drain
from adapters.guard import Limits
from adapters.parsers import OutputParser, create_parser
from freetoken_agent.service import ChatRequest, ChatService, Finish, GenerationStream


def default_max_request_bytes(context_window: int) -> int:
    """1 MiB plus 32 bytes a token of the context window: a full window of text, JSON-escaped,
    with room for tool schemas, and no more."""
    return (1 << 20) + 32 * context_window


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("freetoken_requests", "HTTP requests by route and status", ["route", "status"],
                                registry=r)
        self.errors = Counter("freetoken_errors", "Requests answered with an error", ["route", "status"],
                              registry=r)
        self.prompt_tokens = Counter("freetoken_prompt_tokens", "Prompt tokens", registry=r)
        self.cached_tokens = Counter("freetoken_cached_prompt_tokens", "Prompt tokens reused from cache", registry=r)
        self.completion_tokens = Counter("freetoken_completion_tokens", "Generated tokens", registry=r)
        self.joined = Counter("freetoken_joined_requests", "Resent requests joined to a running copy", registry=r)
        self.ttft = Histogram("freetoken_time_to_first_token_seconds", "Time to first generated token",
                              buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300), registry=r)
        self.decode_rate = Gauge("freetoken_decode_tokens_per_second", "Decode rate of the last finished request",
                                 registry=r)
        self.running = Gauge("freetoken_running_generations", "Generations in flight", registry=r)
        self.kv_tokens = Gauge("freetoken_kv_pool_tokens", "Tokens the KV pool holds", registry=r)
        self.kv_in_use = Gauge("freetoken_kv_tokens_in_use", "KV pool tokens in use (running requests and the "
                               "prefix cache)", registry=r)
        self.request_kv = Gauge("freetoken_request_kv_tokens", "Prompt and generated tokens of the generations "
                                "in flight (0 when none runs)", registry=r)
        # with a GPU expert cache only (engine.gpu_report())
        self.gpu_bytes = Gauge("freetoken_gpu_memory_bytes", "The GPU cap, its split and the measured peak",
                               ["part"], registry=r)
        self.prefill_passes = Gauge("freetoken_prefill_passes", "Forward passes that computed prompt tokens "
                                    "(since the pools were made)", registry=r)
        self.expert_hit_rate = Gauge("freetoken_expert_cache_hit_rate", "GPU expert cache hits / lookups so far",
                                     registry=r)

    def observe_engine(self, engine: Any) -> None:
        """Sets the engine gauges from `memory_report()` (safe from any thread)."""
        report = engine.memory_report()
        self.kv_tokens.set(report["pools"]["kv_tokens"])
        gpu = report["gpu_memory"]
        if gpu is None:
            return
        self.gpu_bytes.labels("cap").set(gpu["cap_bytes"])
        self.gpu_bytes.labels("peak").set(gpu["peak_allocated_bytes"])
        for part, value in gpu["budget"].items():
            self.gpu_bytes.labels(part).set(value)
        cache = gpu["expert_cache"] or {}
        if cache.get("hit_rate") is not None:
            self.expert_hit_rate.set(cache["hit_rate"])


@dataclass
class AppState:
    service: ChatService
    model_name: str
    api_key: str | None = None
    aliases: tuple[str, ...] = ()
    ping_interval: float = 5.0
    metrics: Metrics = field(default_factory=Metrics)
    created: int = field(default_factory=lambda: int(time.time()))
    limits: Limits = field(default_factory=lambda: Limits(allowed_hosts=None))
    drain: Drain = field(default_factory=Drain)

    def __post_init__(self) -> None:
        if self.limits.max_request_bytes is None:
            self.limits = replace(self.limits, max_request_bytes=default_max_request_bytes(
                self.service.context_window))
        if self.api_key and self.limits.api_key is None:
            self.limits = replace(self.limits, api_key=self.api_key)
        self.service.on_finish = lambda stream, fin: self.record(fin, stream)

    def check_model(self, name: Any) -> None:
        if name is None:
            return
        if not isinstance(name, str):
            raise ApiError(400, "model must be a string", param="model")
        if name not in (self.model_name, *self.aliases):
            raise ApiError(404, f"The model {name!r} does not exist (this server serves {self.model_name!r})",
                           type="not_found_error", code="model_not_found", param="model")

    async def start(self, req: ChatRequest, id_prefix: str = "call_") -> tuple[GenerationStream, OutputParser]:
        """Starts (or joins) the generation and returns it with a fresh output parser for this caller;
        the prompt is rendered and tokenised in a worker thread."""
        if self.drain.started():
            raise ApiError(503, "the server is shutting down", type="server_error", code="shutting_down")
        tokens = await asyncio.to_thread(self.service.tokenise, req)
        stream = self.service.start_tokenised(tokens)
        if stream.joined:
            self.metrics.joined.inc()
        parser = create_parser(self.service.family, req.tools or None, starts_in_reasoning=stream.prep.starts_in_reasoning,
                               parse_tool_calls=stream.prep.parse_tools, id_prefix=id_prefix)
        return stream, parser

    def record(self, fin: Finish, stream: GenerationStream | None = None) -> None:
        m = self.metrics
        m.prompt_tokens.inc(fin.prompt_tokens)
        m.cached_tokens.inc(fin.cached_tokens)
        m.completion_tokens.inc(fin.completion_tokens)
        if stream is not None and stream.first_token_at is not None:
            m.ttft.observe(stream.first_token_at - stream.started_at)
            elapsed = time.monotonic() - stream.first_token_at
            if fin.completion_tokens > 1 and elapsed > 0:
                m.decode_rate.set((fin.completion_tokens - 1) / elapsed)

    def check_finish(self, fin: Finish) -> None:
        """A failed generation: its cause goes to the log, the client gets a 500 with the request id."""
        if fin.error:
            raise ApiError(500, "generation failed", type="server_error", detail=fin.error)


MAX_DEPTH = 64  # nesting of objects and lists in a request body


async def read_json(request: Request) -> dict[str, Any]:
    raw = await request.body()
    return await asyncio.to_thread(parse_json, raw)


def _no_constant(name: str) -> None:
    raise ApiError(400, f"request body is not valid JSON: {name} is not a JSON number")


def parse_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object; ApiError(400) for anything the handlers must not see."""
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"request body is not valid JSON: {e}") from None
    except RecursionError:
        raise ApiError(400, f"request body nests deeper than {MAX_DEPTH} levels") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    _check_tree(body)
    return body


def _check_tree(body: dict[str, Any]) -> None:
    stack: list[tuple[Any, int]] = [(body, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            _check_text(value)
        elif isinstance(value, dict | list):
            if depth > MAX_DEPTH:
                raise ApiError(400, f"request body nests deeper than {MAX_DEPTH} levels")
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for k, v in items:
                if isinstance(k, str):
                    _check_text(k)
                stack.append((v, depth + 1))


def _check_text(text: str) -> None:
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise ApiError(400, "request body holds a lone UTF-16 surrogate (\\ud800-\\udfff) in a string; "
                                "send valid Unicode") from None
