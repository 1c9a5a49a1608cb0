"""The front of a multi-instance server: the router and the API, in front of N workers.

Each generation request is tokenized (by a worker's `/tokenize`, so the ids are the served
model's), given a predicted output length, routed by the configured policy over the
workers' latest `InstanceState`s, and proxied: the worker's response streams through
unchanged.

Health: every worker is polled (`/internal/state`, which doubles as the load report). A
worker whose process exited, or that fails `fail_after` polls in a row, is taken out of
routing, killed (so its open connections break at once instead of hanging) and replaced by
a fresh one that rejoins when it answers. Requests it held:
- nothing streamed to the client yet (queued there, or still prefilling; or any non-streamed
  request): retried on another instance, so they are not lost;
- already streaming: end with an SSE error event (`code: instance_failed`) and `[DONE]`.
Nothing hangs: every path ends the client's response.

Between polls the front adds what it routed to each worker's last snapshot (counts, prompt
tokens, predicted decode), so a burst does not all land on the instance that looked idle.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Optional

import httpx
from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from sloserve.cluster.routers import RouterOptions, make_router
from sloserve.sched.state import InstanceState, KeySetIndex
from sloserve.server.instances import WorkerHandle
from sloserve.server.middleware import bearer_token
from sloserve.server.qos import QoSRegistry
from sloserve.types import Request, SamplingParams

logger = logging.getLogger(__name__)

STARTING, HEALTHY, DEAD = "starting", "healthy", "dead"
_TRANSPORT_ERRORS = (httpx.TransportError,)  # connect, read, write, protocol, timeouts
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens":\s*(\d+)')
_PASS_HEADERS = ("authorization", "x-api-key", "x-qos-class", "x-priority", "x-request-id", "content-type")


@dataclass
class Instance:
    slot: int
    handle: WorkerHandle
    status: str = STARTING
    generation: int = 0  # how many times this slot's worker was replaced
    state: Optional[InstanceState] = None
    prefix_keys: frozenset = frozenset()
    polled_at: float = 0.0
    failures: int = 0
    routed: int = 0
    in_flight: int = 0
    pending: list = field(default_factory=list)  # (routed at, prompt tokens, predicted tokens) not yet polled
    started_at: float = 0.0
    last_error: Optional[str] = None
    failed_starts: int = 0  # workers in a row that died before ever answering (crash loop: back off)
    respawn_at: Optional[float] = None  # when a dead slot gets its replacement

    def routing_state(self, block_size: int) -> InstanceState:
        """The last snapshot plus what was routed here since it was taken."""
        base = self.state or InstanceState(0, 0, 0, 0, 1, 1, 0, 0.0, float("inf"), block_size)
        if not self.pending:
            return dataclasses.replace(base, prefix_index=KeySetIndex(self.prefix_keys))
        prompt = sum(p for _, p, _ in self.pending)
        decode = sum(d for _, _, d in self.pending)
        bs = base.block_size
        return dataclasses.replace(
            base, num_waiting=base.num_waiting + len(self.pending), queued_prefill_tokens=base.queued_prefill_tokens
            + prompt, kv_blocks_waiting=base.kv_blocks_waiting + sum(-(-p // bs) for _, p, _ in self.pending),
            predicted_remaining_decode_tokens=base.predicted_remaining_decode_tokens + decode,
            prefix_index=KeySetIndex(self.prefix_keys))

    def describe(self) -> dict:
        s = self.state
        return {
            "instance": self.slot, "status": self.status, "generation": self.generation, **self.handle.describe(),
            "routed": self.routed, "in_flight": self.in_flight, "pending": len(self.pending),
            "consecutive_poll_failures": self.failures, "failed_starts": self.failed_starts,
            "last_error": self.last_error,
            "load": None if s is None else {
                "num_running": s.num_running, "num_waiting": s.num_waiting,
                "queued_prefill_tokens": s.queued_prefill_tokens, "kv_usage": round(s.kv_usage, 4),
                "kv_blocks_used": s.kv_blocks_used, "kv_blocks_total": s.kv_blocks_total,
                "predicted_remaining_decode_tokens": s.predicted_remaining_decode_tokens,
                "prefix_cache_hit_rate": round(s.prefix_cache_hit_rate, 4), "cached_prefix_blocks": len(self.prefix_keys)},
        }


@dataclass
class FrontConfig:
    router: str = "least-requests"
    poll_interval_s: float = 0.25
    fail_after: int = 3  # polls in a row without an answer before a live process counts as hung
    poll_timeout_s: float = 2.0
    start_timeout_s: float = 600.0  # a replacement that is not up by then is replaced again
    max_attempts: int = 3  # instances one request may be tried on before it fails
    replace_dead: bool = True
    max_backoff_s: float = 30.0  # a slot whose workers keep dying while starting waits 1, 2, 4, ... s up to this
    predictor: Optional[str] = "default"  # output-length predictor for the router; None = off
    seed: int = 0


class Fleet:
    """The workers, their health and their load, and the routing decision."""

    def __init__(self, spawn: Callable[[int], WorkerHandle], num_instances: int, config: FrontConfig,
                 clock: Callable[[], float] = time.monotonic):
        self.spawn = spawn
        self.config = config
        self.clock = clock
        self.instances = [Instance(i, spawn(i), started_at=clock()) for i in range(num_instances)]
        self.predictions = None
        if config.predictor:
            from sloserve.cluster.predict import PredictionBook, load_predictor

            self.predictions = PredictionBook(load_predictor(config.predictor))  # type: ignore[arg-type]
        self.router = make_router(config.router, RouterOptions(
            seed=config.seed, predictions=self.predictions.lookup if self.predictions else None))
        self.block_size = 16
        self.counters = {"retries": 0, "failed_midstream": 0, "replacements": 0, "no_instance": 0}
        self._client: Optional[httpx.AsyncClient] = None
        self._monitor: Optional[asyncio.Task] = None

    # ---- lifecycle -------------------------------------------------------------------
    async def start(self, wait_ready_s: Optional[float] = None) -> None:
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(connect=5.0, read=None, write=30.0, pool=30.0),
                                         limits=httpx.Limits(max_connections=2048, max_keepalive_connections=256))
        self._monitor = asyncio.create_task(self._watch())
        if wait_ready_s is not None:
            await self.wait_ready(wait_ready_s)

    async def wait_ready(self, timeout_s: float, count: Optional[int] = None) -> None:
        want = len(self.instances) if count is None else count
        deadline = self.clock() + timeout_s
        while sum(i.status == HEALTHY for i in self.instances) < want:
            if self.clock() > deadline:
                raise TimeoutError(f"only {sum(i.status == HEALTHY for i in self.instances)} of {want} workers "
                                   f"became healthy in {timeout_s:.0f} s")
            await asyncio.sleep(0.1)

    async def close(self) -> None:
        if self._monitor is not None:
            self._monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._monitor
        for inst in self.instances:
            inst.handle.kill()
        if self._client is not None:
            await self._client.aclose()

    @property
    def client(self) -> httpx.AsyncClient:
        assert self._client is not None, "fleet not started"
        return self._client

    # ---- health and load ---------------------------------------------------------------
    async def _watch(self) -> None:
        while True:
            await asyncio.gather(*(self._poll(inst) for inst in self.instances), return_exceptions=True)
            await asyncio.sleep(self.config.poll_interval_s)

    async def _poll(self, inst: Instance) -> None:
        if inst.status == DEAD:
            if inst.respawn_at is not None and self.clock() >= inst.respawn_at:
                self._respawn(inst)
            return
        handle = inst.handle
        if not handle.is_running():
            self.mark_dead(inst, "worker process exited")
            return
        url = handle.url
        if url is None:  # still starting (a Ray actor that has not reported its port)
            self._check_start_timeout(inst)
            return
        sent = self.clock()
        try:
            resp = await self.client.get(url + "/internal/state", timeout=self.config.poll_timeout_s)
            resp.raise_for_status()
            payload = resp.json()
        except Exception as e:  # noqa: BLE001 - any failure to answer counts the same
            if inst.status == STARTING:
                self._check_start_timeout(inst)
                return
            inst.failures += 1
            inst.last_error = f"poll failed: {type(e).__name__}: {e}"
            if inst.failures >= self.config.fail_after:
                self.mark_dead(inst, f"no answer to {inst.failures} polls in a row")
            return
        if handle is not inst.handle:  # replaced while the poll was in flight
            return
        fields = payload["state"]
        if fields.get("min_ttft_slack_s") is None:
            fields["min_ttft_slack_s"] = float("inf")
        inst.state = InstanceState(**fields)
        self.block_size = inst.state.block_size
        inst.prefix_keys = frozenset(int(k, 16) for k in payload.get("prefix_keys", ()))
        inst.pending = [p for p in inst.pending if p[0] > sent]
        inst.polled_at = sent
        inst.failures = 0
        if inst.status == STARTING:
            inst.status, inst.failed_starts = HEALTHY, 0
            logger.info("instance %d (generation %d) is healthy at %s", inst.slot, inst.generation, url)

    def _check_start_timeout(self, inst: Instance) -> None:
        if self.clock() - inst.started_at > self.config.start_timeout_s:
            self.mark_dead(inst, f"not healthy after {self.config.start_timeout_s:.0f} s")

    def mark_dead(self, inst: Instance, reason: str) -> None:
        """Out of routing, killed, and (by default) replaced by a fresh worker in the same slot."""
        if inst.status == DEAD:
            return
        logger.warning("instance %d (generation %d) is out: %s", inst.slot, inst.generation, reason)
        never_answered = inst.status == STARTING
        inst.status, inst.last_error = DEAD, reason
        inst.state, inst.prefix_keys, inst.pending = None, frozenset(), []
        inst.handle.kill()
        if not self.config.replace_dead:
            return
        inst.failed_starts = inst.failed_starts + 1 if never_answered else 0
        if inst.failed_starts == 0:
            self._respawn(inst)
        else:
            delay = min(self.config.max_backoff_s, 2.0 ** (inst.failed_starts - 1))
            logger.warning("instance %d: %d worker(s) in a row died while starting; next try in %.0f s",
                           inst.slot, inst.failed_starts, delay)
            inst.respawn_at = self.clock() + delay

    def _respawn(self, inst: Instance) -> None:
        inst.handle = self.spawn(inst.slot)
        inst.generation += 1
        inst.status, inst.respawn_at = STARTING, None
        inst.failures, inst.started_at = 0, self.clock()
        self.counters["replacements"] += 1

    def suspect(self, inst: Instance, handle: WorkerHandle, error: BaseException) -> None:
        """A proxied call to `handle` broke: if its process is gone, take it out now rather
        than at the next poll."""
        if inst.handle is handle and not handle.is_running():
            self.mark_dead(inst, f"worker process exited ({type(error).__name__})")

    # ---- routing ---------------------------------------------------------------------
    def healthy(self) -> list[Instance]:
        return [i for i in self.instances if i.status == HEALTHY]

    def pick(self, request: Request, exclude: set) -> Optional[Instance]:
        candidates = [i for i in self.healthy() if (i.slot, i.generation) not in exclude]
        if not candidates:
            return None
        states = [i.routing_state(self.block_size) for i in candidates]
        chosen = candidates[self.router.route(request, states)]
        chosen.pending.append((self.clock(), request.num_prompt_tokens, request.predicted_output_len or 0))
        chosen.routed += 1
        return chosen


# ---------------------------------------------------------------------------------- the app


def _error(status: int, message: str, code: str, err_type: str = "server_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": err_type, "code": code, "param": None}},
                        status_code=status)


def _sse_error(message: str, code: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "server_error", "code": code, "param": None}})
    return f"data: {body}\n\ndata: [DONE]\n\n".encode()


def _prompt_text(body: dict, chat: bool) -> Optional[str]:
    """The text the length predictor reads: the prompt, or the conversation's messages."""
    if chat:
        parts = []
        for m in body.get("messages") or []:
            c = m.get("content") if isinstance(m, dict) else None
            if isinstance(c, str):
                parts.append(c)
            elif isinstance(c, list):
                parts += [p.get("text", "") for p in c if isinstance(p, dict)]
        return "\n".join(parts) or None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else None


