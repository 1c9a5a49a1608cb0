"""One engine worker of a multi-instance server.

A worker is the ordinary single-instance server (`sloserve serve`: its own engine, admission,
QoS and metrics) plus one internal route, `GET /internal/state`, that publishes what the
front's router needs: the scheduler's `InstanceState` and the keys of the prefix blocks it
has cached. The same worker runs as a local process (`python -m sloserve.server.worker`) or
inside a Ray actor (`sloserve.server.instances.RayWorker`); the front talks HTTP to both.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
from typing import Any, Optional

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from sloserve.config import CacheConfig, EngineConfig, SchedulerConfig

logger = logging.getLogger(__name__)

API_KEYS_ENV = "SLOSERVE_WORKER_API_KEYS"  # newline-separated keys the front hands its workers
MAX_PUBLISHED_KEYS = 8192  # most recently cached blocks; enough to find every live conversation


def config_to_json(config: EngineConfig) -> str:
    return json.dumps(dataclasses.asdict(config))


def config_from_json(text: str) -> EngineConfig:
    d = json.loads(text)
    cache = CacheConfig(**d.pop("cache"))
    sched = SchedulerConfig(**d.pop("scheduler"))
    return EngineConfig(**d, cache=cache, scheduler=sched)


def state_payload(core: Any, max_keys: int = MAX_PUBLISHED_KEYS) -> dict:
    """The scheduler's snapshot and the newest cached block keys, as JSON.

    The engine thread owns these structures; reading them from the HTTP thread can race with
    a step that changes them, so a read that trips over a concurrent change is retried (the
    snapshot is advisory: the next poll corrects any staleness)."""
    for attempt in range(5):
        try:
            state = core.scheduler.snapshot(core.clock())
            cached = core.kv.pool.cached
            keys = list(cached.keys())[-max_keys:] if core.kv.enable_prefix_caching else []
            break
        except RuntimeError:  # "changed size during iteration"
            if attempt == 4:
                raise
    fields = {f.name: getattr(state, f.name) for f in dataclasses.fields(state) if f.name != "prefix_index"}
    if math.isinf(fields.get("min_ttft_slack_s", 0.0)):
        fields["min_ttft_slack_s"] = None
    return {"state": fields, "prefix_keys": [format(k, "x") for k in keys], "num_cached_blocks": len(keys)}


def add_worker_routes(app: FastAPI, core: Any) -> None:
    @app.get("/internal/state")
    async def internal_state() -> JSONResponse:
        return JSONResponse(state_payload(core))


def build_worker_app(engine_config: EngineConfig, settings):
    """Engine + app of one worker (the caller runs it and shuts the engine down)."""
    from sloserve.engine.async_engine import AsyncLLMEngine
    from sloserve.engine.llm_engine import LLMEngine
    from sloserve.server.app import build_app

    engine = AsyncLLMEngine(LLMEngine(engine_config))
    app = build_app(engine, settings)
    add_worker_routes(app, engine.engine)
    return engine, app


def settings_from_args(qos_config: Optional[str], api_keys: list[str], served_model_names: list[str],
                       max_queue: int):
    from sloserve.server.qos import QoSRegistry, load_qos_config
    from sloserve.server.settings import ServerSettings

    registry = load_qos_config(qos_config) if qos_config else QoSRegistry()
    return ServerSettings(served_model_names=list(served_model_names), registry=registry.with_keys(api_keys),
                          max_queue=max_queue, grace_period_s=0.0)


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
    args = p.parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(levelname)s worker:%(name)s: %(message)s")
    import os

    keys = [k for k in os.environ.get(API_KEYS_ENV, "").split("\n") if k]
    settings = settings_from_args(args.qos_config, keys, args.served_model_name, args.max_queue)
    engine, app = build_worker_app(config_from_json(args.config), settings)
    try:
        uvicorn.run(app, host=args.host, port=args.port, lifespan="off", access_log=False, log_config=None,
                    timeout_keep_alive=30)
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
