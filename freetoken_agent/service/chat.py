"""ChatService: renders a `ChatRequest` through the model's chat template, runs it on the engine and
streams text back to any number of asyncio subscribers.

Contract:
- `prepare(req)` renders the prompt (tools only when tool_choice is not "none"; "required" and a
  named tool disable thinking and add a forced tool-call prefix plus a decoding constraint, so the
  output is a well-formed call) and checks the context window (`ContextTooLong`) and max_tokens
  (`RequestError`).
- `start(req)` returns a `GenerationStream`. An identical request (same prompt ids and sampling)
  still running is joined instead of run twice. `stream.subscribe()` is an async iterator of
  `Chunk`s then one `Finish`; when the last subscriber leaves before the end (client gone), the
  generation is aborted at once, freeing its slot.
- `req.forced_output` (benchmark only: trace replay, scripted capture) is tokenised and emitted
  instead of sampled tokens; the forward pass still runs, so caches are those of a real reply.
- `tokenise(req)` (normalise, render, encode: the slow part, safe to run in a worker thread) and
  `start_tokenised(t)` (plan and submit, on the event loop) split `start`; `prepare` is both.
- Client text (system, user and tool content, tool schemas) is escaped before rendering
  (`service/encode.py`): an added token written in it is plain text, never a control token.
- Stop strings are bounded (`service/stops.py`: at most 16, of at most 512 characters, else
  `RequestError`) and matched on the decoded text in linear time; text that may start a stop
  string is held back until it cannot.
- A temperature below `MIN_TEMPERATURE` samples greedily (what it means, without overflow).
- Every request passes through the session manager (`freetoken_agent/sessions`): it is normalised
  before rendering, planned (client, session, ranked anchors, divergence) before `engine.submit`,
  and its turn is recorded when the generation ends.
Must be used from one asyncio event loop; the engine thread reaches it via call_soon_threadsafe.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import jinja2

from engine.engine import Engine
from engine.errors import RequestError
from engine.request import RequestHandle
from engine.sampling import SamplingParams, TokenConstraint
from freetoken_agent.service.encode import PromptEncoder
from freetoken_agent.service.stops import StopMatcher, check_stops
from freetoken_agent.service.types import ChatMessage, ChatRequest, Chunk, Finish
from freetoken_agent.sessions import RequestPlan, SessionManager
from freetoken_agent.tokenizer import ChatTokenizer, StreamDecoder

# model family -> the output parser of its chat format (adapters/parsers FAMILIES)
FAMILIES = {"qwen3_moe": "qwen3", "qwen3_5_moe": "qwen3_5", "qwen3_next": "qwen3", "gpt_oss": "harmony"}
# A marker in the checkpoint's own chat template names its call format, whatever the model family:
# GLM's, DeepSeek's (V3 / V3.1, and V3.2's DSML) and Kimi's templates each write calls their own way.
_TEMPLATE_MARKERS = (("<|channel|>", "harmony"), ("<arg_key>", "glm4"), ("<｜tool▁call▁begin｜>", "deepseek_v3"),
                     ("<|tool_call_begin|>", "kimi_k2"), ("｜DSML｜", "deepseek_v32"))


def parser_family(model_family: str, chat_template: str | None) -> str:
    """The output parser for a model: its template's call markers first, then its family's default.
    A template with neither (the demo models of other families carry Qwen3's) reads as Qwen3's."""
    for marker, family in _TEMPLATE_MARKERS:
        if chat_template and marker in chat_template:
            return family
    return FAMILIES.get(model_family, "qwen3")


def opens_reasoning(prompt: str) -> bool:
    """Whether the model's reply starts inside its reasoning: the prompt (generation prompt and any
    forced prefix included) ends with an open `<think>` (Qwen3.5 / 3.6, GLM-4.7, DeepSeek-V3.1 with
    thinking on)."""
    return prompt.rstrip().endswith("<think>")


def render_prompt(tokenizer: ChatTokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                  thinking: bool, reasoning_effort: str | None) -> str:
    """The prompt text of a conversation (template-ready messages) with the generation prompt; the
    reasoning effort is passed only when set (templates default it themselves when it is undefined)."""
    extra = {"reasoning_effort": reasoning_effort} if reasoning_effort is not None else {}
    text = tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True,
                                         enable_thinking=thinking, tokenize=False, **extra)
    assert isinstance(text, str)
    return text


log = logging.getLogger("freetoken.service")
MIN_TEMPERATURE = 1e-2
ESCAPED_ROLES = ("system", "user", "tool")  # their content is the client's text, not the model's


class ContextTooLong(RequestError):
    def __init__(self, prompt_tokens: int, limit: int) -> None:
        super().__init__(f"prompt is too long: {prompt_tokens} tokens > {limit} maximum")
        self.prompt_tokens, self.limit = prompt_tokens, limit


@dataclass
class Tokenised:
    req: ChatRequest  # normalised
    ids: list[int]
    forced_prefix: str
    constraint: TokenConstraint | None
    in_reasoning: bool  # the reply starts inside reasoning (opens_reasoning)
    forced: list[int] | None
    digest: str  # of ids and forced ids


@dataclass
class Prepared:
    ids: list[int]
    forced_prefix: str
    constraint: TokenConstraint | None
    params: SamplingParams
    starts_in_reasoning: bool
    parse_tools: bool
    key: str
    plan: RequestPlan
    forced: list[int] | None = None  # benchmark only: ids emitted instead of sampled ones


class ChatService:
    def __init__(self, engine: Engine, tokenizer: ChatTokenizer, model_name: str,
                 context_window: int | None = None, max_output_tokens: int = 32768,
                 sessions: SessionManager | None = None) -> None:
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.sessions = sessions or SessionManager(tokenizer, engine=engine)
        self.family = parser_family(engine.cfg.family, tokenizer.chat_template)
        self.context_window = min(context_window or engine.max_model_len, engine.max_model_len,
                                  engine.opts.kv_tokens)
        self.max_output_tokens = min(max_output_tokens, self.context_window)
        self.encoder = PromptEncoder(tokenizer)
        self._inflight: dict[str, GenerationStream] = {}
        # Called once per generation when it ends, however it ends (metrics hang here).
        self.on_finish: Callable[[GenerationStream, Finish], None] | None = None

    # ------------------------------------------------------------------ rendering
    def render(self, req: ChatRequest) -> tuple[list[int], str, TokenConstraint | None, bool]:
        """-> (prompt ids, forced prefix, constraint, whether the reply starts in reasoning). `req` is
        normalised already."""
        choice = req.tool_choice
        tools = req.tools if choice != "none" else []
        forced = choice == "required" or isinstance(choice, dict)
        if forced and not req.tools:
            raise RequestError("tool_choice requires a tool but no tools were given")
        thinking = req.enable_thinking and not forced
        messages = [self._escaped(m).to_template() for m in req.messages]
        tools = self.encoder.escape_tree(tools) if tools else tools
        try:
            text = render_prompt(self.tokenizer, messages, tools, thinking, req.reasoning_effort)
        except jinja2.TemplateError as e:
            raise RequestError(f"the conversation cannot be rendered by the chat template: {e}") from None
        prefix, constraint = "", None
        if forced and self.family == "harmony":
            from freetoken_agent.constrain.harmony import harmony_call_prefix

            try:
                prefix = harmony_call_prefix(req.tools, choice)
            except ValueError as e:
                raise RequestError(str(e)) from None
        elif forced:
            from freetoken_agent.constrain import tool_call_constraint

            try:
                prefix, constraint = tool_call_constraint(self.tokenizer, self.family, req.tools, choice,
                                                          self.engine.cfg.eos_token_ids,
                                                          parallel_tool_calls=req.parallel_tool_calls)
            except ValueError as e:
                raise RequestError(str(e)) from None
        return self.encoder.encode(text + prefix), prefix, constraint, opens_reasoning(text + prefix)

    def _escaped(self, m: ChatMessage) -> ChatMessage:
        if m.role not in ESCAPED_ROLES:
            return m
        return ChatMessage(role=m.role, content=self.encoder.escape(m.content), reasoning=m.reasoning,
                           tool_calls=m.tool_calls, tool_call_id=m.tool_call_id, name=m.name)

    def count_tokens(self, req: ChatRequest) -> int:
        return len(self.render(self.sessions.normalise(req))[0])

    def tokenise(self, req: ChatRequest) -> Tokenised:
        """Checks, normalises, renders and encodes `req` (no engine or session state touched)."""
        check_stops(req.stop)
        req = self.sessions.normalise(req)
        ids, prefix, constraint, in_reasoning = self.render(req)
        forced = self.encoder.encode_long(req.forced_output) if req.forced_output else None
        digest = hashlib.sha256(json.dumps([ids, forced], separators=(",", ":")).encode()).hexdigest()
        return Tokenised(req=req, ids=ids, forced_prefix=prefix, constraint=constraint, in_reasoning=in_reasoning,
                         forced=forced, digest=digest)

    def prepare(self, req: ChatRequest) -> Prepared:
        return self.prepared(self.tokenise(req))

    def prepared(self, t: Tokenised) -> Prepared:
        req, ids, prefix, constraint, forced = t.req, t.ids, t.forced_prefix, t.constraint, t.forced
        room = self.context_window - len(ids)
        if room < 1:
            raise ContextTooLong(len(ids), self.context_window - 1)
        if req.max_tokens is not None and req.max_tokens > self.context_window:
            raise RequestError(f"max_tokens {req.max_tokens} exceeds the model's context window "
                               f"of {self.context_window} tokens")
        max_tokens = min(req.max_tokens or self.max_output_tokens, room)
        if forced is not None:  # the forced text is the whole reply: room for it and its end token
            max_tokens = min(max(max_tokens, len(forced) + 1), room)
        temperature = req.temperature or 0.0
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0 if temperature < MIN_TEMPERATURE else temperature,
                                top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0,
                                seed=req.seed)
        key_src = json.dumps([t.digest, max_tokens, params.temperature, params.top_p, params.top_k, params.seed,
                              req.stop, prefix, req.parallel_tool_calls], separators=(",", ":"))
        return Prepared(ids=ids, forced_prefix=prefix, constraint=constraint, params=params,
                        starts_in_reasoning=t.in_reasoning,
                        parse_tools=bool(req.tools) and req.tool_choice != "none",
                        key=hashlib.sha256(key_src.encode()).hexdigest(), plan=self.sessions.plan(req, ids),
                        forced=forced)

    # ------------------------------------------------------------------ running
    def start(self, req: ChatRequest) -> GenerationStream:
        return self.start_tokenised(self.tokenise(req))

    def start_tokenised(self, t: Tokenised) -> GenerationStream:
        prep = self.prepared(t)
        req = t.req
        running = self._inflight.get(prep.key)
        if running is not None and not running.finished:
            running.joined += 1
            return running
        stream = GenerationStream(self, prep, req.stop)
        self._inflight[prep.key] = stream
        return stream

    def tokens_in_flight(self) -> int:
        """Prompt plus generated tokens of the generations not finished yet (what their KV holds)."""
        return sum(s.prompt_tokens + len(s.handle.output_ids) for s in list(self._inflight.values())
                   if not s.finished)

    def _forget(self, stream: GenerationStream) -> None:
        if self._inflight.get(stream.prep.key) is stream:
            del self._inflight[stream.prep.key]


class GenerationStream:
    def __init__(self, service: ChatService, prep: Prepared, stop: list[str]) -> None:
        self.service, self.prep = service, prep
        self.stop = [s for s in stop if s]
        self._stops = StopMatcher(self.stop)
        self.log: list[Chunk | Finish] = []
        self.finished = False
        self.joined = 0
        self._subscribers: list[asyncio.Queue[Chunk | Finish]] = []
        self._loop = asyncio.get_running_loop()
        # harmony's structure is special tokens: its parser reads them
        self._decoder = StreamDecoder(service.tokenizer, skip_special_tokens=service.family != "harmony")
        self._stopped: str | None = None
        self.started_at = time.monotonic()
        self.first_token_at: float | None = None
        self.turn: dict[str, object] | None = None  # the session manager's record, once finished
        if prep.forced_prefix:
            self._publish(Chunk(prep.forced_prefix))
        plan = prep.plan
        self.handle: RequestHandle = service.engine.submit(
            prep.ids, prep.params, constraint=None if prep.forced else prep.constraint, anchors=plan.anchors,
            decode_anchors=plan.decode_anchors, session=plan.engine_session, forced_output=prep.forced,
            listener=lambda tok: self._loop.call_soon_threadsafe(self._on_token, tok))

    @property
    def prompt_tokens(self) -> int:
        return len(self.prep.ids)

    # engine events, on the event loop
    def _on_token(self, token: int | None) -> None:
        if self.finished:
            return
        if token is None:
            self._release(self._decoder.flush())
            if self._stopped is None:
                self._end(self.handle.finish_reason or "stop")
            return
        if self._stopped is not None:
            return
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
        self._release(self._decoder.feed(token))

    def _release(self, text: str) -> None:
        emit, hit = self._stops.feed(text)
        if emit:
            self._publish(Chunk(emit))
        if hit is not None:
            self._stopped = hit
            self.handle.abort()
            self._end("stop", stop_sequence=hit)

    def _end(self, reason: str, stop_sequence: str | None = None) -> None:
        tail = self._stops.flush()
        if tail and self._stopped is None:
            self._publish(Chunk(tail))
        err = self.handle.error
        self._publish(Finish(reason=reason, prompt_tokens=self.prompt_tokens, cached_tokens=self.handle.cached_tokens,
                             completion_tokens=len(self.handle.output_ids), stop_sequence=stop_sequence,
                             error=str(err) if err else None))
        self.finished = True
        self.service._forget(self)
        ttft = None if self.first_token_at is None else (self.first_token_at - self.started_at) * 1000
        try:
            self.turn = self.service.sessions.record(self.prep.plan, self.prep.ids, list(self.handle.output_ids),
                                                     self.handle, ttft, reason)
        except Exception:  # bookkeeping must never cost the client its answer
            log.exception("recording the session turn failed")
        if self.service.on_finish is not None:
            self.service.on_finish(self, self.log[-1])  # type: ignore[arg-type]

    def _publish(self, item: Chunk | Finish) -> None:
        self.log.append(item)
        for q in self._subscribers:
            q.put_nowait(item)

    # consumers
    async def subscribe(self) -> AsyncIterator[Chunk | Finish]:
        q: asyncio.Queue[Chunk | Finish] = asyncio.Queue()
        for item in self.log:
            q.put_nowait(item)
        self._subscribers.append(q)
        try:
            while True:
                item = await q.get()
                yield item
                if isinstance(item, Finish):
                    return
        finally:
            self._subscribers.remove(q)
            if not self._subscribers and not self.finished:
                self.handle.abort()  # the last client left: stop generating now
                self.service._forget(self)

    async def collect(self) -> tuple[str, Finish]:
        parts: list[str] = []
        async for item in self.subscribe():
            if isinstance(item, Finish):
                return "".join(parts), item
            parts.append(item.text)
        raise RuntimeError("generation stream ended without a finish")  # pragma: no cover