class Front:
    def __init__(self, fleet: Fleet, registry: Optional[QoSRegistry] = None):
        self.fleet = fleet
        self.registry = registry or QoSRegistry()

    def build_app(self) -> FastAPI:
        app = FastAPI(title="sloserve (multi-instance front)", docs_url=None, redoc_url=None)
        fleet = self.fleet
        app.state.front = self

        @app.get("/health")
        async def health() -> Response:
            n = len(fleet.healthy())
            if n == 0:
                return _error(503, "no healthy instance", "no_instance")
            return JSONResponse({"status": "ok", "healthy_instances": n, "instances": len(fleet.instances)})

        @app.get("/v1/instances")
        async def instances() -> JSONResponse:
            return JSONResponse({"router": fleet.config.router, "counters": fleet.counters,
                                 "data": [i.describe() for i in fleet.instances]})

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(generate_latest(self._registry()), media_type=CONTENT_TYPE_LATEST)

        @app.get("/v1/models")
        async def models(request: HTTPRequest) -> Response:
            return await self._forward_simple(request, "GET", "/v1/models")

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
            return Response(resp.content, status_code=resp.status_code,
                            media_type=resp.headers.get("content-type"))
        return _error(503, "no healthy instance", "no_instance")

    async def _prompt_ids(self, body: dict, chat: bool, headers: dict) -> tuple[Optional[list[int]], Optional[Response]]:
        """Token ids of the (first) prompt, from a worker; or the worker's 4xx to pass back."""
        if chat:
            payload = {"messages": body.get("messages"), "add_generation_prompt": True}
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
                return [int(t) for t in prompt], None  # already token ids
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
                return [int(t) for t in prompt[0]], None
            if isinstance(prompt, list) and prompt:
                prompt = prompt[0]
            payload = {"prompt": prompt if isinstance(prompt, str) else ""}
        if body.get("model"):
            payload["model"] = body["model"]
        for inst in self.fleet.healthy():
            try:
                resp = await self.fleet.client.post(inst.handle.url + "/tokenize", json=payload, headers={
                    k: v for k, v in headers.items() if k != "content-type"}, timeout=30.0)
            except _TRANSPORT_ERRORS as e:
                self.fleet.suspect(inst, inst.handle, e)
                continue
            if resp.status_code != 200:
                return None, Response(resp.content, status_code=resp.status_code,
                                      media_type=resp.headers.get("content-type"))
            return list(resp.json()["tokens"]), None
        return None, _error(503, "no healthy instance", "no_instance")

    # ---- generation ----------------------------------------------------------------------
    async def generate(self, request: HTTPRequest, path: str, chat: bool) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise ValueError("body must be a JSON object")
        except ValueError as e:
            return _error(400, f"invalid JSON body: {e}", "invalid_json", "invalid_request_error")
        headers = self._headers(request)
        principal = self.registry.authenticate(bearer_token(request.headers))
        if principal is None:
            return _error(401, "missing or invalid API key (send 'Authorization: Bearer <key>')", "invalid_api_key",
                          "invalid_request_error")
        ids, err = await self._prompt_ids(body, chat, headers)
        if err is not None:
            return err
        rid = request.headers.get("x-request-id") or f"front-{uuid.uuid4().hex[:16]}"
        routed = Request(rid, ids or [0], SamplingParams(max_tokens=None, temperature=0.0), tenant=principal.tenant)
        text = _prompt_text(body, chat)
        if self.fleet.predictions is not None:
            self.fleet.predictions.annotate(routed, text)
        stream = bool(body.get("stream"))
        tried: set = set()
        last_error = "no healthy instance"
        handed_off = False  # a streaming body took over the request (and its prediction)
        try:
            for attempt in range(self.fleet.config.max_attempts):
                inst = self.fleet.pick(routed, tried)
                if inst is None:
                    break
                handle = inst.handle
                tried.add((inst.slot, inst.generation))
                if attempt:
                    self.fleet.counters["retries"] += 1
                inst.in_flight += 1
                release = True
                try:
                    upstream = await self.fleet.client.send(
                        self.fleet.client.build_request("POST", handle.url + path, content=raw, headers=headers),
                        stream=True)
                except _TRANSPORT_ERRORS as e:
                    last_error = f"instance {inst.slot} unreachable: {type(e).__name__}"
                    self.fleet.suspect(inst, handle, e)
                    inst.in_flight -= 1
                    continue
                try:
                    if upstream.status_code == 429 and attempt + 1 < self.fleet.config.max_attempts:
                        last_error = f"instance {inst.slot} is full (429)"
                        continue  # another instance may have room
                    if not stream or upstream.status_code != 200:
                        try:
                            content = await upstream.aread()
                        except _TRANSPORT_ERRORS as e:  # died before answering: nothing sent yet, retry
                            last_error = f"instance {inst.slot} failed before answering: {type(e).__name__}"
                            self.fleet.suspect(inst, handle, e)
                            continue
                        self._learn(routed, content)
                        return Response(content, status_code=upstream.status_code,
                                        media_type=upstream.headers.get("content-type"))
                    chunks = upstream.aiter_raw()
                    try:
                        first = await chunks.__anext__()
                    except StopAsyncIteration:
                        first = b""
                    except _TRANSPORT_ERRORS as e:  # died before the first token: nothing streamed, retry
                        last_error = f"instance {inst.slot} failed before its first token: {type(e).__name__}"
                        self.fleet.suspect(inst, handle, e)
                        continue
                    release = False  # the streaming body owns the upstream from here
                    handed_off = True
                    return StreamingResponse(self._relay(inst, handle, upstream, chunks, first, routed),
                                             status_code=200, media_type=upstream.headers.get("content-type"))
                finally:
                    if release:
                        inst.in_flight -= 1
                        await upstream.aclose()
            self.fleet.counters["no_instance"] += 1
            return _error(503, f"request could not be served: {last_error}", "no_instance")
        finally:
            if self.fleet.predictions is not None and not handed_off:
                self.fleet.predictions.observe(routed, completed=False)  # forget it (_learn already learned)

    async def _relay(self, inst: Instance, handle: WorkerHandle, upstream: httpx.Response,
                     chunks: AsyncIterator[bytes], first: bytes, routed: Request) -> AsyncIterator[bytes]:
        tail = first[-512:]
        try:
            if first:
                yield first
            try:
                async for chunk in chunks:
                    tail = (tail + chunk)[-512:]
                    yield chunk
            except _TRANSPORT_ERRORS as e:
                self.fleet.counters["failed_midstream"] += 1
                self.fleet.suspect(inst, handle, e)
                logger.warning("instance %d failed while streaming request %s: %s", inst.slot, routed.request_id, e)
                yield _sse_error(f"instance {inst.slot} failed while generating this response; the output is "
                                 f"incomplete", "instance_failed")
                return
            self._learn(routed, tail)
        finally:
            inst.in_flight -= 1
            await upstream.aclose()
            if self.fleet.predictions is not None:
                self.fleet.predictions.observe(routed, completed=False)

    def _learn(self, routed: Request, content: bytes) -> None:
        """Feed the served model's actual output length back to the predictor."""
        book = self.fleet.predictions
        if book is None:
            return
        found = _COMPLETION_TOKENS.findall(content)
        if found and book.lookup(routed) is not None:
            book.observe(routed, actual_len=int(found[-1]))

    # ---- metrics -------------------------------------------------------------------------
    def _registry(self) -> CollectorRegistry:
        fleet = self.fleet

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
                for inst in fleet.instances:
                    label = [str(inst.slot)]
                    s = inst.state
                    gauges["healthy"].add_metric(label, 1.0 if inst.status == HEALTHY else 0.0)
                    gauges["running"].add_metric(label, s.num_running if s else 0)
                    gauges["waiting"].add_metric(label, s.num_waiting if s else 0)
                    gauges["kv"].add_metric(label, s.kv_usage if s else 0.0)
                    gauges["in_flight"].add_metric(label, inst.in_flight)
                    routed.add_metric(label, inst.routed)
                yield from gauges.values()
                yield routed
                for name, value in fleet.counters.items():
                    c = CounterMetricFamily(f"sloserve:front_{name}", f"front: {name.replace('_', ' ')}")
                    c.add_metric([], value)
                    yield c

        registry = CollectorRegistry()
        registry.register(_Collector())
        return registry
