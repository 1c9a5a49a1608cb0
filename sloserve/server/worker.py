"""One engine worker of a multi-instance server.

A worker is the ordinary single-instance server (`sloserve serve`: its own engine, admission,
QoS and metrics) plus internal routes for its front: `GET /internal/state` publishes what the
front's router needs (the scheduler's `InstanceState` and the keys of the prefix blocks it
has cached), `POST /internal/tokenize` gives a call's prompt ids judged as generation judges
them (the context window included), and worker_migration.py's routes move requests. The same worker runs as a local process (`python -m sloserve.server.worker`) or
inside a Ray actor (`sloserve.workers.handles.RayWorker`); the front talks HTTP to both.

`/internal/*` publishes cached block keys (derived from tenants' prompts), so it answers only
a caller that sends the fleet's secret in `X-Sloserve-Fleet-Secret`: a random value the front
makes per run and hands its workers (environment for processes, an argument for Ray actors).
A worker without a secret serves no internal route at all.
"""
from __future__ import annotations

import argparse
import dataclasses
import hmac
import json
import logging
import os
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from sloserve.core.config import EngineConfig
from sloserve.timeline import READING_FIELDS, read_instance
from sloserve.workers.contract import (
    API_KEYS_ENV,
    CACHE_SECRET_ENV,
    FLEET_SECRET_ENV,
    FLEET_SECRET_HEADER,
    INTERNAL_PREFIX,
    WorkerState,
    config_from_json,
)

logger = logging.getLogger(__name__)

MAX_PUBLISHED_KEYS = 8192  # most recently cached blocks; enough to find every live conversation


def state_payload(core: Any, max_keys: int = MAX_PUBLISHED_KEYS) -> dict:
    """The worker's `WorkerState` as JSON: the scheduler's snapshot and the newest cached block
    keys (device, then host and disk tiers).

    The engine thread owns these structures; reading them from the HTTP thread can race with
    a step that changes them, so a read that trips over a concurrent change is retried (the
    snapshot is advisory: the next poll corrects any staleness)."""
    for attempt in range(5):
        try:
            state = core.scheduler.snapshot(core.clock())
            keys = core.kv.newest_held_keys(max_keys)  # the device's cache, then its lower local tiers
            reading = read_instance(0, core.scheduler, core.kv)  # the front's dashboard timeline
            break
        except RuntimeError:  # "changed size during iteration"
            if attempt == 4:
                raise
    loras = getattr(core, "loras", None)
    if loras is not None:
        state = dataclasses.replace(state, adapters=frozenset(loras.resident()))
    counters = {name: getattr(reading, name) for name in READING_FIELDS}
    return WorkerState(state, frozenset(keys), counters).to_json()


class InternalGuard:
    """ASGI: `/internal/*` needs the fleet secret (401 in the error schema otherwise), checked
    before routing so even an unknown internal path reveals nothing."""

    def __init__(self, app: ASGIApp, secret: Optional[str]) -> None:
        self.app = app
        self.secret = secret.encode() if secret else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        allowed = self._allowed(scope)
        if scope.get("path", "").startswith(INTERNAL_PREFIX) and not allowed:
            from sloserve.server.errors import APIError
            from sloserve.server.middleware import send_error

            await send_error(send, APIError(401, "internal endpoints need the fleet secret",
                                            code="invalid_fleet_secret"))
            return
        if allowed:  # the fleet's front: its streams carry what a resume elsewhere needs
            scope.setdefault("state", {})["fleet"] = True
        await self.app(scope, receive, send)

    def _allowed(self, scope: Scope) -> bool:
        given = Headers(scope=scope).get(FLEET_SECRET_HEADER)
        if self.secret is None or given is None:
            return False
        return hmac.compare_digest(given.encode(), self.secret)


