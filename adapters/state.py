"""Per-app state shared by the protocol routers: the chat service, names, auth, metrics.

Contract: `AppState.start(req)` starts (or joins) a generation and counts it; every generation's
tokens and timings reach the Prometheus metrics once, when it ends (also when aborted); `check_model(name)` refuses a model the
server does not serve (404); `read_json(request)` returns the body as an object or raises a 400.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from adapters.common import ApiError
from adapters.parsers import OutputParser, create_parser
from freetoken_agent.service import ChatRequest, ChatService, Finish, GenerationStream


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
        # with a GPU expert cache only (engine.gpu_report())
        self.gpu_bytes = Gauge("freetoken_gpu_memory_bytes", "The GPU cap, its split and the measured peak",
                               ["part"], registry=r)
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

    def __post_init__(self) -> None:
        self.service.on_finish = lambda stream, fin: self.record(fin, stream)

    def check_model(self, name: Any) -> None:
        if name is None:
            return
        if not isinstance(name, str):
            raise ApiError(400, "model must be a string", param="model")
        if name not in (self.model_name, *self.aliases):
            raise ApiError(404, f"The model {name!r} does not exist (this server serves {self.model_name!r})",
                           type="not_found_error", code="model_not_found", param="model")

    def start(self, req: ChatRequest, id_prefix: str = "call_") -> tuple[GenerationStream, OutputParser]:
        """Starts (or joins) the generation and returns it with a fresh output parser for this caller."""
        stream = self.service.start(req)
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
        if fin.error:
            raise ApiError(500, f"generation failed: {fin.error}", type="server_error")


async def read_json(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    return body
