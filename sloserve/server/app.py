"""The FastAPI application: routes, wiring, and the drain hook for graceful shutdown.

`build_app` takes a running AsyncLLMEngine (its one loop thread batches every in-flight
HTTP request) and returns an app with its own admission gate, metrics registry and QoS
registry, so several apps can coexist in one process.
"""
from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import sloserve
from sloserve.tracing import Tracing
from sloserve.engine.async_engine import AsyncLLMEngine
from sloserve.engine.lora import LoraError, LoraExists
from sloserve.server.admission import Admission
from sloserve.server.connections import BodyTimeout
from sloserve.server.dashboard import TimelineSampler, add_dashboard_routes
from sloserve.server.errors import APIError, GuardedRoute, bad_request, error_response, install_error_handlers
from sloserve.server.metrics import EngineGauges, ServerMetrics
from sloserve.server.middleware import EdgeMiddleware
from sloserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoraAdapterRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    UnloadLoraAdapterRequest,
)
from sloserve.server.responses import ResponsesRequest
from sloserve.server.tool_calls import tool_definitions
from sloserve.server.serving import OpenAIServing
from sloserve.server.settings import ServerSettings
from sloserve.server.qos import ANONYMOUS, CacheSalter, cache_secret
from sloserve.server.shedding import Shedder
from sloserve.server.tenants import TenantLimiter
from sloserve.timeline import FleetTimeline, read_instance

logger = logging.getLogger(__name__)


@dataclass
class ServerState:
    """Everything the routes share, hung on `app.state.sloserve`."""

    engine: AsyncLLMEngine
    settings: ServerSettings
    admission: Admission
    metrics: ServerMetrics
    serving: OpenAIServing
    timeline: FleetTimeline
    sampler: TimelineSampler

    async def drain(self, grace_s: float) -> int:
        """Stop admitting (503), let in-flight requests finish within `grace_s`, abort the rest."""
        logger.info("draining: %d requests in flight, grace period %.1fs", self.admission.num_in_flight, grace_s)
        aborted = await self.admission.drain(grace_s, self.engine.abort)
        if aborted:
            logger.warning("grace period over: aborted %d requests", aborted)
        return aborted

    def stop_now(self) -> None:
        """A second signal: refuse new work and abort everything in flight, without waiting."""
        self.admission.start_draining()
        for request_id in self.admission.in_flight_ids():
            self.engine.abort(request_id)


def build_app(engine: AsyncLLMEngine, settings: ServerSettings, service: str = "sloserve") -> FastAPI:
    """The server of one engine; `service`: what its trace spans name as their service (tracing.py)."""
    settings.validate()
    core = engine.engine
    names = settings.served_model_names or [core.model_name]
    shedder = Shedder(core, settings.retry_after_s) if settings.shed_unattainable else None
    admission = Admission(core.config.scheduler.max_num_seqs, settings.max_queue, settings.retry_after_s, shedder)
    timeline = FleetTimeline(settings.timeline_interval_s)
    timeline.meta.update(model=names[0], instances=1)
    metrics = ServerMetrics(EngineGauges.of(core, lambda: admission.num_in_flight), names[0], timeline)
    serving = OpenAIServing(engine, names, settings.registry, admission, metrics,
                            stall_timeout_s=settings.stall_timeout_s,
                            salter=CacheSalter(cache_secret(settings.cache_salt_secret)),
                            tenants=TenantLimiter(settings.registry.limits_for),
                            tool_call_parser=settings.tool_call_parser,
                            grammar_compile_timeout_s=settings.grammar_compile_timeout_s,
                            tracing=Tracing(settings.otlp_traces_endpoint, service))
    # Its thread ends with the engine (the sampler reads nothing once the engine is gone).
    sampler = TimelineSampler(timeline, lambda: [read_instance(0, core.scheduler, core.kv)],
                              alive=lambda: engine.is_alive).start()
    state = ServerState(engine, settings, admission, metrics, serving, timeline, sampler)

    app = FastAPI(title="sloserve", version=sloserve.__version__, docs_url="/docs", redoc_url=None)
    app.router.route_class = GuardedRoute
    app.state.sloserve = state
    install_error_handlers(app)

    @app.exception_handler(BodyTimeout)
    async def _body_timeout(request: Request, exc: BodyTimeout) -> Response:
        return error_response(APIError(408, str(exc.detail), code="request_timeout", headers={"Connection": "close"}))

    app.add_middleware(EdgeMiddleware, admission=admission, registry=settings.registry,
                       max_body_bytes=settings.max_body_bytes, observe_http=metrics.observe_http,
                       on_rejected=metrics.observe_rejected, body_timeout_s=settings.body_timeout_s,
                       admin_keys=settings.admin_keys)
    _add_routes(app, state)
    add_dashboard_routes(app, timeline, f"sloserve · {names[0]}")
    return app


