"""The front of a multi-instance server: the API in front of N workers (fleet.py has their
health, and the fleet controller that routes and plans migrations; front/edge.py the auth,
body limit, admission and draining).

Each generation request is tokenized (by a worker's `/tokenize`, so the ids are the served
model's), given a predicted output length, routed by the configured policy over the workers'
latest `InstanceState`s, and proxied. The worker's status, body and `Retry-After` /
`X-Request-Id` headers pass through; a 429 or 503 from one worker is tried on another, and
when every worker was full the client gets the last one's 429 with its Retry-After.

Streams and failures. A stream has *started* once the front forwarded an event that carries
generated output (`front.stream.carries_output`: for completions any chunk with choices, for
chat any chunk other than the opening role chunk, and [DONE], usage or error events). Until
then the front buffers what the worker sent, so the client has received nothing and the
request is retried on another instance if its worker fails. From then on a `RelaySession`
(front/relay.py) relays it: a started single-choice stream whose worker fails resumes on
another instance from the tokens already sent, and the fleet controller's migrations move it
live (front/migration.py); a stream nothing can resume ends with an SSE event
`{"error": {"code": "instance_failed"}}` and `data: [DONE]`. A non-streamed single-choice call
is relayed the same way, as a stream the front reads to its end and answers whole
(front/whole.py), so it fails over, migrates and is handed off like a stream. A call with
several choices (n > 1, several prompts; streamed or not) is split into one-choice calls, each
relayed that way, and its answer (or merged stream) assembled as the worker would have sent it
(front/fanout.py).

Nothing outlives its client: while the front waits on a worker (connecting, the buffered
start of a stream, a non-streamed answer) it also watches for the client's disconnect, and
closes the upstream connection when it comes, which makes the worker abort the request.
When the drain's grace period is over, requests still in flight are ended the same way
(503 `draining`, or an SSE error event for a started stream).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import re
import time
import uuid
from typing import AsyncIterator, Awaitable, Callable, Optional, TypeVar

import httpx
from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from sloserve.server.connections import BodyTimeout
from sloserve.server.dashboard import TimelineSampler, add_dashboard_routes
from sloserve.server.metrics import FinishedRequest
from sloserve.server.errors import (
    STATUS_CLIENT_GONE,
    APIError,
    GuardedRoute,
    error_body,
    error_response,
    install_error_handlers,
)
from sloserve.workers.fleet import DEAD, HEALTHY, STARTING, UNRESPONSIVE, FrontConfig, Instance, WorkerFleet
from sloserve.front.edge import FrontEdge, FrontGate, Ticket
from sloserve.front.autoscale import AutoscaleDriver
from sloserve.front.adapters import AdapterFanout
from sloserve.front.handoff import HandoffDriver
from sloserve.front.migration import MigrationDriver
from sloserve.front.relay import RelaySession, Upstream
from sloserve.front import responses as front_responses
from sloserve.front.fanout import MergedStream, Part, merge, split
from sloserve.front.whole import answers_whole, as_stream, collect_whole
from sloserve.front.stream import Interrupted, SSESplitter, Stop, carries_output
from sloserve.server.protocol import (GenerationRequest, check_call, header_priority, prompt_label,
                                      refuse_front_ids)
from sloserve.server.qos import CacheSalter, QoSRegistry, cache_secret
from sloserve.workers.contract import FLEET_SECRET_HEADER, FRONT_IDS_FIELD, QOS_HEADER, qos_header
from sloserve.timeline import DRAIN, UNDRAIN, FleetTimeline
from sloserve.tracing import OFF, Tracing, trace_headers
from sloserve.core.types import Request, SamplingParams

__all__ = ["DEAD", "HEALTHY", "STARTING", "UNRESPONSIVE", "Front", "WorkerFleet", "FrontConfig", "Instance"]

logger = logging.getLogger(__name__)

_TRANSPORT_ERRORS = (httpx.TransportError,)  # connect, read, write, protocol, timeouts
T = TypeVar("T")


class _WorkerStalled(Exception):
    """The worker stopped answering its health polls before this request sent the client anything."""

_COMPLETION_TOKENS = re.compile(rb'"completion_tokens":\s*(\d+)')
_PASS_HEADERS = ("authorization", "x-api-key", "x-qos-class", "x-priority", "x-request-id", "content-type")
_PASS_BACK = ("retry-after", "x-request-id", "cache-control", "x-accel-buffering")
_RETRY_STATUSES = (429, 503)  # full or draining: another worker may take it
_INLINE_BODY_BYTES = 64 * 1024  # larger request bodies are parsed and judged off the event loop
MIGRATION_METRICS = {  # the fleet controller's counters: /metrics name, help
    "started": ("migrations_started", "live migrations of running requests started"),
    "completed": ("migrations_completed", "migrations whose target took the request over"),
    "aborted": ("migrations_aborted", "migrations abandoned (the request went on at its source)"),
    "bytes": ("migration_bytes", "KV bytes copied by completed migrations"),
    "downtime_s": ("migration_downtime_seconds", "seconds requests were paused by completed migrations (sum)"),
}
HANDOFF_METRICS = {  # prefill -> decode hand-offs (the controller's handoff counters)
    "started": ("pd_handoffs_started", "prefill -> decode hand-offs started"),
    "completed": ("pd_handoffs_completed", "hand-offs whose decode instance took the request over"),
    "aborted": ("pd_handoffs_aborted", "hand-offs abandoned (the request went on where it was)"),
    "bytes": ("pd_handoff_bytes", "KV bytes copied by completed hand-offs"),
}


def _error(status: int, message: str, code: str, param: Optional[str] = None,
           headers: Optional[dict[str, str]] = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param=param, code=code), status_code=status, headers=headers)


def _sse_error(message: str, code: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "server_error", "code": code, "param": None}})
    return f"data: {body}\n\ndata: [DONE]\n\n".encode()


def _headers_back(upstream: httpx.Response) -> dict:
    return {k: v for k, v in upstream.headers.items() if k.lower() in _PASS_BACK}


def _read_events(reader, data: bytes) -> bytes:
    """`data`'s SSE events as the client gets them through a worker kind's stream reader (None:
    as they are)."""
    if reader is None:
        return data
    splitter = SSESplitter()
    return b"".join(reader.event(e)[0] for e in splitter.feed(data)) + splitter.rest()


def _token_ids(value: object) -> Optional[list[int]]:
    """`value` if it is a non-empty list of ints (not bools), else None."""
    if isinstance(value, list) and value and all(type(t) is int for t in value):
        return list(value)
    return None


def _naming_prompt(err: Response, index: int, count: int) -> Response:
    """A worker's refusal of one prompt of a batch, naming that prompt as the single server
    does (`prompt[i]: ...`, protocol.prompt_label)."""
    if count == 1:
        return err
    try:
        body = json.loads(err.body)
        body["error"]["message"] = f"{prompt_label(index, count)}: {body['error']['message']}"
    except (ValueError, KeyError, TypeError):
        return err
    kept = {k: v for k, v in err.headers.items() if k.lower() not in ("content-length", "content-type")}
    return JSONResponse(body, status_code=err.status_code, headers=kept)


def _judge(raw: bytes, chat: bool, headers) -> tuple[dict, GenerationRequest, SamplingParams]:
    """The body as JSON, as the call the worker's route would validate, and its sampling
    parameters (APIError if it is not a call a worker would take)."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise APIError(400, f"invalid JSON body: {type(e).__name__}: {str(e)[:200]}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object", code="invalid_json")
    call, params = check_call(body, chat, headers)
    refuse_front_ids(call)  # the front's own field: a client may not set it
    return body, call, params