def add_worker_routes(app: FastAPI, engine: Any, fleet_secret: Optional[str]) -> None:
    from sloserve.server.worker_migration import add_migration_routes

    app.add_middleware(InternalGuard, secret=fleet_secret)
    migrations = add_migration_routes(app, engine, fleet_secret)

    @app.get("/internal/state")
    async def internal_state() -> JSONResponse:
        await migrations.expire()  # the front polls this several times a second
        return JSONResponse(state_payload(engine.engine))

    # The body is read raw and judged in the tokenizer pool (serving.admitted_prompt_ids): a
    # route declaring a RoutingProbe would have FastAPI validate it on the event loop.
    @app.post("/internal/tokenize")
    async def internal_tokenize(request: Request) -> Response:
        ids = await app.state.sloserve.serving.admitted_prompt_ids(await request.body())
        return Response(json.dumps({"tokens": ids, "count": len(ids)}), media_type="application/json")


def build_worker_app(engine_config: EngineConfig, settings, fleet_secret: Optional[str] = None):
    """Engine + app of one worker (the caller runs it and shuts the engine down)."""
    from sloserve.engine.async_engine import AsyncLLMEngine
    from sloserve.engine.llm_engine import LLMEngine
    from sloserve.server.app import build_app

    engine = AsyncLLMEngine(lambda: LLMEngine(engine_config))
    app = build_app(engine, settings, service="sloserve-worker")
    add_worker_routes(app, engine, fleet_secret)
    return engine, app


# The ServerSettings a front hands on to its workers unchanged (the edge options, such as
# timeouts and connection caps, belong to the front, which is what clients reach).
WORKER_OPTIONS = ("stall_timeout_s", "shed_unattainable", "tool_call_parser", "grammar_compile_timeout_s",
                  "otlp_traces_endpoint")


def worker_options(settings) -> dict:
    """What `settings_from_args` needs of a front's settings, as plain JSON data."""
    options = {name: getattr(settings, name) for name in WORKER_OPTIONS}
    options["cache_isolation"] = settings.registry.cache_isolation
    return options


def settings_from_args(qos_config: Optional[str], api_keys: list[str], served_model_names: list[str],
                       max_queue: int, options: Optional[dict] = None, cache_secret: Optional[str] = None):
    from sloserve.server.qos import QoSRegistry, load_qos_config
    from sloserve.server.settings import ServerSettings

    options = dict(options or {})
    registry = load_qos_config(qos_config) if qos_config else QoSRegistry()
    isolation = options.pop("cache_isolation", None)
    if isolation:
        registry = registry.with_cache_isolation(isolation)
    unknown = set(options) - set(WORKER_OPTIONS)
    if unknown:
        raise ValueError(f"unknown worker options {sorted(unknown)}")
    return ServerSettings(served_model_names=list(served_model_names), registry=registry.with_keys(api_keys),
                          max_queue=max_queue, grace_period_s=0.0, cache_salt_secret=cache_secret, **options)


def main(argv: Optional[list[str]] = None) -> int:
    import uvicorn

    p = argparse.ArgumentParser(description="sloserve engine worker (started by `sloserve serve --instances N`)")
    p.add_argument("--config", required=True, help="EngineConfig as JSON")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--qos-config")
    p.add_argument("--served-model-name", action="append", default=[])
    p.add_argument("--max-queue", type=int, default=256)
    p.add_argument("--log-level", default="warning")
    p.add_argument("--options", default="{}", help="server options from the front (JSON; see WORKER_OPTIONS)")
    args = p.parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(levelname)s worker:%(name)s: %(message)s")
    keys = [k for k in os.environ.get(API_KEYS_ENV, "").split("\n") if k]
    secret = os.environ.pop(FLEET_SECRET_ENV, None) or None
    if secret is None:
        logger.warning("no %s in the environment: /internal/* is closed", FLEET_SECRET_ENV)
    cache_secret = os.environ.pop(CACHE_SECRET_ENV, None) or None
    settings = settings_from_args(args.qos_config, keys, args.served_model_name, args.max_queue,
                                  json.loads(args.options), cache_secret)
    engine, app = build_worker_app(config_from_json(args.config), settings, secret)
    try:
        uvicorn.run(app, host=args.host, port=args.port, lifespan="off", access_log=False, log_config=None,
                    timeout_keep_alive=30)
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