def _add_routes(app: FastAPI, state: ServerState) -> None:
    serving, core = state.serving, state.engine.engine

    @app.get("/health")
    async def health() -> Response:
        if state.admission.draining:
            return error_response(APIError(503, "server is shutting down", code="draining"))
        if not state.engine.is_alive:
            return error_response(APIError(503, "engine loop is not running", code="engine_dead"))
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> dict:
        return {"version": sloserve.__version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        principal = getattr(request.state, "principal", ANONYMOUS)
        cards = [ModelCard(id=name, root=core.model_name, max_model_len=core.max_model_len)
                 if name in serving.served_models else
                 ModelCard(id=name, root=name, parent=serving.served_models[0], max_model_len=core.max_model_len)
                 for name in serving.model_ids(principal)]
        return ModelList(data=cards).model_dump()

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoraAdapterRequest) -> Response:
        """Read the adapter off the event loop and the engine thread, then serve it (admin only)."""
        if body.lora_name in serving.served_models:
            raise bad_request(f"lora_name {body.lora_name!r} is the base model's name", "lora_name")
        try:
            adapter = await asyncio.to_thread(core.loras.read, body.lora_name, body.lora_path)
            await state.engine.call(lambda engine: engine.loras.add(adapter))
        except LoraExists as exc:
            raise bad_request(str(exc), "lora_name", "lora_adapter_exists") from None
        except LoraError as exc:
            raise bad_request(str(exc), "lora_path" if "adapter name" not in str(exc) else "lora_name",
                              "invalid_lora_adapter") from None
        logger.info("LoRA adapter %r loaded from %s (rank %d, %s)", adapter.name, adapter.path, adapter.rank,
                    ", ".join(adapter.target_modules))
        return JSONResponse({"object": "lora_adapter", "id": adapter.name, "rank": adapter.rank,
                             "target_modules": list(adapter.target_modules), "status": "loaded"})

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoraAdapterRequest) -> Response:
        """Stop serving an adapter; its requests in flight finish with it (admin only)."""
        try:
            await state.engine.call(lambda engine: engine.loras.unload(body.lora_name))
        except LoraError as exc:
            raise APIError(404, str(exc), param="lora_name", code="model_not_found") from None
        logger.info("LoRA adapter %r unloaded", body.lora_name)
        return JSONResponse({"object": "lora_adapter", "id": body.lora_name, "status": "unloaded"})

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await serving.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await serving.chat(body, request)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        return await serving.responses(body, request)

    def take_slot(prefix: str) -> str:
        """An admission slot for the tokenizer endpoints, refusals counted like generation's."""
        try:
            return state.admission.take_slot(prefix)
        except APIError as err:
            if err.code in ("queue_full", "draining"):
                state.metrics.observe_rejected(err.code)
            raise

    def encode(body: TokenizeRequest) -> bytes:
        """The whole answer, serialized here: a million ids take FastAPI's encoder a second."""
        try:
            if body.messages is not None:
                messages, tools = serving.template_input([m.plain(i) for i, m in enumerate(body.messages)],
                                                         tool_definitions(body))
                ids = core.tokenizer.encode_chat(messages, body.add_generation_prompt, tools)
            else:
                ids = core.tokenizer.encode(body.prompt or "")
        except ValueError as exc:
            raise bad_request(str(exc), "messages" if body.messages is not None else "prompt") from None
        return json.dumps({"tokens": ids, "count": len(ids), "max_model_len": core.max_model_len}).encode()

    def decode(tokens: list[int]) -> str:
        vocab = core.model_config.vocab_size
        if any(not 0 <= t < vocab for t in tokens):
            raise bad_request(f"tokens must be integers in [0, {vocab})", "tokens")
        return core.tokenizer.decode(tokens)

    # Both cost CPU in proportion to the body: they hold an admission slot (a flood gets 429
    # like generation) and run in a worker thread, so /health and streams never wait on them.
    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request) -> Response:
        serving.check_model(body.model, getattr(request.state, "principal", ANONYMOUS))
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of prompt or messages", "prompt")
        slot = take_slot("tokenize")
        try:
            content = await asyncio.to_thread(encode, body)
        finally:
            state.admission.release(slot)
        return Response(content, media_type="application/json")

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
        serving.check_model(body.model, getattr(request.state, "principal", ANONYMOUS))
        slot = take_slot("detokenize")
        try:
            text = await asyncio.to_thread(decode, body.tokens)
        finally:
            state.admission.release(slot)
        return {"prompt": text}