def resumable(body: dict, chat: bool) -> bool:
    """Whether another instance can continue this call's stream: one choice of one prompt
    (calls with several choices are split first, front/fanout.py; what reaches here with
    several is a body the worker refuses)."""
    return body.get("stream") is True and single_choice(body, chat)


def single_choice(body: dict, chat: bool) -> bool:
    if body.get("n") not in (None, 1) or body.get("best_of") not in (None, 1):
        return False
    if chat:
        return True
    prompt = body.get("prompt")
    return not (isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) and len(prompt) > 1)


def _prompt_text(body: dict, chat: bool) -> Optional[str]:
    """The text the length predictor reads: the prompt, or the conversation's messages."""
    if chat:
        parts: list[str] = []
        for m in body.get("messages") or []:
            c = m.get("content") if isinstance(m, dict) else None
            if isinstance(c, str):
                parts.append(c)
            elif isinstance(c, list):
                parts += [p["text"] for p in c if isinstance(p, dict) and isinstance(p.get("text"), str)]
        return "\n".join(parts) or None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else None


class _RelayResponse(StreamingResponse):
    """A relayed stream that releases its upstream however the response ends."""

    def __init__(self, relay: AsyncIterator[bytes], release: Callable[[], Awaitable[None]], **kwargs) -> None:
        super().__init__(relay, **kwargs)
        self.relay = relay
        self._release = release

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.close()

    async def close(self) -> None:
        """End the relay and release its upstream (also for a stream never sent: a split call's
        parts when another part failed, front/fanout.py)."""
        await self.relay.aclose()  # type: ignore[attr-defined]
        await self._release()


