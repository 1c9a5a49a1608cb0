"""The generation endpoints: from a validated OpenAI request to engine requests and back.

One HTTP request becomes one engine request per choice (`n` x prompts). Each engine
request is wrapped in a tracking stream that measures TTFT/ITL as the server sees them and,
however it ends (finished, aborted, client gone, client stalled, engine failure), releases
its admission slot, feeds the metrics and writes one access-log line, exactly once.

Tokenization and chat templates run in a small worker pool, never on the event loop: a
multi-megabyte prompt must not stall `/health` or other requests' streams.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import AsyncIterator, Callable, Optional, Sequence, Union

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from sloserve.engine.async_engine import AsyncLLMEngine, EngineDeadError, RequestMigratedError, RequestStream
from sloserve.engine.migration import ResumeState
from sloserve.engine.llm_engine import ContextLengthError
from sloserve.engine.structured import StructuredOutputError
from sloserve.engine.outputs import CompletedOutput, OutputAccumulator, RequestOutput
from sloserve.server.admission import Admission
from sloserve.server.errors import STATUS_CLIENT_GONE, APIError, bad_request, error_body, validation_message
from sloserve.server.logprobs import TokenStrings, chat_logprobs, completion_logprobs
from sloserve.tracing import OFF, Tracing, trace_headers, wall_ns
from sloserve.server.metrics import FinishedRequest, ServerMetrics
from sloserve.server.protocol import (
    choice_seed,
    prompt_label,
    refuse_front_ids,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    CompletionChoice,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    PromptTokensDetails,
    header_priority,
    header_request_id,
    Usage,
    RoutingProbe,
    SamplingFields,
)
from sloserve.server.qos import ANONYMOUS, CacheSalter, Principal, QoSRegistry, cache_secret
from sloserve.server.tenants import TenantLimiter, client_request_id, scope_request_id
from sloserve.server.responses import ResponsesRequest, ResponseWriter, responses_param
from sloserve.server.tool_calls import ToolUse, calls_json, prompt_messages, resolve_parser, tool_definitions
from sloserve.server.tool_parsers import ToolCallStream
from sloserve.workers.contract import KV_PUSH_HEADER, QOS_HEADER, RELAY_COMMENT, parse_qos_header
from sloserve.core.types import QoSClass, SamplingParams, StructuredOutput

logger = logging.getLogger(__name__)
access_log = logging.getLogger("sloserve.access")

_COUNTED_REJECTIONS = ("queue_full", "draining", "slo_unattainable", "tenant_concurrency_limit", "tenant_token_limit")
DEFAULT_STALL_TIMEOUT_S = 60.0
# What a tokenizer may raise on bad input (UnicodeError is a ValueError): a 400, never a 500.
_TOKENIZER_ERRORS = (ValueError, TypeError)


@dataclass
class CallContext:
    """One HTTP generation request: who, which class, which ids."""

    request_id: str
    model: str
    principal: Principal
    qos: QoSClass
    priority: Optional[int]
    created: int = field(default_factory=lambda: int(time.time()))
    relay: bool = False  # a fleet front relays this stream: annotate each event for a resume elsewhere
    resume: Optional[ResumeState] = None  # the call continues one begun on another instance
    kv_push: Optional[tuple[str, str]] = None  # (target worker URL, migration id): a pipelined P/D hand-off
    lora: Optional[str] = None  # the LoRA adapter named as its model (None: the base model)
    trace: dict[str, str] = field(default_factory=dict)  # the caller's W3C trace context (tracing.py)


@dataclass
class Choice:
    """One engine request: its prompt ids and sampling parameters."""

    index: int
    engine_id: str
    prompt_ids: list[int]
    params: SamplingParams
    prompt_index: int


class OpenAIServing:
    def __init__(
        self,
        engine: AsyncLLMEngine,
        served_models: Sequence[str],
        registry: QoSRegistry,
        admission: Admission,
        metrics: ServerMetrics,
        stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
        tokenizer_threads: int = 2,
        salter: Optional[CacheSalter] = None,
        tenants: Optional[TenantLimiter] = None,
        tool_call_parser: str = "auto",
        grammar_compile_timeout_s: float = 10.0,
        tracing: Tracing = OFF,
    ) -> None:
        """`stall_timeout_s`: a stream whose client takes longer than this to accept one write
        is ended and its engine requests aborted. `tokenizer_threads` bounds how many prompts
        are tokenized at once (beyond that they queue, off the event loop). `salter` gives each
        request its prefix-cache salt (a keyed hash of its cache namespace); `tenants` enforces
        the per-tenant limits of the QoS config. `tool_call_parser` reads tool calls out of chat
        outputs (tool_calls.py; auto = the one the chat template's format calls for). A call's
        constraint compiles on a grammar thread of its own, off the event loop: one that has not
        compiled within `grammar_compile_timeout_s` is a 400 (its compile goes on and is cached).
        `tracing`: where each engine request's span goes when it ends (tracing.py)."""
        if not stall_timeout_s > 0:
            raise ValueError(f"stall_timeout_s must be > 0, got {stall_timeout_s!r}")
        self.engine = engine
        self.served_models = list(served_models)
        self.registry = registry
        self.admission = admission
        self.metrics = metrics
        self.stall_timeout_s = stall_timeout_s
        self.salter = salter or CacheSalter(cache_secret())
        self.tenants = tenants or TenantLimiter(registry.limits_for)
        self.tokenizer = engine.engine.tokenizer
        self.strings = TokenStrings(self.tokenizer)
        self.tool_parser = resolve_parser(tool_call_parser, self.tokenizer.chat_template)
        self.grammar_compile_timeout_s = grammar_compile_timeout_s
        self.tracing = tracing
        self._grammar_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sloserve-grammar")
        self._tokenize_pool = ThreadPoolExecutor(max_workers=tokenizer_threads, thread_name_prefix="sloserve-tokenize")
        # A fleet worker's pipelined hand-off (worker_migration.Migrations.push_early): called
        # with (engine id, target URL, migration id) once a request that asked for one is queued.
        self.push_kv: Optional[Callable[[str, str, str], None]] = None

    # ------------------------------------------------------------------ endpoints

    async def completions(self, body: CompletionRequest, request: Request,
                          ctx: Optional[CallContext] = None) -> Response:
        ctx = ctx or self._context(body, request, "cmpl")
        params = body.sampling_params()
        prompts = body.prompts()
        await self._compile(params.structured)
        # Refuse under overload before spending CPU on tokenization.
        self._counting_rejections(self.admission.check_room, len(prompts) * body.num_choices)
        given = body.sloserve_prompt_ids  # the front's, for one prompt (the context refused anyone else's)
        if given is not None and len(prompts) == 1:
            prompt_ids = await self._off_loop(lambda: [self._check_length(given)], "prompt")
        else:
            prompt_ids = await self._off_loop(lambda: self._tokenize_batch(prompts), "prompt")
        choices = self._choices(ctx, prompt_ids, params, body.num_choices)
        streams = self._submit(ctx, choices)
        if body.stream:
            fmt = _CompletionStream(self.strings, len(choices))
            if ctx.resume is not None:  # logprob text offsets continue from what was sent
                fmt.offsets[0] = sum(len(self.strings.text(t)) for t in ctx.resume.output_token_ids)
            return self._sse(self._events(ctx, choices, streams, body.include_usage, fmt), ctx, streams)
        finals = await self._collect(request, ctx, streams)
        out = []
        for c, final in zip(choices, finals):
            lp = completion_logprobs(final.logprobs or [], self.strings) if c.params.logprobs is not None else None
            out.append(CompletionChoice(index=c.index, text=final.text, logprobs=lp, finish_reason=final.finish_reason,
                                        stop_reason=final.stop_reason))
        resp = CompletionResponse(id=ctx.request_id, created=ctx.created, model=ctx.model, choices=out,
                                  usage=_usage(choices, finals))
        return _json(resp.model_dump(), ctx)

    async def chat(self, body: ChatCompletionRequest, request: Request,
                   ctx: Optional[CallContext] = None) -> Response:
        ctx = ctx or self._context(body, request, "chatcmpl")
        tools, choices, streams = await self._start_chat(body, ctx)
        if body.stream:
            fmt = _ChatStream(self.strings, tools, len(choices))
            if tools is not None and ctx.resume is not None:  # what the client was sent of the calls so far
                fmt.tool_streams[0].resume_from(self.tokenizer.decode(ctx.resume.output_token_ids))
            return self._sse(self._events(ctx, choices, streams, body.include_usage, fmt), ctx, streams)
        finals = await self._collect(request, ctx, streams)
        out = []
        for c, final in zip(choices, finals):
            lp = chat_logprobs(final.logprobs or [], self.strings) if c.params.logprobs is not None else None
            content, calls, finish = _answer(tools, final)
            message = ChatResponseMessage(content=content, **({"tool_calls": calls} if calls else {}))
            out.append(ChatChoice(index=c.index, message=message, logprobs=lp, finish_reason=finish,
                                  stop_reason=final.stop_reason))
        resp = ChatCompletionResponse(id=ctx.request_id, created=ctx.created, model=ctx.model, choices=out,
                                      usage=_usage(choices, finals))
        return _json(resp.model_dump(), ctx)

    async def responses(self, body: ResponsesRequest, request: Request) -> Response:
        """POST /v1/responses: the chat call it is (responses.py), answered as a `response`."""
        try:
            chat = body.to_chat()
            ctx = self._context(chat, request, "resp")
            tools, choices, streams = await self._start_chat(chat, ctx)
        except APIError as err:
            err.param = responses_param(err.param)
            raise
        writer = ResponseWriter(ctx.request_id, ctx.model, body)
        if body.stream:
            return self._sse(self._response_events(ctx, writer, tools, choices, streams), ctx, streams)
        final = (await self._collect(request, ctx, streams))[0]
        content, calls, finish = _answer(tools, final)
        return _json(writer.whole(content, calls, finish, _usage(choices, [final])), ctx)

    async def _response_events(self, ctx: CallContext, writer: ResponseWriter, tools: Optional[ToolUse],
                               choices: list[Choice], streams: list["TrackedStream"]) -> AsyncIterator[str]:
        opening = writer.opening()  # sent with the first token, as a chat stream's role is
        text = tools.stream() if tools is not None else None
        try:
            async with contextlib.aclosing(_merge(streams)) as merged:
                async for _, out in merged:
                    if text is not None:
                        content, calls = text.update(out.delta_text, out.finished)
                    else:
                        content, calls = out.delta_text, []
                    events = "".join(writer.deltas(content, calls))
                    if out.finished:
                        finish = out.finish_reason
                        if tools is not None and text is not None:
                            finish = tools.finish_reason(finish, text.num_calls)
                        events += "".join(writer.closing(finish, _usage(choices, [out])))
                    if events or opening:
                        yield opening + events
                        opening = ""
        except EngineDeadError as exc:
            logger.error("request %s failed in the engine: %s", ctx.request_id, exc)
            yield opening + writer.failed("engine_error", f"the engine failed while serving request {ctx.request_id}")

    async def _start_chat(self, body: ChatCompletionRequest, ctx: CallContext
                          ) -> tuple[Optional[ToolUse], list[Choice], list["TrackedStream"]]:
        """A chat call judged, its conversation rendered and tokenized, its choices submitted."""
        params = body.sampling_params(self.tool_parser.name)
        tools = ToolUse.of(body, self.tool_parser)
        await self._compile(params.structured)
        messages, template_tools = self.template_input(body.conversation(), tool_definitions(body))
        self._counting_rejections(self.admission.check_room, body.num_choices)
        given = body.sloserve_prompt_ids  # the front's (the context refused anyone else's)
        ids = await self._off_loop(
            lambda: self._check_length(given if given is not None else
                                       self.engine.engine.tokenize_chat(messages, True, template_tools)), "messages")
        choices = self._choices(ctx, [ids], params, body.num_choices)
        return tools, choices, self._submit(ctx, choices)

    def template_input(self, conversation: list[dict], tools: Optional[list[dict]]
                      ) -> tuple[list[dict], Optional[list[dict]]]:
        """A chat call's turns (and tools) as its template renders them (tool_calls.prompt_messages)."""
        return prompt_messages(conversation, tools, self.tokenizer.template_reads("tools"), self.tool_parser.format)

    async def resume(self, body: Union[CompletionRequest, ChatCompletionRequest], request: Request,
                     resume: ResumeState, response_id: str, created: int) -> Response:
        """Continue a streamed single-choice call begun on another instance (a live migration
        or a failover): the same body, the client's id and creation time, the tokens so far."""
        chat = isinstance(body, ChatCompletionRequest)
        ctx = self._context(body, request, "chatcmpl" if chat else "cmpl")
        if not body.stream or body.num_choices != 1 or (not chat and len(body.prompts()) != 1):
            raise bad_request("only a streamed single-choice request can be resumed", "stream")
        ctx.request_id, ctx.created, ctx.resume, ctx.relay = response_id, created, resume, True
        request.state.request_id = response_id
        return await (self.chat(body, request, ctx) if chat else self.completions(body, request, ctx))

    # ------------------------------------------------------------------ request set-up

    async def admitted_prompt_ids(self, raw: bytes) -> list[int]:
        """The ids of a call's prompt (or its conversation, rendered for generation), from the
        JSON body of a `RoutingProbe`, judged as a generation call judges them: an unknown model
        is a 404, invalid text a 400, and a prompt the context window cannot hold (with the
        max_tokens asked for) a 400 `context_length_exceeded`. A fleet front routes on these
        (worker.py's /internal/tokenize), so it refuses what its workers would before forwarding
        anything, and never reads more ids than the window holds.

        The whole judgement runs in the tokenizer pool, the body's validation included: the
        front sends whatever its clients sent (a 4 MB conversation of 90,000 turns validates in
        ~0.2 s), and the event loop that does it must also answer the front's polls of
        /internal/state (three slow polls in a row take a worker out of routing)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenize_pool, self._admitted_ids, raw)

    def _admitted_ids(self, raw: bytes) -> list[int]:
        try:  # decoded as FastAPI decodes a route's body (json.loads), then validated
            body = RoutingProbe.model_validate(json.loads(raw))
        except (ValueError, RecursionError) as exc:
            if not isinstance(exc, ValidationError):
                raise bad_request("request body is not valid JSON", code="invalid_json") from None
            message, param = validation_message(exc.errors())
            raise bad_request(message, param) from None
        self.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of prompt or messages", "prompt")
        if body.messages is None:
            prompt = body.prompt
            ids = self._judged(lambda: self._tokenize(prompt), "prompt")
        else:
            tools = tool_definitions(body)
            messages, tools = self.template_input([m.plain(i) for i, m in enumerate(body.messages)], tools)
            render = body.add_generation_prompt
            ids = self._judged(lambda: self._check_length(self.engine.engine.tokenize_chat(messages, render, tools)),
                               "messages")
        try:
            return self.engine.engine.check_context(ids, body.max_tokens)
        except ContextLengthError as exc:
            raise bad_request(str(exc), "max_tokens", "context_length_exceeded") from None

    def check_model(self, name: Optional[str], principal: Optional[Principal] = None) -> tuple[str, Optional[str]]:
        """(the model id to answer with, the LoRA adapter it names or None) for a call's `model`:
        a served name of the base model, or an adapter `principal` may use (None: a fleet's own
        front asking, which checked its caller). 404 otherwise, listing what the caller may name."""
        if name is None or name in self.served_models:
            return (self.served_models[0] if name is None else name), None
        if name in self.engine.engine.loras and (principal is None or principal.may_use_adapter(name)):
            return name, name
        raise APIError(404, f"model {name!r} does not exist; available: {self.model_ids(principal)}",
                       param="model", code="model_not_found")

    def model_ids(self, principal: Optional[Principal] = None) -> list[str]:
        """The base model's served names, then the adapters `principal` may use."""
        adapters = [a for a in self.engine.engine.loras.names() if principal is None or principal.may_use_adapter(a)]
        return [*self.served_models, *adapters]

    def _context(self, body: SamplingFields, request: Request, prefix: str) -> CallContext:
        principal: Principal = getattr(request.state, "principal", ANONYMOUS)
        relay = getattr(request.state, "fleet", False)
        model, lora = self.check_model(body.model, principal)  # a fleet's workers know its keys too
        request_id = header_request_id(request.headers.get("x-request-id")) or f"{prefix}-{uuid.uuid4().hex}"
        request.state.request_id = request_id
        if not relay:
            refuse_front_ids(body)
        resolved = request.headers.get(QOS_HEADER) if relay else None
        if resolved is not None:  # the fleet's front resolved them for its caller, with the same QoS config
            qos, priority = self._resolved_qos(resolved)
        else:
            class_name = body.qos_class if body.qos_class is not None else request.headers.get("x-qos-class")
            priority = body.priority if body.priority is not None else header_priority(request.headers.get("x-priority"))
            # The classes and priorities a key may use come from the QoS config: 403 beyond them.
            qos, priority = self.registry.authorize(class_name, principal, priority)
        push = request.headers.get(KV_PUSH_HEADER, "").split() if relay else []
        return CallContext(request_id, model, principal, qos, priority, relay=relay,
                           kv_push=(push[0], push[1]) if len(push) == 2 else None, lora=lora,
                           trace=trace_headers(request.headers))

    def _resolved_qos(self, value: str) -> tuple[QoSClass, Optional[int]]:
        """The class and priority a fleet's front resolved (workers/contract.QOS_HEADER)."""
        try:
            name, priority = parse_qos_header(value)
        except ValueError as exc:
            raise bad_request(str(exc), "qos_class") from None
        qos = self.registry.classes.get(name)
        if qos is None:
            raise APIError(400, f"the front resolved QoS class {name!r}, which this worker does not know: run the "
                                "front and its workers with one --qos-config", param="qos_class", code="qos_mismatch")
        return qos, priority

    async def _compile(self, constraint: Optional[StructuredOutput]) -> None:
        """Compile a call's constraint on the grammar thread (the engine then finds it cached):
        xgrammar releases the GIL, so streams and /health go on meanwhile. 400 for one that does
        not compile, or not within the deadline."""
        if constraint is None:
            return
        loop = asyncio.get_running_loop()
        engine = self.engine.engine
        # the grammar engine itself (built with the first constraint: about a second) is not the call's to pay for
        grammar = engine.grammar if engine.grammar_built else \
            await loop.run_in_executor(self._grammar_pool, lambda: engine.grammar)
        if grammar.cached(constraint):  # never queued behind another call's compile
            return
        work = loop.run_in_executor(self._grammar_pool, lambda: grammar.compile(constraint))
        try:
            await asyncio.wait_for(work, self.grammar_compile_timeout_s)
        except TimeoutError:
            raise bad_request(f"the {constraint.source} constraint did not compile within "
                              f"{self.grammar_compile_timeout_s:g} s; simplify it", constraint.source,
                              "constraint_too_complex") from None
        except StructuredOutputError as exc:
            raise bad_request(str(exc), exc.param) from None

    async def _off_loop(self, work, param: str):
        """Run tokenizer work in the pool; its bad-input errors become a 400 on `param`."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenize_pool, self._judged, work, param)

    @staticmethod
    def _judged(work, param: str):
        """`work()`, its bad-input errors a 400 on `param` (`context_length_exceeded` for a
        prompt the window cannot hold)."""
        try:
            return work()
        except _TOKENIZER_ERRORS as exc:
            if isinstance(exc, ContextLengthError):
                raise bad_request(str(exc), param, "context_length_exceeded") from None
            raise bad_request(str(exc) or f"the {param} could not be tokenized", param) from None

    def _tokenize(self, prompt: Union[str, list[int]]) -> list[int]:
        return self._check_length(self.engine.engine.tokenize_prompt(prompt))

    def _tokenize_batch(self, prompts: list[Union[str, list[int]]]) -> list[list[int]]:
        """Every prompt's ids; an error in a batch names its prompt (`prompt[i]: ...`)."""
        ids = []
        for i, prompt in enumerate(prompts):
            try:
                ids.append(self._tokenize(prompt))
            except _TOKENIZER_ERRORS as exc:
                if len(prompts) == 1:
                    raise
                raise type(exc)(f"{prompt_label(i, len(prompts))}: {exc}") from None
        return ids

    def _check_length(self, ids: list[int]) -> list[int]:
        """Refuse an over-long prompt in the worker, so its ids never reach the event loop."""
        return self.engine.engine.check_context(ids)

    def _choices(self, ctx: CallContext, prompt_ids: list[list[int]], params: SamplingParams, n: int) -> list[Choice]:
        total = len(prompt_ids) * n  # at most MAX_CHOICES: CompletionRequest.prompts checked it
        choices = []
        # Engine ids are scoped per tenant: a client's X-Request-Id never collides with (and so
        # never reveals) another tenant's; responses echo the client's own id.
        base = scope_request_id(ctx.principal.tenant, ctx.request_id)
        for p, ids in enumerate(prompt_ids):
            for j in range(n):
                index = p * n + j
                engine_id = base if total == 1 else f"{base}-{index}"
                choice_params = replace(params, seed=choice_seed(params.seed, j))
                choices.append(Choice(index, engine_id, ids, choice_params, p))
        return choices

    def _counting_rejections(self, gate, *args, **kwargs) -> None:
        try:
            gate(*args, **kwargs)
        except APIError as err:
            if err.code in _COUNTED_REJECTIONS:
                self.metrics.observe_rejected(err.code)
            raise

    def _submit(self, ctx: CallContext, choices: list[Choice]) -> list["TrackedStream"]:
        """Admit and queue every choice, or none: a failure undoes what was queued.

        First the deadline check (can these requests still meet their class's TTFT target on
        this instance's load?), then the slots; no await in between, so the shedder's record of
        the work it let through matches the ids `admit` takes."""
        if ctx.resume is None:  # a resumed request met (or missed) its TTFT deadline where it began
            self._counting_rejections(self.admission.check_deadline, sum(len(c.prompt_ids) for c in choices),
                                      ctx.qos, ctx.priority, count=len(choices), max_tokens=choices[0].params.max_tokens)
        ids = [c.engine_id for c in choices]
        self._counting_rejections(self.admission.admit, ids)
        tenant = ctx.principal.tenant
        try:
            self._counting_rejections(self.tenants.try_acquire, tenant, ids, sum(len(c.prompt_ids) for c in choices))
        except APIError:
            for request_id in ids:
                self.admission.release(request_id)
            raise
        salt = self.salter.salt(ctx.principal)
        streams: list[RequestStream] = []
        try:
            for c in choices:
                streams.append(self.engine.add_request(c.prompt_ids, c.params, request_id=c.engine_id, qos=ctx.qos,
                                                       tenant=tenant, priority=ctx.priority, cache_salt=salt,
                                                       resume=ctx.resume, lora=ctx.lora))
        except (ValueError, EngineDeadError) as exc:
            for stream in streams:
                stream.abort()
            for c in choices:
                self.admission.release(c.engine_id)
                self.tenants.release(tenant, c.engine_id)
            if isinstance(exc, EngineDeadError):
                raise APIError(503, "the engine is not running", code="engine_unavailable") from None
            message = str(exc)
            param = getattr(exc, "param", None) or (  # a structured output names its own field
                "max_tokens" if "max_tokens" in message else ("messages" if ctx.request_id.startswith("chat")
                                                              else "prompt"))
            code = "context_length_exceeded" if isinstance(exc, ContextLengthError) else None
            raise bad_request(message, param, code) from None
        if ctx.kv_push is not None and self.push_kv is not None and len(choices) == 1 and ctx.resume is None:
            self.push_kv(choices[0].engine_id, *ctx.kv_push)
        return [TrackedStream(self, ctx, c, s) for c, s in zip(choices, streams)]

    def account(self, ctx: CallContext, choice: Choice, last: Optional[RequestOutput], itls: list[float],
                status: int, finish: Optional[str] = None) -> None:
        """Metrics and the access-log line for one engine request that has ended."""
        m = last.metrics if last is not None else None
        if finish is None and last is not None and last.finished:
            finish = last.finish_reason
        e2e = None
        if m is not None:
            e2e = m.e2e if m.e2e is not None else time.monotonic() - m.arrival_time
        rec = FinishedRequest(
            request_id=client_request_id(choice.engine_id),  # as the client knows it (the tenant is logged beside)
            tenant=ctx.principal.tenant,
            qos=ctx.qos,
            num_prompt_tokens=len(choice.prompt_ids),
            num_output_tokens=last.num_output_tokens if last is not None else 0,
            num_cached_tokens=last.num_cached_tokens if last is not None else 0,
            finish_reason=finish or "abort",
            ttft=m.ttft if m is not None else None,
            e2e=e2e,
            queue_time=(m.first_scheduled_time - m.arrival_time) if m and m.first_scheduled_time else None,
            itls=itls,
            lora=ctx.lora,
        )
        try:
            self.metrics.observe_finished(rec)
        except Exception:  # metrics must never take a request down
            logger.exception("recording metrics for %s failed", choice.engine_id)
        if self.tracing.enabled:
            self._trace(ctx, choice, rec, m, status)
        access_log.info(
            "id=%s tenant=%s class=%s status=%d prompt_tokens=%d output_tokens=%d cached_tokens=%d ttft=%s e2e=%s "
            "finish=%s",
            rec.request_id, rec.tenant or "-", rec.qos.name, status, rec.num_prompt_tokens, rec.num_output_tokens,
            rec.num_cached_tokens, _secs(rec.ttft), _secs(rec.e2e), rec.finish_reason,
        )

    # ------------------------------------------------------------------ non-streaming

    def _trace(self, ctx: CallContext, choice: Choice, rec: FinishedRequest, m, status: int) -> None:
        """The engine request's span (tracing.py): arrival to now, GenAI and SLO attributes."""
        now = time.monotonic()
        end = wall_ns(now, now)
        start = wall_ns(m.arrival_time, now) if m is not None else end
        events = {}
        if m is not None and m.first_scheduled_time is not None:
            events["scheduled"] = wall_ns(m.first_scheduled_time, now)
        if m is not None and m.first_token_time is not None:
            events["first_token"] = wall_ns(m.first_token_time, now)
        params = choice.params
        failed = status >= 400 or rec.finish_reason == "abort"
        self.tracing.record("llm_request", ctx.trace, start, end, {
            "gen_ai.operation.name": "chat" if ctx.request_id.startswith("chat") else "text_completion",
            "gen_ai.provider.name": "sloserve",
            "gen_ai.request.model": ctx.model,
            "gen_ai.request.max_tokens": params.max_tokens,
            "gen_ai.request.temperature": params.temperature,
            "gen_ai.request.top_p": params.top_p,
            "gen_ai.response.id": rec.request_id,
            "gen_ai.response.finish_reasons": [rec.finish_reason],
            "gen_ai.usage.input_tokens": rec.num_prompt_tokens,
            "gen_ai.usage.output_tokens": rec.num_output_tokens,
            "http.response.status_code": status,
            "sloserve.engine_id": choice.engine_id,
            "sloserve.tenant": rec.tenant or None,
            "sloserve.qos.class": rec.qos.name,
            "sloserve.slo.met": rec.meets_slo,
            "sloserve.latency.ttft_s": rec.ttft,
            "sloserve.latency.tpot_s": rec.tpot,
            "sloserve.latency.e2e_s": rec.e2e,
            "sloserve.latency.queued_s": rec.queue_time,
            "sloserve.cached_tokens": rec.num_cached_tokens,
            "sloserve.preemptions": m.num_preemptions if m is not None else None,
            "sloserve.lora": rec.lora,
            "sloserve.resumed": ctx.resume is not None,
        }, events, error=f"{status} {rec.finish_reason}" if failed else None)

    async def _collect(self, request: Request, ctx: CallContext,
                       streams: list["TrackedStream"]) -> list[CompletedOutput]:
        """Run every choice to its end; a client that disconnects meanwhile aborts them all."""

        async def whole(stream: TrackedStream) -> CompletedOutput:
            fold = OutputAccumulator()
            async for out in stream:
                fold.add(out)
            if fold.empty or not fold.latest.finished:
                raise EngineDeadError("the request ended without a final output")
            return fold.completed()

        work = asyncio.ensure_future(asyncio.gather(*(whole(s) for s in streams)))
        gone = asyncio.ensure_future(_wait_for_disconnect(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                work.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await work
                raise APIError(STATUS_CLIENT_GONE, "client disconnected", code="client_disconnected")
            try:
                return work.result()
            except EngineDeadError as exc:
                logger.error("request %s failed in the engine: %s", ctx.request_id, exc)
                raise APIError(500, f"the engine failed while serving request {ctx.request_id}",
                               code="engine_error") from None
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()
            for stream in streams:  # whatever happened above, no engine request outlives the call
                stream.close()

    # ------------------------------------------------------------------ streaming

    def _sse(self, events: AsyncIterator[str], ctx: CallContext, streams: list["TrackedStream"]) -> Response:
        async def cleanup() -> None:
            with contextlib.suppress(RuntimeError):  # "already running": it is being closed by its own task
                await events.aclose()  # type: ignore[attr-defined]
            for stream in streams:
                stream.close()

        def stalled() -> None:
            logger.info("request %s: the client accepted no data for %.1fs; ending its stream", ctx.request_id,
                        self.stall_timeout_s)
            self.metrics.observe_stalled()

        return SSEResponse(events, cleanup, headers={"Cache-Control": "no-cache", "X-Request-Id": ctx.request_id,
                                                     "X-Accel-Buffering": "no"},
                           stall_timeout_s=self.stall_timeout_s, on_stall=stalled)

    async def _events(self, ctx: CallContext, choices: list[Choice], streams: list["TrackedStream"],
                      include_usage: bool, fmt: "_CompletionStream | _ChatStream") -> AsyncIterator[str]:
        """The SSE events of one call: a chunk per engine output of any choice that has new tokens
        (one per token unless the client lags, then merged; its text may be empty), then the
        usage chunk when asked for, then [DONE]; `fmt` shapes the chunks.

        The openings (chat's role) go in the same write as the first generated chunk: until
        then nothing is on the wire, so a front may still retry the request elsewhere."""
        finals: dict[int, RequestOutput] = {}

        def chunk(choice_list: list, usage: Optional[Usage] = None) -> str:
            c = fmt.chunk(ctx, choice_list)
            if include_usage:
                c.usage = usage
            return _event(c.model_dump_json(exclude_unset=True))

        opening = "" if ctx.resume is not None else "".join(chunk(o) for o in fmt.opening(choices))
        note = RelayNote(ctx, choices[0]) if ctx.relay and len(choices) == 1 else None
        try:
            async with contextlib.aclosing(_merge(streams)) as merged:
                async for i, out in merged:
                    c = choices[i]
                    lp = None
                    if c.params.logprobs is not None and out.delta_logprobs:
                        lp = fmt.logprobs(i, out.delta_logprobs)
                    if not out.delta_token_ids and not out.finished and lp is None:
                        continue  # a chunk per new token, even one whose text is held back (as vLLM)
                    if out.finished:
                        finals[i] = out
                    yield opening + (note.comment(out) if note is not None else "") + chunk([fmt.choice(c, out, lp)])
                    opening = ""
        except RequestMigratedError:
            return  # another instance continues this stream; whoever relays it stopped reading here
        except EngineDeadError as exc:
            yield _stream_error(ctx, exc)
        else:
            if include_usage and len(finals) == len(choices):
                yield chunk([], _usage(choices, [finals[i] for i in range(len(choices))]))
        yield _event("[DONE]")


class RelayNote:
    """Per event, what a fleet front needs to continue the stream on another instance: an SSE
    comment (clients ignore comments; the front strips them) with the event's token ids and
    the characters of output text sent so far; the first one also names the call."""

    def __init__(self, ctx: CallContext, choice: Choice) -> None:
        self._head: Optional[dict] = {"id": ctx.request_id, "created": ctx.created, "engine_id": choice.engine_id,
                                      "prompt_tokens": len(choice.prompt_ids)}
        self._chars = ctx.resume.sent_text_len if ctx.resume is not None else 0

    def comment(self, out: RequestOutput) -> str:
        self._chars += len(out.delta_text)
        note = {"t": out.delta_token_ids, "c": self._chars}
        if self._head is not None:
            note.update(self._head)
            self._head = None
        return RELAY_COMMENT + json.dumps(note, separators=(",", ":")) + "\n"


class _CompletionStream:
    """Chunks of /v1/completions: `text` deltas; logprobs carry text offsets across chunks."""

    def __init__(self, strings: TokenStrings, num_choices: int) -> None:
        self.strings = strings
        self.offsets = [0] * num_choices

    def chunk(self, ctx: CallContext, choices: list) -> CompletionChunk:
        return CompletionChunk(id=ctx.request_id, object="text_completion", created=ctx.created, model=ctx.model,
                               choices=choices)

    def opening(self, choices: list[Choice]) -> list[list]:
        return []

    def logprobs(self, i: int, new):
        lp = completion_logprobs(new, self.strings, self.offsets[i])
        self.offsets[i] += sum(len(t) for t in lp.tokens)
        return lp

    def choice(self, c: Choice, out: RequestOutput, lp) -> CompletionChoice:
        return CompletionChoice(index=c.index, text=out.delta_text, logprobs=lp,
                                finish_reason=out.finish_reason if out.finished else None,
                                stop_reason=out.stop_reason if out.finished else None)


class _ChatStream:
    """Chunks of /v1/chat/completions: the role first (as OpenAI, in the first token's write), then content
    deltas; with tools offered, content up to where a call could begin and then the calls' deltas
    (tool_parsers.ToolCallStream)."""

    def __init__(self, strings: TokenStrings, tools: Optional[ToolUse] = None, num_choices: int = 1) -> None:
        self.strings = strings
        self.tools = tools
        self.tool_streams: list[ToolCallStream] = [tools.stream() for _ in range(num_choices)] if tools else []

    def chunk(self, ctx: CallContext, choices: list) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=ctx.request_id, object="chat.completion.chunk", created=ctx.created,
                                   model=ctx.model, choices=choices)

    def opening(self, choices: list[Choice]) -> list[list]:
        return [[ChatChunkChoice(index=c.index, delta=DeltaMessage(role="assistant", content=""), logprobs=None,
                                 finish_reason=None)] for c in choices]

    def logprobs(self, i: int, new):
        return chat_logprobs(new, self.strings)

    def choice(self, c: Choice, out: RequestOutput, lp) -> ChatChunkChoice:
        finish = out.finish_reason if out.finished else None
        if self.tools is None:
            delta = DeltaMessage(content=out.delta_text)
        else:
            stream = self.tool_streams[c.index]
            content, calls = stream.update(out.delta_text, out.finished)
            delta = DeltaMessage(content=content, **({"tool_calls": calls} if calls else {}))
            if out.finished:
                finish = self.tools.finish_reason(finish, stream.num_calls)
        return ChatChunkChoice(index=c.index, delta=delta, logprobs=lp, finish_reason=finish,
                               stop_reason=out.stop_reason if out.finished else None)


class TrackedStream:
    """One engine request's outputs as the server sees them.

    Measures inter-token gaps on arrival and, on whichever comes first (final output,
    engine failure, cancellation, `close()` from the response's cleanup), aborts the engine
    request if it is still running, frees the admission slot and accounts for it, once.
    """

    def __init__(self, serving: OpenAIServing, ctx: CallContext, choice: Choice, stream: RequestStream) -> None:
        self._serving = serving
        self._ctx = ctx
        self.choice = choice
        self._stream = stream
        self._last: Optional[RequestOutput] = None
        self._itls: list[float] = []
        self._prev_t: Optional[float] = None
        self._status = STATUS_CLIENT_GONE  # until it finishes, an ending means the client left
        self._closed = False
        self._migrated = False  # it ended here because another instance took it over

    def __aiter__(self) -> "TrackedStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._closed:
            raise StopAsyncIteration
        try:
            out = await self._stream.__anext__()
        except StopAsyncIteration:
            self.close()
            raise
        except RequestMigratedError:
            self._status, self._migrated = 200, True
            self.close()
            raise
        except EngineDeadError:
            self._status = 500
            self.close()
            raise
        except BaseException:
            self.close()
            raise
        now = time.monotonic()
        k = len(out.delta_token_ids)
        if k:
            self._serving.tenants.record(self._ctx.principal.tenant, k)
            if self._prev_t is not None:
                self._itls.extend([(now - self._prev_t) / k] * k)
            else:
                self._serving.admission.first_token(self.choice.engine_id)
            self._prev_t = now
        self._last = out
        if out.finished:
            self._status = 200
            self.close()
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stream.abort()
        self._serving.admission.release(self.choice.engine_id)
        self._serving.tenants.release(self._ctx.principal.tenant, self.choice.engine_id)
        self._serving.account(self._ctx, self.choice, self._last, self._itls, self._status,
                              "migrated" if self._migrated else None)


class _ClientStalled(Exception):
    """One write to the client did not complete within the stall timeout."""


class SSEResponse(StreamingResponse):
    """A text/event-stream response that always runs its cleanup, even when the client is gone
    before the first byte (then Starlette never starts the body iterator).

    A client that stops reading fills the socket's buffers, and the server's `send` then waits
    for it forever, holding the engine requests. So every write gets `stall_timeout_s`: past
    it the response ends (the server closes the connection) and the cleanup aborts them."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], cleanup, headers: dict[str, str],
                 stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S, on_stall=None) -> None:
        super().__init__(content, headers=headers, media_type=self.media_type)
        self._cleanup = cleanup
        self._stall_timeout_s = stall_timeout_s
        self._on_stall = on_stall

    async def __call__(self, scope, receive, send) -> None:  # type: ignore[override]
        async def send_or_stall(message) -> None:
            try:
                async with asyncio.timeout(self._stall_timeout_s):  # a timer, not a task per write
                    await send(message)
            except TimeoutError:
                raise _ClientStalled() from None

        try:
            await super().__call__(scope, receive, send_or_stall)
        except _ClientStalled:
            if self._on_stall is not None:
                self._on_stall()
        finally:
            await self._cleanup()


# ---------------------------------------------------------------------- helpers


async def _merge(streams: list[TrackedStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave the outputs of several streams, tagged with their index.

    Closing the merge cancels the pumps; a cancelled pump's stream aborts its request."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: TrackedStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            queue.put_nowait((i, exc))
        finally:
            queue.put_nowait((i, done))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _wait_for_disconnect(request: Request) -> None:
    """Return when the client closes the connection. The body is already read, so the next
    ASGI message on this request can only be `http.disconnect`."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _answer(tools: Optional[ToolUse], final: CompletedOutput) -> tuple[Optional[str], list[dict], Optional[str]]:
    """A finished chat output as (content, tool calls, finish_reason)."""
    if tools is None:
        return final.text, [], final.finish_reason
    parsed = tools.parse(final.text)
    return parsed.content, calls_json(parsed.calls), tools.finish_reason(final.finish_reason, len(parsed.calls))


def _usage(choices: list[Choice], finals: Sequence[Union[RequestOutput, CompletedOutput]]) -> Usage:
    prompts: dict[int, tuple[int, int]] = {}
    completion = 0
    for c, final in zip(choices, finals):
        prompts.setdefault(c.prompt_index, (len(c.prompt_ids), final.num_cached_tokens))
        completion += final.num_output_tokens
    prompt = sum(p for p, _ in prompts.values())
    cached = sum(k for _, k in prompts.values())
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def _json(payload: dict, ctx: CallContext) -> JSONResponse:
    return JSONResponse(payload, headers={"X-Request-Id": ctx.request_id})


def _event(data: str) -> str:
    return f"data: {data}\n\n"


def _stream_error(ctx: CallContext, exc: BaseException) -> str:
    """The engine failed mid-stream: the status line is long gone, so say it in an event."""
    logger.error("stream %s failed in the engine: %s", ctx.request_id, exc)
    body = error_body(500, f"the engine failed while serving request {ctx.request_id}", code="engine_error")
    return _event(json.dumps(body, separators=(",", ":")))


def _secs(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.3f}s"