class Front:
    def __init__(self, fleet: WorkerFleet, registry: Optional[QoSRegistry] = None, salter: Optional[CacheSalter] = None,
                 lora_modules: tuple[tuple[str, str], ...] = (), tracing: Tracing = OFF):
        """`salter` must use the secret the workers got, so the prefix keys the router computes
        for a request are the ones the workers publish for the same tenant's prefix;
        `lora_modules`: the adapters the workers start with (front/adapters.py); `tracing`: where
        each call's `sloserve.front` span goes (tracing.py)."""
        self.fleet = fleet
        self.tracing = tracing
        self.registry = registry or QoSRegistry()
        self.salter = salter or CacheSalter(cache_secret())
        cfg, spec = fleet.config, fleet.config.fleet
        self.gate = FrontGate(cfg.max_in_flight, cfg.retry_after_s)
        self.sessions: set[RelaySession] = set()  # the streams being relayed now
        self.epoch = fleet.clock()  # deadlines sent to workers as priorities count from here (workers/kinds/)
        self._tokenize_turn = 0  # which healthy worker judges the next prompt first (_prompt_ids)
        self.migration = MigrationDriver(fleet, self.sessions, fleet.controller, spec.migration_interval_s)
        self.handoff = HandoffDriver(fleet, self.migration, spec.pd_transfer)
        self.adapters = AdapterFanout(fleet, lora_modules)
        self.autoscale: Optional[AutoscaleDriver] = None
        if spec.autoscale:
            capacity = dict(zip(("prefill", "decode"), spec.pd_capacity or (0.0, 0.0))) if spec.pd \
                else spec.capacity_rps or 0.0
            self.autoscale = AutoscaleDriver(fleet, capacity, spec.scaling_interval_s,
                                             min(10.0, spec.scaling_interval_s), cfg.cold_start_guess_s, fleet.clock,
                                             on_drain=self.migration.tick)
        # The dashboard: requests as the clients saw them (TTFT, TPOT per class), the workers'
        # last polled state, and what happened to the fleet (on the wall clock, as the page shows).
        self.timeline = FleetTimeline(cfg.timeline_interval_s)
        self.timeline.meta.update(instances=len(fleet.instances), router=spec.router, migration=spec.migration,
                                  autoscale=spec.autoscale or "off",
                                  roles=",".join(i.role for i in fleet.instances) if fleet.disaggregated else "mixed")
        fleet.on_event = lambda kind, slot, detail: self.timeline.event(time.time(), kind, slot, detail)
        self.sampler = TimelineSampler(self.timeline, lambda: [i.timeline_reading() for i in fleet.instances])

    async def start(self) -> None:
        """Run the controller's migration (and autoscaling) loops (the fleet is started by its owner)."""
        self.sampler.start()
        self.migration.start()
        if self.autoscale is not None:
            self.autoscale.start()

    async def close(self) -> None:
        self.sampler.stop()
        if self.autoscale is not None:
            await self.autoscale.close()
        await self.handoff.close()
        await self.migration.close()

    async def drain(self, grace_s: float) -> int:
        """Stop admitting (503), let proxied requests finish within `grace_s`, end the rest."""
        return await self.gate.drain(grace_s)

    def stop_now(self) -> None:
        """A second signal: refuse new work; the process exits and its connections with it."""
        self.gate.draining = True

    def build_app(self) -> FastAPI:
        app = FastAPI(title="sloserve (multi-instance front)", docs_url=None, redoc_url=None, openapi_url=None)
        fleet = self.fleet
        app.state.front = self
        app.router.route_class = GuardedRoute  # a client gone mid-body is a 499, never a logged 500
        install_error_handlers(app)

        @app.exception_handler(BodyTimeout)
        async def _body_timeout(request: HTTPRequest, exc: BodyTimeout) -> Response:
            return error_response(APIError(408, str(exc.detail), code="request_timeout",
                                           headers={"Connection": "close"}))

        cfg = fleet.config
        app.add_middleware(FrontEdge, gate=self.gate, registry=self.registry, max_body_bytes=cfg.max_body_bytes,
                           body_timeout_s=cfg.body_timeout_s, admin_keys=cfg.admin_keys)

        @app.get("/health")
        async def health() -> Response:
            if self.gate.draining:
                return _error(503, "server is shutting down", "draining")
            n = len(fleet.healthy())
            if n == 0:
                return _error(503, "no healthy instance", "no_instance")
            return JSONResponse({"status": "ok", "healthy_instances": n, "instances": len(fleet.instances)})

        @app.get("/v1/instances")
        async def instances() -> JSONResponse:
            spec = fleet.config.fleet
            return JSONResponse({"router": spec.router, "migration": spec.migration,
                                 "counters": fleet.counters, "migrations": fleet.controller.counters,
                                 "handoffs": self.handoff.describe() if fleet.hands_off else None,
                                 "autoscale": None if self.autoscale is None else {
                                     "policy": spec.autoscale,
                                     **({"forecaster": spec.forecaster, "forecast_level": spec.forecast_level}
                                        if spec.autoscale in ("predictive", "hybrid") else {}),
                                     "min": sum(low for low, _ in spec.pool_bounds.values()),
                                     "max": len(fleet.instances), **self.autoscale.describe()},
                                 "in_flight": self.gate.num_in_flight, "max_in_flight": self.gate.capacity,
                                 "data": [i.describe() for i in fleet.instances]})

        @app.post("/v1/instances/{slot}/drain")
        async def drain_instance(slot: int) -> JSONResponse:
            inst = next((i for i in fleet.instances if i.slot == slot), None)
            if inst is None:
                raise APIError(404, f"no instance {slot}", param="instance", code="instance_not_found")
            inst.draining = True
            fleet.on_event(DRAIN, slot, "operator")
            moving = sum(s.upstream.inst is inst for s in self.sessions)
            logger.warning("instance %d is draining: out of routing; %d relayed streams to move", slot, moving)
            return JSONResponse({"instance": slot, "draining": True, "streams_to_move": moving})

        @app.delete("/v1/instances/{slot}/drain")
        async def undrain_instance(slot: int) -> JSONResponse:
            inst = next((i for i in fleet.instances if i.slot == slot), None)
            if inst is None:
                raise APIError(404, f"no instance {slot}", param="instance", code="instance_not_found")
            inst.draining = False
            fleet.on_event(UNDRAIN, slot, "operator")
            return JSONResponse({"instance": slot, "draining": False})

        @app.get("/v1/migrations/plan")
        async def migration_plan() -> JSONResponse:
            """What the controller would move now (a dry run: nothing starts)."""
            moves = []
            for move in self.migration.plan():
                session = self.migration.find(move.request_id)
                client_id = session.head.get("id") if session is not None else None
                moves.append({**dataclasses.asdict(move), "client_request_id": client_id})
            return JSONResponse({"moves": moves})

        @app.post("/v1/migrations")
        async def migrate(request: HTTPRequest) -> JSONResponse:
            try:
                body = json.loads(await request.body())
                request_id, slot = str(body["request_id"]), int(body["target"])
            except (ValueError, KeyError, TypeError):
                raise APIError(400, "give request_id (the response id or X-Request-Id) and target (an instance)",
                               code="invalid_request") from None
            session = self.migration.find(request_id)
            if session is None:
                raise APIError(404, f"no relayed stream {request_id!r} is in flight", param="request_id",
                               code="request_not_found")
            target = next((i for i in fleet.routable() if i.slot == slot), None)
            if target is None or target is session.upstream.inst:
                raise APIError(409, f"instance {slot} cannot take it (not healthy, draining, or its source)",
                               param="target", code="bad_target")
            precopy = body.get("mode", "pre-copy") != "stop-and-copy"  # the latter: the downtime baseline
            outcome = await self.migration.carry_out(session, target, precopy=precopy)
            return JSONResponse({"migrated": outcome.ok, "reason": outcome.reason, "kv_bytes": outcome.kv_bytes,
                                 "downtime_s": outcome.downtime_s, "rounds": outcome.rounds,
                                 "copy_s": outcome.copy_s,
                                 "instance": session.upstream.inst.slot})

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(generate_latest(self._registry()), media_type=CONTENT_TYPE_LATEST)

        @app.get("/v1/models")
        async def models(request: HTTPRequest) -> Response:
            return await self._forward_simple(request, "GET", "/v1/models")

        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(request: HTTPRequest) -> Response:
            return await self.adapters.load(await request.body())

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(request: HTTPRequest) -> Response:
            return await self.adapters.unload(await request.body())

        @app.post("/tokenize")
        async def tokenize(request: HTTPRequest) -> Response:
            return await self._forward_simple(request, "POST", "/tokenize")

        @app.post("/detokenize")
        async def detokenize(request: HTTPRequest) -> Response:
            return await self._forward_simple(request, "POST", "/detokenize")

        @app.post("/v1/completions")
        async def completions(request: HTTPRequest) -> Response:
            return await self.generate(request, "/v1/completions", chat=False)

        @app.post("/v1/chat/completions")
        async def chat(request: HTTPRequest) -> Response:
            return await self.generate(request, "/v1/chat/completions", chat=True)

        @app.post("/v1/responses")
        async def responses(request: HTTPRequest) -> Response:
            return await front_responses.answer(request, self.generate)

        add_dashboard_routes(app, self.timeline, "sloserve fleet")
        return app

    # ---- helpers -------------------------------------------------------------------------
    @staticmethod
    def _headers(request: HTTPRequest) -> dict:
        return {k: v for k, v in request.headers.items() if k.lower() in _PASS_HEADERS}

    async def _forward_simple(self, request: HTTPRequest, method: str, path: str) -> Response:
        body = await request.body()
        for inst in self.fleet.healthy():
            try:
                resp = await self.fleet.client.request(method, inst.handle.url + path, content=body or None,
                                                       headers=self._headers(request), timeout=30.0)
            except _TRANSPORT_ERRORS as e:
                self.fleet.suspect(inst, inst.handle, e)
                continue
            return Response(resp.content, status_code=resp.status_code, headers=_headers_back(resp),
                            media_type=resp.headers.get("content-type"))
        return _error(503, "no healthy instance", "no_instance")

    async def _prompt_ids(self, body: dict, chat: bool, headers: dict,
                          max_tokens: Optional[int]) -> tuple[Optional[list[int]], Optional[Response]]:
        """Token ids of the (first) prompt, from a worker's /internal/tokenize, which judges them
        as generation does (context window included); or that worker's 4xx to pass back, so a
        prompt no worker would take is refused before it is forwarded. None ids (and no error):
        no worker could tokenize it now; routed without prefix hints."""
        if chat:
            payload = {"messages": body["messages"], "add_generation_prompt": True}
            if body.get("tools"):  # rendered into the prompt as the worker will
                payload["tools"] = body["tools"]
        else:  # one prompt: a split call's part holds one (front/fanout.py), a whole call is judged by its first
            prompt = body["prompt"]
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]
            payload = {"prompt": prompt}  # text or token ids: the worker judges their range and length
        payload["max_tokens"] = max_tokens
        if isinstance(body.get("model"), str):
            payload["model"] = body["model"]
        forwarded = {k: v for k, v in headers.items() if k != "content-type"}
        healthy = self.fleet.healthy()
        self._tokenize_turn += 1  # each worker asked first in turn: no one worker judges every body
        for k in range(len(healthy)):
            inst = healthy[(self._tokenize_turn + k) % len(healthy)]
            kind = inst.handle.engine_kind
            call = kind.tokenize_call(payload)
            if call is None:  # the prompt is its ids: this kind of worker judges them at generation
                return _token_ids(payload.get("prompt")), None
            route, asked = call
            secret = {FLEET_SECRET_HEADER: self.fleet.fleet_secret} if self.fleet.fleet_secret and kind.contract else {}
            try:
                resp = await self.fleet.client.post(inst.handle.url + route, json=asked,
                                                    headers={**forwarded, **secret}, timeout=30.0)
            except _TRANSPORT_ERRORS as e:
                self.fleet.suspect(inst, inst.handle, e)
                continue
            if resp.status_code in _RETRY_STATUSES or resp.status_code >= 500:
                continue  # that worker is full or failed: ask another, else route blind (the proxy decides)
            if resp.status_code == 401:  # a worker that does not know this front's secret: no hint
                return None, None
            if resp.status_code != 200:
                return None, Response(resp.content, status_code=resp.status_code, headers=_headers_back(resp),
                                      media_type=resp.headers.get("content-type"))
            try:
                return _token_ids(resp.json().get("tokens")), None  # None for none: routed blind
            except ValueError:
                return None, None
        # every worker was full or unreachable: the ids are only a routing hint, the proxy decides
        return None, None

    # ---- generation ----------------------------------------------------------------------
    async def generate(self, request: HTTPRequest, path: str, chat: bool, raw: Optional[bytes] = None) -> Response:
        """A generation call (`raw`: its body, when not the request's own: front/responses.py).
        Traced (tracing.py): the `sloserve.front` span runs until the client has its answer or the
        start of its stream, and its context goes to every worker that serves the call."""
        if not self.tracing.enabled:
            return await self._generate(request, path, chat, raw, {})
        span = self.tracing.begin("sloserve.front", trace_headers(request.headers))
        carried: dict[str, str] = {}
        self.tracing.inject(span, carried)
        response: Optional[Response] = None
        try:
            response = await self._generate(request, path, chat, raw, carried)
            return response
        finally:
            status = response.status_code if response is not None else 500
            self.tracing.end(span, attributes={"http.route": path, "http.response.status_code": status,
                                               "sloserve.streamed": isinstance(response, _RelayResponse),
                                               "sloserve.router": self.fleet.config.fleet.router},
                             error=str(status) if status >= 400 else None)

    async def _generate(self, request: HTTPRequest, path: str, chat: bool, raw: Optional[bytes],
                        carried: dict[str, str]) -> Response:
        raw = raw if raw is not None else await request.body()
        principal = getattr(request.state, "principal", None) or self.registry.authenticate(None)
        if principal is None:  # the edge checks keys first; this is a backstop
            return _error(401, "missing or invalid API key", "invalid_api_key")
        # What a worker would refuse without the model is refused here, before anything is
        # forwarded (the same checks: protocol.check_call, the QoS registry). A large body is
        # judged in a thread, so /health and /metrics never wait behind it.
        if len(raw) > _INLINE_BODY_BYTES:
            body, call, params = await asyncio.to_thread(_judge, raw, chat, request.headers)
        else:
            body, call, params = _judge(raw, chat, request.headers)
        qos = self._qos(call, request, principal)
        headers = {**self._headers(request), **carried}
        if self.autoscale is not None:
            self.autoscale.observe_arrival()
        ticket: Optional[Ticket] = getattr(request.state, "ticket", None)
        stop = Stop(request.receive, ticket.abort if ticket is not None else None)
        try:
            parts = split(body, chat, request.headers.get("x-request-id"))
            if parts is not None:
                return await self._split_call(*parts, path, chat, qos, params.max_tokens, principal, headers, stop,
                                              ticket)
            ids, err = await stop.run(self._prompt_ids(body, chat, headers, params.max_tokens))
            if err is not None:
                return err
            rid = request.headers.get("x-request-id") or f"front-{uuid.uuid4().hex[:16]}"
            routed = Request(rid, ids or [0], SamplingParams(max_tokens=None, temperature=0.0),
                             arrival_time=self.fleet.clock(), tenant=principal.tenant,
                             cache_salt=self.salter.salt(principal), lora=self.adapters.named(body))
            routed.qos, routed.priority = qos
            if self.fleet.predictions is not None:
                self.fleet.predictions.annotate(routed, _prompt_text(body, chat))
            if ids is not None and (chat or isinstance(body.get("prompt"), str)):
                # tokenized once: the worker that serves it takes these ids (they are a worker's own)
                body = {**body, FRONT_IDS_FIELD: ids}
                raw = json.dumps(body).encode()
            return await self._proxy(routed, path, raw, body, headers, chat, stop, ticket)
        except Interrupted as e:
            if e.client_gone:
                logger.info("client left before its answer (%s): upstream closed", path)
                return Response(status_code=STATUS_CLIENT_GONE)
            return _error(503, "server is shutting down; the request was not completed", "draining")
        finally:
            stop.close()

    async def _split_call(self, call_id: str, parts: list[Part], path: str, chat: bool, qos: tuple,
                          max_tokens: Optional[int], principal, headers: dict, stop: Stop,
                          ticket: Optional[Ticket]) -> Response:
        """A call with several choices, run as one-choice calls together (front/fanout.py); the
        first part that fails ends the others and its error is the answer."""
        firsts = [part for part in parts if part.sample == 0]
        tokenized = await stop.run(asyncio.gather(*(self._prompt_ids(p.body, chat, headers, max_tokens)
                                                     for p in firsts)))
        for part, (_, err) in zip(firsts, tokenized):
            if err is not None:
                return err if chat else _naming_prompt(err, part.prompt_index, len(firsts))
        ids_of = {part.prompt_index: ids for part, (ids, _) in zip(firsts, tokenized)}
        ended = asyncio.Event()
        failed: list[Response] = []
        interrupted: list[Interrupted] = []

        async def run(part: Part) -> Optional[Response]:
            routed = Request(part.request_id, ids_of[part.prompt_index] or [0],
                             SamplingParams(max_tokens=None, temperature=0.0), arrival_time=self.fleet.clock(),
                             tenant=principal.tenant, cache_salt=self.salter.salt(principal),
                             lora=self.adapters.named(part.body))
            routed.qos, routed.priority = qos
            if self.fleet.predictions is not None:
                self.fleet.predictions.annotate(routed, _prompt_text(part.body, chat))
            body, ids = part.body, ids_of[part.prompt_index]
            if ids is not None and (chat or isinstance(body.get("prompt"), str)):
                body = {**body, FRONT_IDS_FIELD: ids}  # tokenized once, here, for every sample of the prompt
            part_stop = stop.joined(ended)
            try:
                response = await self._proxy(routed, path, json.dumps(body).encode(), body,
                                             {**headers, "x-request-id": part.request_id}, chat, part_stop, ticket)
            except Interrupted as e:
                interrupted.append(e)
                return None
            finally:
                part_stop.close()
            if response.status_code != 200:
                failed.append(response)
                ended.set()
            return response

        responses = await asyncio.gather(*(run(part) for part in parts))
        relays = [r for r in responses if isinstance(r, _RelayResponse)]

        async def release() -> None:
            for relay in relays:
                await relay.close()

        if failed or interrupted:
            await release()
            if failed:
                return failed[0]
            raise interrupted[0]
        self.fleet.counters["split_calls"] += 1
        back = {k: v for k, v in responses[0].headers.items() if k in _PASS_BACK}  # type: ignore[union-attr]
        back["x-request-id"] = call_id
        if parts[0].body.get("stream") is not True:
            return JSONResponse(merge(call_id, parts, [json.loads(r.body) for r in responses]),  # type: ignore
                                headers=_whole_headers(back))
        sources = [r.relay if isinstance(r, _RelayResponse) else _chunks(r.body) for r in responses]  # type: ignore
        return _RelayResponse(MergedStream(call_id, parts, sources).events(), release, status_code=200, headers=back,
                              media_type=responses[0].media_type)  # type: ignore[union-attr]

    def _qos(self, call: GenerationRequest, request: HTTPRequest, principal) -> tuple:
        """The request's class and priority as its worker resolves them (the controller's
        priority migration reads them); what the worker would refuse (an unknown class, one the
        key may not use) is refused here."""
        name = call.qos_class if call.qos_class is not None else request.headers.get("x-qos-class")
        priority = call.priority if call.priority is not None else header_priority(request.headers.get("x-priority"))
        return self.registry.authorize(name, principal, priority)

    async def _proxy(self, routed: Request, path: str, raw: bytes, body: dict, headers: dict, chat: bool,
                     stop: Stop, ticket: Optional[Ticket]) -> Response:
        """Try instances until one answers; the first that starts a stream owns it (and a
        RelaySession relays it from then on, across failovers and migrations)."""
        stream = body.get("stream") is True
        whole = answers_whole(body, single_choice(body, chat))  # relayed as a stream, answered whole
        if whole:
            body = as_stream(body)
            raw = json.dumps(body).encode()
            stream = True
        contract_headers = {}  # for workers that speak sloserve's contract (workers/kinds/)
        if self.fleet.fleet_secret:  # the workers annotate the streams of their own front
            contract_headers[FLEET_SECRET_HEADER] = self.fleet.fleet_secret
            # the class and priority resolved here, once: the worker takes them as given
            contract_headers[QOS_HEADER] = qos_header(routed.qos.name, routed.priority)
        tried: set = set()
        last_error = "no healthy instance"
        refused: Optional[Response] = None  # the last worker's 429/503, returned if nobody else takes it
        handed_off = False  # a streaming body took over the request (and its prediction)
        try:
            if self.autoscale is not None and not any(i.role != "decode" for i in self.fleet.routable()):
                # Scaled to zero (or every arrival worker starting or draining): wait for one, if
                # it is expected within the request's TTFT target; else refuse now, saying when.
                wait_s = self.autoscale.ready_in_s()
                if wait_s > routed.qos.ttft_target_s:
                    self.autoscale.wake()
                    retry = max(1, math.ceil(wait_s))
                    return _error(503, f"no worker is serving: one is starting and expected ready in about {retry} s, "
                                       f"beyond this request's TTFT target of {routed.qos.ttft_target_s:g} s "
                                       f"(QoS class {routed.qos.name!r}); retry after {retry} s", "cold_start",
                                  headers={"Retry-After": str(retry)})
                started = await self.autoscale.hold(
                    lambda: any(i.role != "decode" for i in self.fleet.routable()), stop,
                    self.fleet.config.start_timeout_s)
                if not started:
                    last_error = "no worker became ready in time"
            for attempt in range(self.fleet.config.max_attempts):
                inst = self.fleet.pick(routed, tried)
                if inst is None:
                    break
                handle = inst.handle
                kind = handle.engine_kind
                upstream_headers = {**headers, **contract_headers} if kind.contract else dict(headers)
                sent = raw if kind.contract else kind.upstream_body(body, raw, routed, self.epoch)
                tried.add((inst.slot, inst.generation))
                if attempt:
                    self.fleet.counters["retries"] += 1
                inst.in_flight += 1
                upstream: Optional[httpx.Response] = None
                session_owns = False  # a RelaySession took the upstream over (and releases it)
                # a pipelined hand-off: the decode instance is chosen now and gets the KV as it is computed
                continuable = resumable(body, chat) and kind.resumable(body)
                early = self.handoff.early_target(routed, inst) if kind.contract and continuable else None
                try:
                    try:
                        upstream = await self._before_start(stop, inst, tried, self.fleet.client.send(
                            self.fleet.client.build_request("POST", handle.url + path, content=sent,
                                                            headers=upstream_headers if early is None
                                                            else {**upstream_headers, **early.header()}),
                            stream=True))
                        if not stream or upstream.status_code != 200:
                            content = await self._before_start(stop, inst, tried, upstream.aread())
                        else:
                            chunks = upstream.aiter_raw()
                            head, done = await self._before_start(stop, inst, tried,
                                                                  self._until_started(chunks, chat))
                    except _TRANSPORT_ERRORS as e:  # nothing reached the client yet: try another instance
                        last_error = f"instance {inst.slot} failed before answering: {type(e).__name__}"
                        self.fleet.suspect(inst, handle, e)
                        continue
                    except _WorkerStalled:  # same: closing the upstream makes the worker drop it when it wakes
                        last_error = f"instance {inst.slot} stopped answering before this request started"
                        self.fleet.counters["moved_unstarted"] += 1
                        continue
                    back = _headers_back(upstream)
                    media = upstream.headers.get("content-type")
                    if upstream.status_code in _RETRY_STATUSES:
                        last_error = f"instance {inst.slot} answered {upstream.status_code}"
                        refused = Response(content, status_code=upstream.status_code, headers=back, media_type=media)
                        continue
                    if not stream or upstream.status_code != 200:
                        self.learn(routed, content)
                        if upstream.status_code == 200:  # the client gets everything at once: TTFT = E2E
                            now = self.fleet.clock()
                            self.finished(routed, now, now, _completion_tokens(content) or 1)
                        return Response(content, status_code=upstream.status_code, headers=back, media_type=media)
                    if done:  # the whole stream came before anything counted as started
                        head = _read_events(kind.stream_reader(body), head)
                        self.learn(routed, head)
                        if whole:
                            status, payload = await self._answer_whole(_chunks(head), chat)
                            return JSONResponse(payload, status_code=status, headers=_whole_headers(back))
                        return Response(head, status_code=200, headers=back, media_type=media)
                    session = RelaySession(self, routed, path, body, headers, chat, continuable,
                                           Upstream(inst, inst.generation, upstream, chunks),
                                           ticket.abort if ticket is not None else None)
                    session.answered_whole = whole
                    session.early_target = early
                    self.sessions.add(session)
                    session_owns = True
                    if whole:
                        status, payload = await self._answer_whole(session.stream(head), chat, session, stop)
                        if status == 500 and payload["error"].get("code") == "instance_failed":
                            # Its worker died and no instance could resume it, but the client has
                            # nothing yet: the call starts again elsewhere.
                            last_error = f"instance {inst.slot} failed while generating"
                            continue
                        handed_off = True
                        return JSONResponse(payload, status_code=status, headers=_whole_headers(back))
                    handed_off = True
                    return _RelayResponse(session.stream(head), session.release, status_code=200, headers=back,
                                          media_type=media)
                finally:
                    if not session_owns:
                        inst.relay_ended(self.fleet.clock())
                        if upstream is not None:
                            await upstream.aclose()
            if refused is not None:
                return refused
            self.fleet.counters["no_instance"] += 1
            return _error(503, f"request could not be served: {last_error}", "no_instance")
        finally:
            if self.fleet.predictions is not None and not handed_off:
                self.fleet.predictions.observe(routed, completed=False)  # forget it (_learn already learned)

    @staticmethod
    async def _answer_whole(events: AsyncIterator[bytes], chat: bool, session: Optional[RelaySession] = None,
                            stop: Optional[Stop] = None) -> tuple[int, dict]:
        """A non-streamed call's answer (status, JSON), read from its relayed stream
        (front/whole.py); the client's disconnect (Interrupted, from `stop`) ends the stream
        and frees its request."""
        try:
            work = collect_whole(events, chat)
            return await (stop.run(work) if stop is not None else work)
        finally:
            await events.aclose()  # type: ignore[attr-defined]
            if session is not None:
                await session.release()

    async def _before_start(self, stop: Stop, inst: Instance, tried: set, work: Awaitable[T]) -> T:
        """`work` (upstream I/O before anything reached the client), raced against the client's
        disconnect (Interrupted) and against `inst` ceasing to answer its health polls: then, if
        another instance could take the request, _WorkerStalled, so a request queued on a frozen
        or hung worker moves instead of waiting it out; with no alternative it keeps waiting."""
        task = asyncio.ensure_future(work)
        try:
            stalled = asyncio.ensure_future(inst.stalled.wait())
            try:
                await stop.run(asyncio.wait([task, stalled], return_when=asyncio.FIRST_COMPLETED))
            finally:
                stalled.cancel()
            if not task.done():
                if self.fleet.has_alternative(tried):
                    raise _WorkerStalled()
                await stop.run(asyncio.shield(task))
            return task.result()
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task

    @staticmethod
    async def _until_started(chunks: AsyncIterator[bytes], chat: bool) -> tuple[bytes, bool]:
        """Read (and keep) events until one carries output: (what came, whether the stream ended)."""
        splitter = SSESplitter()
        head = b""
        async for chunk in chunks:
            head += chunk
            if any(carries_output(e, chat) for e in splitter.feed(chunk)):
                return head, False
        return head, True

    def started(self, session: RelaySession) -> None:
        """A relayed stream has tokens on a new instance (RelaySession.stream)."""
        self.handoff.offer(session)

    def forget(self, session: RelaySession) -> None:
        """A relayed stream ended (RelaySession.release)."""
        self.sessions.discard(session)
        self.handoff.observe_stream(session)
        if self.fleet.predictions is not None:
            self.fleet.predictions.observe(session.routed, completed=False)
        if session.finished and session.first_token_at is not None:
            # An answer sent whole reaches its client at the end: its first token is its last.
            first = session.last_token_at if session.answered_whole else session.first_token_at
            self.finished(session.routed, first, session.last_token_at, len(session.tokens))

    def finished(self, routed: Request, first_token_at: float, last_token_at: float, num_tokens: int) -> None:
        """A request answered in full, timed as its client saw it: its class's SLO counts."""
        record = FinishedRequest(routed.request_id, routed.tenant, routed.qos, routed.num_prompt_tokens,
                                 max(1, num_tokens), 0, "stop", first_token_at - routed.arrival_time,
                                 last_token_at - routed.arrival_time, None)
        self.timeline.finished(routed.qos.name, record.ttft, record.tpot, record.meets_slo)

    def learn(self, routed: Request, content: bytes) -> None:
        """Feed the served model's actual output length back to the predictor."""
        book = self.fleet.predictions
        if book is None:
            return
        actual = _completion_tokens(content)
        if actual is not None and book.lookup(routed) is not None:
            book.observe(routed, actual_len=actual)

    # ---- metrics -------------------------------------------------------------------------
    def _registry(self) -> CollectorRegistry:
        fleet = self.fleet
        handoff = self.handoff
        front = self

        class _Collector:
            def collect(self):
                gauges = {
                    "healthy": GaugeMetricFamily("sloserve:instance_healthy", "1 if the instance takes requests",
                                                 labels=["instance"]),
                    "running": GaugeMetricFamily("sloserve:instance_num_requests_running",
                                                 "running requests as last polled", labels=["instance"]),
                    "waiting": GaugeMetricFamily("sloserve:instance_num_requests_waiting",
                                                 "waiting requests as last polled", labels=["instance"]),
                    "kv": GaugeMetricFamily("sloserve:instance_kv_cache_usage_perc", "KV blocks in use",
                                            labels=["instance"]),
                    "in_flight": GaugeMetricFamily("sloserve:instance_requests_in_flight",
                                                   "requests the front is proxying to it", labels=["instance"]),
                }
                routed = CounterMetricFamily("sloserve:instance_routed", "requests routed to the instance",
                                             labels=["instance"])
                role = GaugeMetricFamily("sloserve:instance_role", "1 for the instance's role (prefill, decode, mixed)",
                                         labels=["instance", "role"])
                for inst in fleet.instances:
                    label = [str(inst.slot)]
                    s = inst.state
                    gauges["healthy"].add_metric(label, 1.0 if inst.status == HEALTHY else 0.0)
                    gauges["running"].add_metric(label, s.num_running if s else 0)
                    gauges["waiting"].add_metric(label, s.num_waiting if s else 0)
                    gauges["kv"].add_metric(label, s.kv_usage if s else 0.0)
                    gauges["in_flight"].add_metric(label, inst.in_flight)
                    routed.add_metric(label, inst.routed)
                    role.add_metric([str(inst.slot), inst.role], 1.0)
                yield from gauges.values()
                yield routed
                yield role
                for name, value in fleet.counters.items():
                    c = CounterMetricFamily(f"sloserve:front_{name}", f"front: {name.replace('_', ' ')}")
                    c.add_metric([], value)
                    yield c
                requests = CounterMetricFamily("sloserve:slo_requests", "Finished requests per QoS class (as the "
                                               "clients saw them).", labels=["qos_class"])
                attained = CounterMetricFamily("sloserve:slo_attained_requests", "Finished requests that met their "
                                               "class's TTFT and TBT targets.", labels=["qos_class"])
                for name, counts in front.timeline.to_totals().items():
                    requests.add_metric([name], counts[0])
                    attained.add_metric([name], counts[1])
                yield requests
                yield attained
                migrations = fleet.controller.counters
                for key, (name, help_text) in MIGRATION_METRICS.items():
                    c = CounterMetricFamily(f"sloserve:{name}", help_text)
                    c.add_metric([], migrations[key])
                    yield c
                if front.autoscale is not None:
                    states = GaugeMetricFamily("sloserve:instances", "instances by autoscaling state",
                                               labels=["state"])
                    described = front.autoscale.describe()
                    for state in ("ready", "starting", "draining", "stopped"):
                        states.add_metric([state], described[state])
                    yield states
                    target = GaugeMetricFamily("sloserve:autoscale_target", "instances the autoscaler wants ready")
                    target.add_metric([], described["target"] if described["target"] is not None else 0)
                    yield target
                    for key in ("starts", "stops", "drains", "cancelled", "taken_back"):
                        c = CounterMetricFamily(f"sloserve:autoscale_{key}", f"autoscaling: {key.replace('_', ' ')}")
                        c.add_metric([], described[key])
                        yield c
                if not fleet.hands_off:
                    return
                handoffs = fleet.controller.handoff_counters
                for key, (name, help_text) in HANDOFF_METRICS.items():
                    c = CounterMetricFamily(f"sloserve:{name}", help_text)
                    c.add_metric([], handoffs[key])
                    yield c
                c = CounterMetricFamily("sloserve:pd_decoded_on_prefill",
                                        "fallbacks: streams no decode instance took (they decoded where prefilled)")
                c.add_metric([], handoff.decoded_on_prefill)
                yield c
                c = CounterMetricFamily("sloserve:pd_handoff_aborts", "hand-off tries abandoned, by reason (the "
                                        "refusing worker's error code, or the front's: client_gone, stream_ended)",
                                        labels=["reason"])
                for reason, n in sorted(handoff.aborted.items()):
                    c.add_metric([reason], n)
                yield c
                c = CounterMetricFamily("sloserve:pd_handoffs_kept", "streams left to decode where they were "
                                        "prefilled, by why (finishes_within_handoff: fewer tokens left than the "
                                        "hand-off's pause is worth)", labels=["reason"])
                for reason, n in sorted(handoff.kept.items()):
                    c.add_metric([reason], n)
                yield c
                c = CounterMetricFamily("sloserve:pd_handoff_pipelined_bytes",
                                        "KV bytes hand-offs sent while the prompt was computed (--pd-transfer pipelined)")
                c.add_metric([], handoff.pipelined_bytes)
                yield c
                h = HistogramMetricFamily("sloserve:pd_handoff_seconds",
                                          "first token on the prefill instance to the next on the decode instance")
                h.add_metric([], handoff.latency.cumulative(), handoff.latency.sum)
                yield h

        registry = CollectorRegistry()
        registry.register(_Collector())
        return registry


async def _chunks(data: bytes) -> AsyncIterator[bytes]:
    yield data


def _whole_headers(back: dict) -> dict:
    """A stream's headers worth keeping on an answer sent whole (not its cache-control)."""
    return {k: v for k, v in back.items() if k.lower() in ("retry-after", "x-request-id")}


def _completion_tokens(content: bytes) -> Optional[int]:
    """The served model's output length, from the response's usage (None without one)."""
    found = _COMPLETION_TOKENS.findall(content)
    return int(found[-1]) if found else None
